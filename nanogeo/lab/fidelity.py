"""
How faithfully does each method deliver the mean gradient?

    python -m nanogeo.lab.fidelity grads.pt [--methods bf16,fp8-block,geofp8] [--json OUT] [--last K]
                                        [--per_step] [--brief]

Reads a gradient file (nanogeo.lab.capture writes one), runs every method's full pipeline over the
steps in order - geometry is estimated only from earlier decoded means, exactly as in training,
with no training-time warm-up: a geometry built from step s is measured on step s + 1 and can be
used from step s + 2 on - and reports for the last K steps (averaged): per tensor and in total,
the relative L2 error of the decoded mean against the exact fp32 mean, cosine similarity, the
error in Adam-normalised units when the file has optimizer_v, and wire bytes per rank. Where
the file records the optimizer: update_err, the relative L2 difference of the update torch's
optimizer takes from the decoded vs the exact mean, per layer and per optimizer, and its floor
(update_floor); with --per_step also every step's total update error (JSON: "steps").

Methods (each with the two-stage e4m3 block-128 collective unless it says otherwise):
    bf16            the bf16 ring all-reduce
    fp8-tensor, fp8-row, fp8-block      Euclidean FP8, one scale per tensor / row / 128 values
    fp8-paper       Euclidean, the paper's collective: e5m2, one scale per tensor shared by all
                    ranks, one FP8 all_reduce SUM (fp16 adds, saturating), emulated in ring order
    geofp8          the published GeoFP8: K-FAC input whitening, low-rank 32 (needs `inputs`)
    geofp8-paper    the published method with the paper's collective, factor (low-rank applied
                    by a dense Cholesky factor, smoothed) and error feedback on its layers
    subspace, subspace-full     this project's rotation (r = 16; per matrix both sides or the
                                columns only, sides=auto; exact dense bases, both sides)
    nvfp4, geo-nvfp4, subspace-nvfp4    NVFP4 Euclidean / whitened / rotated
    nvfp4-e4m3s2    the mixed wire: each rank's send in NVFP4, the averaged shards in e4m3
    hadamard, hadamard-paper, hadamard-nvfp4    the geometry-agnostic control: a randomized
                    Hadamard transform (random signs, Walsh-Hadamard blocks of 128 along each
                    row; no statistics), on the default codec / the paper's codec and collective
                    (as fp8-paper) / NVFP4; hadamard:select=all uses it without the gain check
Any method takes Options overrides after colons, for ablations:
    geofp8:whiten_factor=diag   geofp8:whiten_factor=block:whiten_block=64   geofp8:whiten_rank=8
    geofp8:whiten_sides=both   geofp8:select=all   fp8-paper:sum_order=tree
    subspace:geo_rank=8   subspace:sides=left   fp8-block:error_feedback=1   fp8-block:block=32
    hadamard:hadamard_block=32   hadamard:hadamard_sides=both   hadamard:select=all
The whitening methods read each step's input (and output) second moments from the file. The
candidates are the file's `linear` weights (the model's nn.Linear modules; older files: every
matrix); the vocabulary's weights stay Euclidean: those the file names (`vocabulary`, found by
module at capture) or, with --vocab_size or an older file, those with a dimension of that size. Where the file records the optimizer, each layer's coordinates are chosen by the
error that optimizer sees (the replayed state before each step; `:geo_judge=l2` for plain L2).
"""

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

from nanogeo.parallel import hooks
from nanogeo.geometry import update_error
from nanogeo.wire import collective
from nanogeo.parallel.communicator import RENAMED, Options, ProductionCommunicator

PAPER_CODEC = dict(fmt="e5m2", block="tensor", collective="fp8-sum")
METHODS = {  # name -> Options fields (None: the bf16 ring all-reduce)
    "bf16": None,
    "fp8-tensor": dict(geometry="euclidean", block="tensor"),
    "fp8-row": dict(geometry="euclidean", block="row"),
    "fp8-block": dict(geometry="euclidean", block=128),
    "fp8-paper": dict(geometry="euclidean", **PAPER_CODEC),
    "geofp8": dict(geometry="geofp8"),
    "geofp8-paper": dict(geometry="geofp8", whiten_factor="lowrank-dense", factor_decay=0.95,
                         error_feedback=True, feedback_geo_only=True, **PAPER_CODEC),
    "subspace": dict(geometry="subspace"),
    "subspace-full": dict(geometry="subspace", full=True),
    "nvfp4": dict(geometry="euclidean", fmt="nvfp4"),
    "nvfp4-e4m3s2": dict(geometry="euclidean", fmt="nvfp4", stage2_fmt="e4m3"),
    "geo-nvfp4": dict(geometry="geofp8", fmt="nvfp4"),
    "subspace-nvfp4": dict(geometry="subspace", fmt="nvfp4"),
    "hadamard": dict(geometry="hadamard"),
    "hadamard-paper": dict(geometry="hadamard", **PAPER_CODEC),
    "hadamard-nvfp4": dict(geometry="hadamard", fmt="nvfp4"),
}
DEFAULT_METHODS = ("bf16,fp8-tensor,fp8-row,fp8-block,fp8-paper,geofp8,geofp8-paper,subspace,"
                   "hadamard,nvfp4")


def file_vocabulary(data, vocab_size=None):
    """(names, size) that keep a capture file's vocabulary weights Euclidean: the names the
    file records (found by module at capture: hooks.vocabulary_layers) and size 0, or - with
    `vocab_size` given, or an older file without names - no names and that size (by shape)."""
    if vocab_size is None and "vocabulary" in data:
        return tuple(data["vocabulary"]), 0
    return (), data.get("vocab_size", 0) if vocab_size is None else vocab_size


def method_options(spec, vocab_size, vocabulary=()):
    """'subspace:geo_rank=8:sides=left' -> Options (or None for bf16). The vocabulary's
    weights stay Euclidean: `vocabulary` names them, or `vocab_size` finds them by shape."""
    name, *overrides = spec.split(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    if METHODS[name] is None:
        if overrides:
            raise ValueError("bf16 takes no options")
        return None
    fields = {f.name: f for f in dataclasses.fields(Options)}
    options = dict(METHODS[name], vocab_size=vocab_size, vocabulary=tuple(vocabulary))
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in fields:
            renamed = f" (now {RENAMED[key]!r})" if key in RENAMED else ""
            raise ValueError(f"{spec}: unknown option {key!r}{renamed}; options: {', '.join(fields)}")
        default = fields[key].default
        if isinstance(default, bool):
            options[key] = value.lower() in ("1", "true", "yes")
        elif key == "block":
            options[key] = int(value) if value.isdigit() else value
        elif key == "geo_layers":
            options[key] = tuple(value.split("+"))
        else:
            options[key] = type(default)(value)
    return Options.of(**options)


def bf16_ring_mean(worker_grads):
    """What a bf16 ring all-reduce delivers: every hop adds in bf16, the mean is rounded to bf16."""
    means = []
    for tensors in zip(*worker_grads):
        acc = tensors[0].bfloat16()
        for t in tensors[1:]:
            acc = (acc.float() + t.bfloat16().float()).bfloat16()
        means.append((acc.float() / len(tensors)).bfloat16().float())
    numel = sum(t.numel() for t in worker_grads[0])
    return means, collective.ring_allreduce_bytes(numel, 2, len(worker_grads))


def tensor_bytes(layout, index):
    """Bytes per rank (averaged over ranks) that carry tensor `index`: its stage-1 pieces for
    the other ranks plus its stage-2 piece to the W - 1 others (all_gather padding excluded;
    stage 2 in its own format where the layout has one, --stage2_fmt)."""
    world = layout.world_size
    stage2 = getattr(layout, "stage2_layout", layout)
    total = 0
    for pieces, sizes, sizes2 in zip(layout.pieces, layout.piece_nbytes, stage2.piece_nbytes):
        for p, nbytes, nbytes2 in zip(pieces, sizes, sizes2):
            if p.index == index:
                total += (world - 1) * (nbytes + nbytes2)   # to j by W - 1; by j to W - 1
    return total / world


def run_method(spec, steps, names, vocab_size, moments=None, linear=None, views=None,
               vocabulary=()):
    """Means delivered by one method for every step, and bytes per rank, plus coords used.
    moments[s] = {"input": {name: A}, "output": {name: G}} of step s, for the whitening;
    linear: the names of the model's nn.Linear weights (the candidates; None: every matrix);
    views[s] = {name: update_error.OptimizerView} before step s (the selection's error measure)."""
    options = method_options(spec, vocab_size, vocabulary)
    shapes = [steps[0][0][n].shape for n in names]
    results = []
    if options is None:
        for workers in steps:
            means, sent = bf16_ring_mean([[w[n] for n in names] for w in workers])
            per_tensor = [2 * (len(workers) - 1) * math.prod(s) * 2 / len(workers) for s in shapes]
            results.append((means, sent, per_tensor, ["euclidean"] * len(names)))
        return results
    comm = ProductionCommunicator(list(zip(names, shapes)), options, linear=linear)
    if comm.moment_layers() and moments is None:
        raise ValueError(f"{spec} whitens with each layer's input second moments, but the file "
                         "has no 'inputs'; capture one with `python -m nanogeo.lab.capture`")
    world = len(steps[0])
    if options.collective == "fp8-sum":   # one byte per element in a ring all-reduce
        per_tensor = [collective.ring_allreduce_bytes(math.prod(s), 1, world) for s in shapes]
    else:
        layout = collective.shard_layout(tuple(tuple(s) for s in shapes), options.fmt,
                                         options.block, world, options.stage2_fmt)
        per_tensor = [tensor_bytes(layout, i) for i in range(len(names))]  # fixed by the shapes
    for s, workers in enumerate(steps):
        coords = [comm.coords(n) for n in names]  # the coordinates this step is sent in
        if views:
            comm.watch(views[s])
        means, sent = comm.reduce_workers([[w[n] for n in names] for w in workers],
                                          moments[s] if moments else None)
        results.append((means, sent, per_tensor, coords))
    return results


def optimizer_step(record, state, grads, grad_clip):
    """One step of the file's optimizers (torch's own classes, rebuilt from their recorded
    constructor arguments) from `state`, on parameters at zero, with `grads` clipped by their
    global norm as in training. Returns ({name: update}, {name: new state}). The parameters
    start at zero, so the update holds exactly the gradient-driven part: weight decay moves the
    same parameter by the same amount whatever the gradient, so it drops out of the difference."""
    params = {n: torch.zeros_like(g, requires_grad=True) for n, g in grads.items()}
    scale = 1.0
    if grad_clip > 0:
        norm = torch.stack([g.norm() for g in grads.values()]).norm().item()
        scale = min(1.0, grad_clip / (norm + 1e-6))           # clip_grad_norm_'s rule
    optimizers = []
    for group in record["groups"]:
        opt = getattr(torch.optim, group["class"])([params[n] for n in group["params"]],
                                                   **group["hyper"])
        for n in group["params"]:
            if n in state:
                opt.state[params[n]] = {k: v.clone() if torch.is_tensor(v) else v
                                        for k, v in state[n].items()}
            params[n].grad = grads[n] * scale
        optimizers.append(opt)
    with torch.no_grad():
        for opt in optimizers:
            opt.step()
    new_state = {n: dict(opt.state[params[n]]) for opt, group in zip(optimizers, record["groups"])
                 for n in group["params"]}
    return {n: p.detach() for n, p in params.items()}, new_state


def optimizer_classes(record):
    """{name: "adamw" | "muon"}: the optimizer each parameter belongs to."""
    return {n: group["class"].lower() for group in record["groups"] for n in group["params"]}


def optimizer_views(record, states):
    """Per step {name: update_error.OptimizerView}: the file's optimizers with the state they had
    before that step (replayed on the exact means), as the communicator's selection reads them."""
    kinds = {group["class"]: hooks.OPTIMIZER_KINDS.get(group["class"])
             for group in record["groups"]}
    return [{n: update_error.OptimizerView(kinds[group["class"]], lambda group=group: group["hyper"],
                                       lambda state=state, n=n: state.get(n, {}))
             for group in record["groups"] if kinds[group["class"]] for n in group["params"]}
            for state in states]


def exact_updates(record, exact, grad_clip):
    """Replay the optimizer on the exact means: (state before each step, exact update of each
    step)."""
    states, updates, state = [], [], record["state"]
    for mean in exact:
        states.append(state)
        update, state = optimizer_step(record, state, mean, grad_clip)
        updates.append(update)
    return states, updates


def file_moments(data):
    """Per step {"input": {name: A}, "output": {name: G}} from a gradient file, or None."""
    if "inputs" not in data:
        return None
    outputs = data.get("outputs") or [{} for _ in data["inputs"]]
    return [{"input": a, "output": g} for a, g in zip(data["inputs"], outputs)]


def update_errors(record, states, exact, results, names, classes, grad_clip):
    """The relative L2 difference between the update the file's optimizer takes from the
    decoded mean and from the exact mean, per layer and per optimizer ("adamw", "muon"; over all
    of its parameters), averaged over the steps given."""
    layers = {n: {classes[n]: 0.0} for n in names}
    total = {c: 0.0 for c in sorted(set(classes.values()))}   # a fixed order for the table
    for state, ref, (means, *_) in zip(states, exact, results):
        update, _ = optimizer_step(record, state, dict(zip(names, means)), grad_clip)
        err2 = {c: 0.0 for c in total}
        ref2 = {c: 0.0 for c in total}
        for n in names:
            e2, r2 = (update[n] - ref[n]).pow(2).sum().item(), ref[n].pow(2).sum().item()
            layers[n][classes[n]] += math.sqrt(e2 / r2) / len(states) if r2 else 0.0
            err2[classes[n]] += e2
            ref2[classes[n]] += r2
        for c in total:
            total[c] += math.sqrt(err2[c] / ref2[c]) / len(states) if ref2[c] else 0.0
    return {"total": total, "layers": layers}


def update_floor(record, states, updates, exact, names, classes, grad_clip, size=1e-3):
    """The update error of a negligible change: every element of the exact mean moved by a
    relative 1e-3 (30x below FP8's rounding). torch.optim.Muon orthogonalises in bf16, so any
    change of its input re-rolls its rounding: no codec can score below this floor."""
    g = torch.Generator().manual_seed(0)
    moved = [([m[n] * (1 + size * torch.randn(m[n].shape, generator=g)) for n in names],)
             for m in exact]
    return update_errors(record, states, updates, moved, names, classes, grad_clip)["total"]


def load_gradient_file(path):
    """A gradient file (nanogeo.lab.capture), or an error that says how to write one."""
    fix = f"write one with `python -m nanogeo.lab.capture --out {path}`"
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist; {fix}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:      # empty, truncated or not a torch file at all
        raise ValueError(f"{path} is not a gradient file ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(data, dict) or not data.get("steps"):
        raise ValueError(f"{path} is not a gradient file (no captured steps); {fix}")
    return data


def evaluate(path, methods, last=1, vocab_size=None, round_trip=False, workers=None):
    """The report for every method spec. round_trip=True sends the exact mean once through each
    codec instead of the workers through the collective (the paper's Table I: one FP8 round
    trip; the collectives are idempotent for a single worker). workers=K uses the file's first
    K workers only (error growth with W on one model state)."""
    data = load_gradient_file(path)
    steps = [step[:workers] for step in data["steps"]] if workers else data["steps"]
    if not steps or not steps[0]:
        raise ValueError(f"{path} holds no steps")
    names = list(steps[0][0])
    if round_trip:
        steps = [[{n: sum(w[n].float() for w in workers) / len(workers) for n in names}]
                 for workers in steps]
    adam_v = data.get("optimizer_v")
    vocabulary, vocab_size = file_vocabulary(data, vocab_size)
    moments = file_moments(data)
    exact = [{n: sum(w[n].float() for w in workers) / len(workers) for n in names}
             for workers in steps]
    record, grad_clip = data.get("optimizer"), data.get("grad_clip", 0.0)
    views = None
    if record is not None:      # what the optimizer does with the exact means, step by step
        classes = optimizer_classes(record)
        states, updates = exact_updates(record, exact, grad_clip)
        views = optimizer_views(record, states)
    linear = set(data["linear"]) if "linear" in data else None
    if record is not None:
        floor = update_floor(record, states[-last:], updates[-last:], exact[-last:], names,
                             classes, grad_clip)
    report = {}
    for spec in methods:
        results = run_method(spec, steps, names, vocab_size, moments, linear, views, vocabulary)
        layers = {n: {"rel_err": 0.0, "cos": 0.0, "bytes": 0.0, "ref_norm": 0.0, "max_err": 0.0,
                      "mse": 0.0} for n in names}
        total = {"rel_err": 0.0, "cos": 0.0, "bytes": 0.0, "matrices_rel_err": 0.0}
        if adam_v is not None:
            total["adam_rel_err"] = 0.0
        chosen = results[-last:]
        per_step = []
        if record is not None:
            update_err = update_errors(record, states[-last:], updates[-last:], chosen, names,
                                       classes, grad_clip)
            total["update_err"] = update_err["total"]
            total["update_err_floor"] = floor
            for n in names:
                layers[n]["update_err"] = update_err["layers"][n]
            # every step on its own: a method must do no harm from its first step on
            per_step = [update_errors(record, [s], [u], [r], names, classes, grad_clip)
                        for s, u, r in zip(states, updates, results)]
        for (means, sent, per_tensor, coords), ref in zip(chosen, exact[-last:]):
            err2 = ref2 = mat_err2 = mat_ref2 = dot = mean2 = adam_err2 = adam_ref2 = 0.0
            for n, m, b, c in zip(names, means, per_tensor, coords):
                r = ref[n]
                e2, r2 = (m - r).pow(2).sum().item(), r.pow(2).sum().item()
                d, m2 = (m * r).sum().item(), m.pow(2).sum().item()
                layer = layers[n]
                layer["rel_err"] += math.sqrt(e2 / r2) / last if r2 else 0.0
                layer["cos"] += d / math.sqrt(r2 * m2) / last if r2 and m2 else 0.0
                layer["bytes"] += b / last
                layer["ref_norm"] += math.sqrt(r2) / last
                layer["max_err"] += (m - r).abs().max().item() / last
                layer["mse"] += e2 / r.numel() / last
                layer["coords"] = c
                err2, ref2, dot, mean2 = err2 + e2, ref2 + r2, dot + d, mean2 + m2
                if r.dim() == 2 and n not in vocabulary and vocab_size not in r.shape:
                    # the matrices but the vocabulary's
                    mat_err2, mat_ref2 = mat_err2 + e2, mat_ref2 + r2
                if adam_v is not None and n in adam_v:      # AdamW's parameters
                    scale = adam_v[n].sqrt() + 1e-8
                    adam_err2 += ((m - r) / scale).pow(2).sum().item()
                    adam_ref2 += (r / scale).pow(2).sum().item()
            total["rel_err"] += math.sqrt(err2 / ref2) / last
            total["cos"] += dot / math.sqrt(ref2 * mean2) / last
            total["bytes"] += sent / last
            total["matrices_rel_err"] += math.sqrt(mat_err2 / mat_ref2) / last if mat_ref2 else 0.0
            if adam_v is not None:
                total["adam_rel_err"] += math.sqrt(adam_err2 / adam_ref2) / last
        report[spec] = {"total": total, "layers": layers, "steps": per_step}
    return report


def print_steps(report):
    """The total update error of every step (all of the file's steps, not only the last K),
    per optimizer, each method also as a multiple of the first method's."""
    methods = list(report)
    steps = report[methods[0]]["steps"]
    if not steps:
        print("(no per-step update errors: the file records no optimizer)")
        return
    for c in steps[0]["total"]:
        print(f"update_err {c} by step" + "".join(f"{m[:16]:>17s}" for m in methods)
              + f"   (x {methods[0]})")
        for s in range(len(steps)):
            base = steps[s]["total"][c]
            values = [report[m]["steps"][s]["total"][c] for m in methods]
            print(f"{'step ' + str(s):22s}" + "".join(f"{v:17.4f}" for v in values) + "   "
                  + " ".join(f"{v / base:.2f}" if base else "-" for v in values[1:]))


def print_report(report):
    methods = list(report)
    names = list(next(iter(report.values()))["layers"])
    print(f"{'tensor':34s}" + "".join(f"{m[:16]:>17s}" for m in methods))
    for n in names:
        cells = []
        for m in methods:
            layer = report[m]["layers"][n]
            tag = "g" if layer["coords"] == "geo" else " "
            cells.append(f"{layer['rel_err']:16.4f}{tag}")
        print(f"{n[:34]:34s}" + "".join(cells))
    print("-" * (34 + 17 * len(methods)))
    for key in ("rel_err", "matrices_rel_err", "adam_rel_err", "cos", "bytes"):
        if key in report[methods[0]]["total"]:
            print(f"{'TOTAL ' + key:34s}" + "".join(
                f"{report[m]['total'][key]:17.4f}" if key != "bytes"
                else f"{report[m]['total'][key] / 1e6:15.3f}MB" for m in methods))
    for c in report[methods[0]]["total"].get("update_err", {}):
        print(f"{'TOTAL update_err ' + c:34s}" + "".join(
            f"{report[m]['total']['update_err'][c]:17.4f}" for m in methods)
            + f"   (floor {report[methods[0]]['total']['update_err_floor'][c]:.4f})")
    base = report.get("bf16")
    if base:
        print(f"{'bytes vs bf16 ring':34s}" + "".join(
            f"{report[m]['total']['bytes'] / base['total']['bytes']:17.3f}" for m in methods))
    print("(g = sent in geometry-aware coordinates)")


def print_brief(report):
    """One row per method: its bytes against the bf16 ring's (when bf16 is among the methods),
    the relative L2 error of the mean and, where the file records its optimizer, the update
    error each optimizer sees (the error that matters: README, "What the optimizer sees")."""
    methods, base = list(report), report.get("bf16")
    optimizers = list(report[methods[0]]["total"].get("update_err", {}))
    print(f"{'method':34s}{'bytes vs bf16':>14s}{'rel. L2':>10s}"
          + "".join(f"{'update err ' + c:>18s}" for c in optimizers))
    for m in methods:
        total = report[m]["total"]
        ratio = f"{total['bytes'] / base['total']['bytes']:14.3f}" if base else f"{'-':>14s}"
        print(f"{m[:34]:34s}{ratio}{total['rel_err']:10.4f}"
              + "".join(f"{total['update_err'][c]:18.4f}" for c in optimizers))


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(next(iter(report.values()))["layers"])
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.35), 5))
    width = 0.8 / len(report)
    for k, (method, result) in enumerate(report.items()):
        ax.bar([i + k * width for i in range(len(names))],
               [result["layers"][n]["rel_err"] for n in names], width, label=method)
    ax.set_xticks([i + 0.4 for i in range(len(names))], names, rotation=90, fontsize=6)
    ax.set_ylabel("relative L2 error of the mean")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("path")
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="per-layer error bars (needs matplotlib)")
    parser.add_argument("--last", type=int, default=1, help="average over the last K steps")
    parser.add_argument("--vocab_size", type=int, default=None,
                        help="vocabulary size (default: the file's vocab_size; 0 = none)")
    parser.add_argument("--per_step", action="store_true",
                        help="also print every step's total update error (files with an optimizer)")
    parser.add_argument("--round_trip", action="store_true",
                        help="one codec round trip of the exact mean instead of the collective")
    parser.add_argument("--brief", action="store_true",
                        help="only the totals, one row per method (bytes vs bf16, errors)")
    args = parser.parse_args(argv)
    try:
        report = evaluate(args.path, args.methods.split(","), args.last, args.vocab_size,
                          args.round_trip)
    except (ValueError, FileNotFoundError, KeyError) as e:
        sys.exit(f"nanogeo.lab.fidelity: error: {e}")
    (print_brief if args.brief else print_report)(report)
    if args.per_step:
        print_steps(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
