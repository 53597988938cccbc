"""
The GeoFP8 paper's Tables I and II, reproduced on a gradient file of this project's model.

    python -m nanogeo.lab.tables grads.pt --last 3                       # Table I: one round trip
    python -m nanogeo.lab.tables grads.pt --last 3 --codec two-stage     # through the collectives
    python -m nanogeo.lab.tables grads_w32.pt --last 2 --codec fp8-sum --workers 8   # W = 8 of 32

Every row sends the same captured gradients with a different geometry and reports, for the MLP
down-projections (--group, the weights whose name ends so) and for all matrices (every 2-D
tensor without a vocabulary dimension), the relative L2 error of the decoded mean against the
exact fp32 mean, the mean cosine, the largest elementwise error and the mean squared error -
next to the paper's number and as a ratio to the Euclidean row. Codecs:

    round-trip   one e5m2 per-tensor round trip of the exact mean (the paper's Table I)
    fp8-sum      the paper's collective over the file's W workers: shared per-tensor e5m2 scale,
                 FP8 all_reduce SUM emulated hop by hop (ring order)
    two-stage    this project's collective: e4m3, block-128 scales, fp32 sums

Every geometry row whitens all candidate matrices (select=all) so that each row measures the
transform itself; the published deployment whitens a profiled subset (nanogeo.lab.profile).
Factors come from the file's input (and output) second moments of earlier steps, exactly as in
training (refresh every 50 steps: the first step's factors serve the steps after it). The last
row is the geometry-agnostic control (nanogeo/geometry/hadamard.py): random signs and Walsh-Hadamard
blocks of 128 along each row, no statistics - the paper has no number for it.
"""

import argparse
import json
import math
import sys

from nanogeo.lab import fidelity

# (label, geometry options, the paper's one-round-trip relative L2 error)
ROWS = [
    ("Euclidean", "", 5.28e-2),
    ("output side only (full G)", "geometry=geofp8:whiten_sides=output:whiten_factor=full", 5.28e-2),
    ("input side only (full A)", "geometry=geofp8:whiten_factor=full", 1.77e-2),
    ("two-sided (full A, G)", "geometry=geofp8:whiten_sides=both:whiten_factor=full", 1.77e-2),
    ("diag A", "geometry=geofp8:whiten_factor=diag", 5.26e-2),
    ("block A 32", "geometry=geofp8:whiten_factor=block:whiten_block=32", 3.17e-2),
    ("block A 64", "geometry=geofp8:whiten_factor=block:whiten_block=64", 2.75e-2),
    ("block A 128", "geometry=geofp8:whiten_factor=block:whiten_block=128", 2.43e-2),
    ("low-rank A 8", "geometry=geofp8:whiten_factor=lowrank:whiten_rank=8", 1.96e-2),
    ("low-rank A 16", "geometry=geofp8:whiten_factor=lowrank:whiten_rank=16", 1.73e-2),
    ("low-rank A 32", "geometry=geofp8:whiten_factor=lowrank:whiten_rank=32", 1.72e-2),
    ("low-rank A 32, dense Cholesky", "geometry=geofp8:whiten_factor=lowrank-dense:whiten_rank=32", None),
    ("randomized Hadamard (control)", "geometry=hadamard", None),
]
CODECS = {"round-trip": "fp8-paper", "fp8-sum": "fp8-paper", "two-stage": "fp8-block"}


def spec(codec, options):
    base = CODECS[codec]
    if not options:
        return base
    return f"{base}:{options}:select=all:min_numel=0"


def group_summary(layers, names):
    """Relative L2 over the group (from each layer's error and reference norms), mean cosine,
    largest elementwise error, mean of the layers' MSE."""
    err2 = sum((layers[n]["rel_err"] * layers[n]["ref_norm"]) ** 2 for n in names)
    ref2 = sum(layers[n]["ref_norm"] ** 2 for n in names)
    return {"rel_err": math.sqrt(err2 / ref2) if ref2 else float("nan"),
            "cos": sum(layers[n]["cos"] for n in names) / len(names),
            "max_err": max(layers[n]["max_err"] for n in names),
            "mse": sum(layers[n]["mse"] for n in names) / len(names)}


def tables(path, codec="round-trip", last=1, group="mlp.w2.weight", vocab_size=None,
           workers=None):
    data = fidelity.load_gradient_file(path)
    vocabulary, vocab = fidelity.file_vocabulary(data, vocab_size)
    shapes = {n: t.shape for n, t in data["steps"][0][0].items()}
    matrices = [n for n, s in shapes.items()
                if len(s) == 2 and n not in vocabulary and vocab not in s]
    down = [n for n in matrices if n.endswith(group)]
    if not down:
        raise ValueError(f"no matrix name ends with --group={group}")
    specs = [spec(codec, options) for _, options, _ in ROWS]
    report = fidelity.evaluate(path, specs, last, vocab_size, codec == "round-trip", workers)
    rows = []
    for (label, _, paper), s in zip(ROWS, specs):
        layers = report[s]["layers"]
        rows.append({"row": label, "spec": s, "paper_rel_err": paper,
                     "down": group_summary(layers, down), "all": group_summary(layers, matrices),
                     "geo_matrices": sum(layers[n]["coords"] == "geo" for n in matrices)})
    for r in rows:
        for key in ("down", "all"):
            r[key]["vs_euclid"] = r[key]["rel_err"] / rows[0][key]["rel_err"]
    return {"codec": codec, "workers": workers or len(data["steps"][0]), "last": last, "group": group,
            "down_matrices": len(down), "matrices": len(matrices), "rows": rows}


def print_tables(result):
    print(f"codec {result['codec']}, {result['workers']} workers in the file, last "
          f"{result['last']} steps; '{result['group']}': {result['down_matrices']} matrices, "
          f"all: {result['matrices']}")
    print(f"{'':32s} {'--- down-projections ---':>35s}   {'--- all matrices ---':>27s}   "
          f"{'--- paper ---':>17s}")
    print(f"{'row':32s} {'rel L2':>8s} {'x Eucl':>7s} {'cos':>8s} {'max err':>9s}   "
          f"{'rel L2':>8s} {'x Eucl':>7s} {'cos':>8s}   {'rel L2':>8s} {'x Eucl':>7s}")
    base = ROWS[0][2]
    for r in result["rows"]:
        d, a = r["down"], r["all"]
        paper = (f"{r['paper_rel_err']:8.2e} {r['paper_rel_err'] / base:7.2f}"
                 if r["paper_rel_err"] else f"{'-':>8s} {'-':>7s}")
        print(f"{r['row']:32s} {d['rel_err']:8.2e} {d['vs_euclid']:7.2f} {d['cos']:8.5f} "
              f"{d['max_err']:9.2e}   {a['rel_err']:8.2e} {a['vs_euclid']:7.2f} {a['cos']:8.5f}   "
              f"{paper}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("path")
    parser.add_argument("--codec", default="round-trip", choices=list(CODECS))
    parser.add_argument("--last", type=int, default=1, help="average over the last K steps")
    parser.add_argument("--group", default="mlp.w2.weight",
                        help="report separately the matrices whose name ends with this")
    parser.add_argument("--vocab_size", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None, help="use the file's first K workers")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        result = tables(args.path, args.codec, args.last, args.group, args.vocab_size,
                        args.workers)
    except (ValueError, FileNotFoundError, KeyError) as e:
        sys.exit(f"nanogeo.lab.tables: error: {e}")
    print_tables(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
