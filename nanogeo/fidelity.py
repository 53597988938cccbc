"""
How faithfully does each method deliver the mean gradient? (DESIGN.md section 5)

    python -m nanogeo.fidelity grads.pt [--methods bf16,fp8-block,geofp8] [--json OUT] [--last K]

Reads a gradient file (nanogeo.capture writes one), runs every method's full pipeline over the
steps in order - geometry is estimated only from earlier decoded means, exactly as in training,
with no training-time warm-up, so GeoFP8 can use geometry-aware coordinates from the second step
on - and reports for the last K steps (averaged): per tensor and in total, the relative L2 error
of the decoded mean against the exact fp32 mean, cosine similarity, the error in Adam-normalised
units when the file has optimizer_v, and wire bytes per rank.

Methods: bf16, fp8-tensor, fp8-row, fp8-block, geofp8, geofp8-full, nvfp4, geo-nvfp4.
Any method takes GeoOptions overrides after colons, for ablations:
    geofp8:rank=8   geofp8:sides=left   geofp8:basis=random   fp8-block:block=32
    geofp8:refresh=4:decay=0.5   fp8-block:error_feedback=1   geofp8:stochastic=1
"""

import argparse
import dataclasses
import json
import math
import sys

import torch

import compress

METHODS = {  # name -> GeoOptions fields (None: the bf16 ring all-reduce)
    "bf16": None,
    "fp8-tensor": dict(geo=False, block="tensor"),
    "fp8-row": dict(geo=False, block="row"),
    "fp8-block": dict(geo=False, block=128),
    "geofp8": dict(geo=True),
    "geofp8-full": dict(geo=True, full=True),
    "nvfp4": dict(geo=False, fmt="nvfp4"),
    "geo-nvfp4": dict(geo=True, fmt="nvfp4"),
}
DEFAULT_METHODS = "bf16,fp8-tensor,fp8-row,fp8-block,geofp8,nvfp4,geo-nvfp4"


def method_options(spec, vocab_size):
    """'geofp8:rank=8:sides=left' -> GeoOptions (or None for bf16)."""
    name, *overrides = spec.split(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    if METHODS[name] is None:
        if overrides:
            raise ValueError("bf16 takes no options")
        return None
    fields = {f.name: f for f in dataclasses.fields(compress.GeoOptions)}
    options = dict(METHODS[name], vocab_size=vocab_size)
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"{spec}: unknown option {key!r}; options: {', '.join(fields)}")
        default = fields[key].default
        if isinstance(default, bool):
            options[key] = value.lower() in ("1", "true", "yes")
        elif key == "block":
            options[key] = int(value) if value.isdigit() else value
        else:
            options[key] = type(default)(value)
    return compress.GeoOptions(**options)


def bf16_ring_mean(worker_grads):
    """What a bf16 ring all-reduce delivers: every hop adds in bf16, the mean is rounded to bf16."""
    means = []
    for tensors in zip(*worker_grads):
        acc = tensors[0].bfloat16()
        for t in tensors[1:]:
            acc = (acc.float() + t.bfloat16().float()).bfloat16()
        means.append((acc.float() / len(tensors)).bfloat16().float())
    world = len(worker_grads)
    numel = sum(t.numel() for t in worker_grads[0])
    return means, 2 * (world - 1) * numel * 2 / world


def tensor_bytes(layout, index):
    """Bytes per rank (averaged over ranks) that carry tensor `index`: its stage-1 pieces for
    the other ranks plus its stage-2 piece to the W - 1 others (all_gather padding excluded)."""
    world = layout.world_size
    total = 0
    for j, pieces in enumerate(layout.pieces):
        for p in pieces:
            if p.tensor == index:
                total += (world - 1) * p.nbytes * 2  # sent to j by W-1 ranks; sent by j to W-1
    return total / world


def run_method(spec, steps, names, vocab_size):
    """Means delivered by one method for every step, and bytes per rank, plus coords used."""
    options = method_options(spec, vocab_size)
    shapes = [steps[0][0][n].shape for n in names]
    results = []
    if options is None:
        for workers in steps:
            means, sent = bf16_ring_mean([[w[n] for n in names] for w in workers])
            per_tensor = [2 * (len(workers) - 1) * math.prod(s) * 2 / len(workers) for s in shapes]
            results.append((means, sent, per_tensor, ["euclidean"] * len(names)))
        return results
    comm = compress.GeoFP8Communicator(list(zip(names, shapes)), options)
    layout = compress.shard_layout(tuple(tuple(s) for s in shapes), options.fmt, options.block,
                                   len(steps[0]))
    per_tensor = [tensor_bytes(layout, i) for i in range(len(names))]  # fixed by the shapes
    for workers in steps:
        coords = [comm.coords(n) for n in names]  # the coordinates this step is sent in
        means, sent = comm.reduce_workers([[w[n] for n in names] for w in workers])
        results.append((means, sent, per_tensor, coords))
    return results


def evaluate(path, methods, last=1):
    data = torch.load(path, map_location="cpu", weights_only=True)
    steps = data["steps"]
    if not steps or not steps[0]:
        raise ValueError(f"{path} holds no steps")
    names = list(steps[0][0])
    adam_v = data.get("optimizer_v")
    vocab_size = max(max(t.shape) for t in steps[0][0].values())  # the largest dimension
    exact = [{n: sum(w[n].float() for w in workers) / len(workers) for n in names}
             for workers in steps]
    report = {}
    for spec in methods:
        results = run_method(spec, steps, names, vocab_size)
        layers = {n: {"rel_err": 0.0, "cos": 0.0, "bytes": 0.0, "ref_norm": 0.0} for n in names}
        total = {"rel_err": 0.0, "cos": 0.0, "bytes": 0.0, "matrices_rel_err": 0.0}
        if adam_v is not None:
            total["adam_rel_err"] = 0.0
        chosen = results[-last:]
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
                layer["coords"] = c
                err2, ref2, dot, mean2 = err2 + e2, ref2 + r2, dot + d, mean2 + m2
                if r.dim() == 2 and vocab_size not in r.shape:  # the transformer matrices
                    mat_err2, mat_ref2 = mat_err2 + e2, mat_ref2 + r2
                if adam_v is not None:
                    scale = adam_v[n].sqrt() + 1e-8
                    adam_err2 += ((m - r) / scale).pow(2).sum().item()
                    adam_ref2 += (r / scale).pow(2).sum().item()
            total["rel_err"] += math.sqrt(err2 / ref2) / last
            total["cos"] += dot / math.sqrt(ref2 * mean2) / last
            total["bytes"] += sent / last
            total["matrices_rel_err"] += math.sqrt(mat_err2 / mat_ref2) / last if mat_ref2 else 0.0
            if adam_v is not None:
                total["adam_rel_err"] += math.sqrt(adam_err2 / adam_ref2) / last
        report[spec] = {"total": total, "layers": layers}
    return report


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
    base = report.get("bf16")
    if base:
        print(f"{'bytes vs bf16 ring':34s}" + "".join(
            f"{report[m]['total']['bytes'] / base['total']['bytes']:17.3f}" for m in methods))
    print("(g = sent in geometry-aware coordinates)")


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
    args = parser.parse_args(argv)
    try:
        report = evaluate(args.path, args.methods.split(","), args.last)
    except (ValueError, FileNotFoundError, KeyError) as e:
        sys.exit(f"nanogeo.fidelity: error: {e}")
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
