import json
import os

import numpy as np
import pytest

import prepare_data
from prepare_data import ShardError, ShardWriter, read_header, read_shard


def test_tokenizer_loads_offline_and_round_trips(monkeypatch):
    # no network: make any download attempt fail loudly
    import tiktoken
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: pytest.fail("tried to download"))
    enc = prepare_data.get_tokenizer()
    text = "O Romeo, Romeo! wherefore art thou Romeo?\n  Deny thy father"
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's ids
    assert enc.n_vocab == 50257 and enc.eot_token == 50256


def test_shard_round_trip(tmp_path):
    path = str(tmp_path / "x.bin")
    writer = ShardWriter(path, "gpt2", 50257)
    writer.write([1, 2, 3])
    writer.write(np.array([50256, 65535]))
    writer.close()
    assert read_header(path) == (5, "gpt2", 50257)
    assert read_shard(path).tolist() == [1, 2, 3, 50256, 65535]
    assert not os.path.exists(path + ".tmp")


def write_shard(path, tokens):
    writer = ShardWriter(str(path), "gpt2", 50257)
    writer.write(tokens)
    writer.close()


def test_bad_shards_are_rejected(tmp_path):
    good = tmp_path / "good.bin"
    write_shard(good, list(range(100)))
    raw = good.read_bytes()
    (tmp_path / "short.bin").write_bytes(raw[:-2])
    with pytest.raises(ShardError, match="truncated or corrupt"):
        read_header(str(tmp_path / "short.bin"))
    (tmp_path / "magic.bin").write_bytes(b"\x01\x02\x03\x04" + raw[4:])
    with pytest.raises(ShardError, match="not a nanogeo shard"):
        read_header(str(tmp_path / "magic.bin"))
    (tmp_path / "version.bin").write_bytes(raw[:4] + (7).to_bytes(4, "little") + raw[8:])
    with pytest.raises(ShardError, match="version 7"):
        read_header(str(tmp_path / "version.bin"))
    (tmp_path / "tiny.bin").write_bytes(raw[:100])
    with pytest.raises(ShardError, match="shorter than"):
        read_header(str(tmp_path / "tiny.bin"))
    with pytest.raises(ShardError, match="does not exist"):
        read_header(str(tmp_path / "missing.bin"))


def test_prepare_txt_and_jsonl(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "a.txt").write_text("First document.\n" * 50)
    with open(tmp_path / "in" / "sub" / "b.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"Document number {i}.", "id": i}) + "\n")
    out = tmp_path / "out"
    prepare_data.main([str(tmp_path / "in"), "--out_dir", str(out), "--chunk_tokens", "16",
                       "--val_every", "4"])
    train, val = read_shard(str(out / "train.bin")), read_shard(str(out / "val.bin"))
    enc = prepare_data.get_tokenizer()
    everything = np.concatenate([train, val])
    assert (everything == 50256).sum() == 41  # one separator per document
    assert len(val) > 0 and abs(len(val) / len(everything) - 0.25) < 0.1
    text = enc.decode(train.tolist())
    assert "First document." in text and "Document number 0." in text
    # deterministic: a second run gives identical shards
    prepare_data.main([str(tmp_path / "in"), "--out_dir", str(out), "--chunk_tokens", "16",
                       "--val_every", "4", "--overwrite"])
    assert read_shard(str(out / "val.bin")).tolist() == val.tolist()


def test_prepare_refuses_to_overwrite_and_bad_inputs(tmp_path):
    (tmp_path / "a.txt").write_text("hello there\n")
    out = tmp_path / "out"
    prepare_data.main([str(tmp_path / "a.txt"), "--out_dir", str(out)])
    before = (out / "train.bin").read_bytes()
    with pytest.raises(SystemExit, match="--overwrite"):
        prepare_data.main([str(tmp_path / "a.txt"), "--out_dir", str(out)])
    assert (out / "train.bin").read_bytes() == before
    with pytest.raises(SystemExit, match="does not exist"):
        prepare_data.main([str(tmp_path / "nope.txt"), "--out_dir", str(out)])
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(SystemExit, match="'text' field"):
        prepare_data.main([str(tmp_path / "bad.jsonl"), "--out_dir", str(tmp_path / "o2")])


def test_char_tokenizer(tmp_path):
    """--tokenizer char: one id per character of the inputs (sorted), the end-of-document id
    last, the vocabulary in vocab.json; the shards decode back to the text."""
    (tmp_path / "a.txt").write_text("to be, or not")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "be!"}) + "\n")
    out = tmp_path / "out"
    prepare_data.main([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--out_dir", str(out),
                       "--tokenizer", "char", "--chunk_tokens=4", "--val_every=1000"])
    vocab = json.load(open(out / "vocab.json"))
    assert vocab["chars"] == sorted(set("to be, or not!")) and vocab["eot"] == len(vocab["chars"])
    count, name, n_vocab = read_header(str(out / "train.bin"))
    assert (name, n_vocab, count) == ("char", len(vocab["chars"]) + 1, len("to be, or not") + 5)
    tokens = read_shard(str(out / "train.bin")).tolist()
    chars = vocab["chars"] + ["|"]
    assert "".join(chars[t] for t in tokens) == "to be, or not|be!|"
