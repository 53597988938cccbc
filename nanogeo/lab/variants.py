"""
Which rotation suits AdamW? Round-trip error of alternative encodings, as the optimizer sees it.

    python -m nanogeo.lab.variants grads.pt [--geo_rank 16]

For every step of a gradient file after the first, with the subspace rotation's bases estimated
from the earlier decoded means (as in training), each worker's gradient of each candidate matrix
goes once through the e4m3 block-128 codec in several encodings; the error that comes back is
weighed by what the file's optimizer does with it in its next update (update_error.UpdateError,
from the optimizer state replayed on the exact means) and summed. Printed: each encoding's
summed error relative to Euclidean's (as a ratio of root-sum-squares):

    both     H = P^T G Q, the two-sided rotation (compress.py section 4)
    right    H = G Q, the column side only: every row keeps its own scale
    core     only the r x r core rotated: C = U^T G V sent alongside R = G - U C V^T, which
             goes in original coordinates (r^2 extra numbers per matrix)

This is the experiment behind BENCHMARKS.md section 12's "which transform helps AdamW"; the
encodings that lost there are kept here, not in compress.py.
"""

import argparse
import math
import sys

from nanogeo.lab import fidelity
from nanogeo.geometry import update_error
from nanogeo.parallel.communicator import Options, ProductionCommunicator


def encodings(layer, round_trip):
    """{name: G -> G sent through the codec in that encoding and back}."""
    both = (layer.left_basis, layer.right_basis)
    right = (None, layer.right_basis)
    U, V = layer.left_basis.columns(), layer.right_basis.columns()

    def core(G):
        C = U.T @ G @ V                                     # (r, r)
        return U @ round_trip(C) @ V.T + round_trip(G - U @ C @ V.T)

    return {"both": lambda G: layer.decode(round_trip(layer.encode(G, both)), both),
            "right": lambda G: layer.decode(round_trip(layer.encode(G, right)), right),
            "core": core}


def compare(path, geo_rank=16):
    data = fidelity.load_gradient_file(path)
    steps, record = data["steps"], data.get("optimizer")
    if record is None:
        raise ValueError(f"{path} records no optimizer; capture it with nanogeo.lab.capture --keep=all")
    if len(steps) < 2:
        raise ValueError(f"{path} holds {len(steps)} step; the bases come from earlier steps, so "
                         "capture at least 2 (--capture_steps=2 or more)")
    names = list(steps[0][0])
    exact = [{n: sum(w[n].float() for w in ws) / len(ws) for n in names} for ws in steps]
    states, _ = fidelity.exact_updates(record, exact, data.get("grad_clip", 0.0))
    views = fidelity.optimizer_views(record, states)
    vocabulary, vocab_size = fidelity.file_vocabulary(data)
    opts = Options(geometry="subspace", select="all", geo_rank=geo_rank, vocab_size=vocab_size,
                   vocabulary=vocabulary)
    comm = ProductionCommunicator([(n, steps[0][0][n].shape) for n in names], opts,
                                  linear=set(data["linear"]) if "linear" in data else None)
    round_trip = comm.round_trip
    totals = {"euclidean": 0.0, "both": 0.0, "right": 0.0, "core": 0.0}
    for s, workers in enumerate(steps):
        if s > 0:                     # bases exist from the earlier steps' decoded means
            for n, layer in comm.layers.items():
                seen = update_error.UpdateError(views[s].get(n), exact[s][n])
                coders = encodings(layer, round_trip)
                for w in workers:
                    G = w[n].float()
                    totals["euclidean"] += seen(round_trip(G) - G).item()
                    for name, coder in coders.items():
                        totals[name] += seen(coder(G) - G).item()
        comm.reduce_workers([[w[n] for n in names] for w in workers])
    return {k: math.sqrt(v / totals["euclidean"]) for k, v in totals.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("path")
    parser.add_argument("--geo_rank", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        ratios = compare(args.path, args.geo_rank)
    except (ValueError, FileNotFoundError, KeyError) as e:
        sys.exit(f"nanogeo.lab.variants: error: {e}")
    print("optimizer-visible round-trip error vs Euclidean FP8: "
          + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items()))
    return ratios


if __name__ == "__main__":
    main()
