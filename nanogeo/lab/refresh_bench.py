"""
The cost of the whitening's refresh at a real model's shapes, against one forward + backward of
that model, as ratios within one run (this machine is shared and noisy; a ratio is not).

    OMP_NUM_THREADS=1 python -m nanogeo.lab.refresh_bench [--preset llama-300m --batch_size 1 --block_size 256]

Every geo_refresh steps (50) the published GeoFP8 rebuilds the factor of every candidate layer
(geo_layers=gain: every nn.Linear weight but the vocabulary head, 126 of them at llama-300m):
the K-FAC input moments are averaged over the ranks (nanogeo.parallel.hooks.average_moments: one
flat all-reduce of all d x d sums, the counts read on the host), then each layer's factor is
computed from the EMA of its moment (compress.whitening_factor). Timed here per layer, on one
layer of each input width d, times the number of candidate layers of that width:

  moments     average_moments of that layer's statistic (the concatenation, the division and the
              host read of the counts; the all-reduce itself is the identity in one process, so
              the network is not in the figure)
  eigh        compress.py's factor: a full float64 eigendecomposition, then a thin SVD
  cold, warm  compress.subspace_eigenpairs: the top-r eigenpairs by subspace iteration (fp32)
              from a random start (the first refresh), or from the directions of the factor in
              use (every later one; here the factor of the same layer one batch earlier, under
              the EMA of 0.95 the moments follow)

  stacked     the same three with the layers of one width built together in one mapped call
              (nanogeo.geometry.batched.factors_stack, what training runs): timed on two layers
              (per layer here, as the others), its ops counted once for the group (they do not
              depend on how many layers it stacks)

Each is also counted (nanogeo.lab.probes.OpCounter, issue 50): the ops that launch a kernel on a
GPU, and the syncing calls (eigh, svd: each makes a CUDA host wait), for the refresh of all
layers, against the kernels of one forward + backward.

The moments are the real statistics of the model (random weights) on random tokens, collected
by the K-FAC hooks during a forward pass. The forward + backward is the model's, eager, fp32, on
--batch_size x --block_size tokens; every time is the fastest of --repeats.
"""
import argparse
import contextlib
import time

import torch

import model as model_lib
from nanogeo.lab.probes import OpCounter
from nanogeo.parallel import hooks
from nanogeo.geometry import batched, layers
from nanogeo.parallel.communicator import Options, ProductionCommunicator


def fastest(fn, repeats):
    """The shortest wall time of `repeats` calls of fn (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def counted(fn):
    """(kernel launches, syncing calls) of one call of fn."""
    with OpCounter() as ops:
        fn()
    return ops.total, ops.syncing


def representatives(communicator, linear):
    """{d_in: (the first candidate layer's name with that input width, how many have it)}."""
    by_width = {}
    for name in communicator.moment_layers():
        d = linear[name].in_features
        first, count = by_width.get(d, (name, 0))
        by_width[d] = (first, count + 1)
    return by_width


def run(preset, batch_size, block_size, repeats, rank, seed=0):
    torch.manual_seed(seed)
    cfg = model_lib.model_config(preset)
    model = model_lib.Llama(cfg)
    linear = hooks.linear_layers(model)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    comm = ProductionCommunicator(named, Options(geometry="geofp8", whiten_rank=rank,
                                                 vocab_size=cfg.vocab_size), linear=linear)
    widths = representatives(comm, linear)
    picked = {name: linear[name] for name, _ in widths.values()}
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(cfg.vocab_size, (batch_size, block_size + 1), generator=g)
              for _ in range(2)]

    def forward_backward(batch, collect=None):
        model.zero_grad(set_to_none=True)
        with collect.attached() if collect else contextlib.nullcontext():
            _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()

    stats = []
    for batch in tokens:                        # two batches' moments: a refresh, and the next
        moments = hooks.KroneckerMoments(picked)
        forward_backward(batch, moments)
        stats.append(moments.take())
    step = fastest(lambda: forward_backward(tokens[0]), repeats)
    step_ops = counted(lambda: forward_backward(tokens[0]))[0]

    kinds = ("eigh", "cold", "warm")
    rows, totals = [], {k: 0.0 for k in ("moments", *kinds, *(f"stacked {k}" for k in kinds))}
    ops = {k: [0, 0] for k in totals}       # {variant: [launches, syncing calls]}, all layers
    opts = comm.opts
    for d, (name, count) in sorted(widths.items()):
        shapes = {name: comm.shapes[name]}
        one = {"input": {name: stats[0]["input"][name]},
               "tokens": {"input": {name: stats[0]["tokens"]["input"][name]}}}
        avg = fastest(lambda: hooks.average_moments(one, shapes, ("input",), lambda t: t,
                                                    torch.device("cpu")), repeats)
        A = stats[0]["input"][name]
        A_next = opts.moment_decay * A + (1 - opts.moment_decay) * stats[1]["input"][name]
        factor = lambda solver, M, old=None: layers.factor_of_kind(
            M, "lowrank", opts.whiten_rank, damping=opts.damping, solver=solver, old=old)
        old = factor("subspace", A)
        calls = {"eigh": lambda: factor("eigh", A_next),
                 "cold": lambda: factor("subspace", A_next),
                 "warm": lambda: factor("subspace", A_next, old)}
        pair = torch.stack([A_next, A_next])            # two layers of this width, stacked

        def stacked(solver, olds):
            return lambda: batched.factors_stack(
                pair, olds, Options(geometry="geofp8", whiten_rank=opts.whiten_rank,
                                    damping=opts.damping, whiten_solver=solver))
        calls.update({"stacked eigh": stacked("eigh", [None, None]),
                      "stacked cold": stacked("subspace", [None, None]),
                      "stacked warm": stacked("subspace", [old, old])})
        times = {"moments": avg, **{k: fastest(fn, repeats) for k, fn in calls.items()}}
        for k, fn in calls.items():
            launches, syncing = counted(fn)
            times[k] /= 2 if k.startswith("stacked") else 1         # per layer
            per = 1 if k.startswith("stacked") else count           # calls for these layers
            ops[k][0] += per * launches
            ops[k][1] += per * syncing
        moments_ops = counted(lambda: hooks.average_moments(
            {"input": {f"{name}.{i}": stats[0]["input"][name] for i in range(count)},
             "tokens": {"input": {f"{name}.{i}": 1 for i in range(count)}}},
            {f"{name}.{i}": comm.shapes[name] for i in range(count)}, ("input",),
            lambda t: t, torch.device("cpu")))
        ops["moments"] = [a + b for a, b in zip(ops["moments"], moments_ops)]
        for k, v in times.items():
            totals[k] += count * v
        rows.append((d, count, times))
    return {"preset": preset, "tokens": batch_size * block_size, "step": step, "rows": rows,
            "totals": totals, "layers": sum(c for _, c, _ in rows), "ops": ops,
            "step_ops": step_ops}


COLUMNS = ("moments", "eigh", "cold", "warm", "stacked eigh", "stacked cold", "stacked warm")


def report(result):
    step = result["step"]
    lines = [f"{result['preset']}: {result['layers']} candidate layers; forward + backward on "
             f"{result['tokens']} tokens: {step:.2f} s",
             f"{'d_in':>6s} {'layers':>6s} " + " ".join(f"{k.replace('stacked ', '+'):>9s}"
                                                        for k in COLUMNS)
             + "   (seconds per layer; +: stacked)"]
    for d, count, t in result["rows"]:
        lines.append(f"{d:6d} {count:6d} " + " ".join(f"{t[k]:9.4f}" for k in COLUMNS))
    tot, ops, step_ops = result["totals"], result["ops"], result["step_ops"]
    for label, key in (("compress.py (eigh)", "eigh"), ("subspace, cold", "cold"),
                       ("subspace, warm", "warm")):
        refresh = tot["moments"] + tot[key]
        lines.append(f"refresh of all layers, {label:18s}: {refresh:8.2f} s = "
                     f"{refresh / step:7.2f} x forward+backward"
                     + ("" if key == "eigh" else
                        f"; {(tot['moments'] + tot['eigh']) / refresh:5.1f}x cheaper than eigh"))
    lines.append(f"kernel launches (syncing calls) of the refresh of all layers, against "
                 f"{step_ops} of one forward+backward; per layer / each width's layers stacked:")
    for label, key in (("compress.py (eigh)", "eigh"), ("subspace, cold", "cold"),
                       ("subspace, warm", "warm")):
        one, stacked = ([ops["moments"][i] + ops[k][i] for i in (0, 1)]
                        for k in (key, f"stacked {key}"))
        lines.append(f"  {label:18s}: {one[0]:7d} ({one[1]:3d}) = {one[0] / step_ops:5.2f} x "
                     f"forward+backward / stacked {stacked[0]:6d} ({stacked[1]:2d}) = "
                     f"{stacked[0] / step_ops:5.2f} x, {tot['moments'] + tot['stacked ' + key]:7.2f} s")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", default="llama-300m")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--whiten_rank", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)        # one thread: the ratio does not depend on the core count
    result = run(args.preset, args.batch_size, args.block_size, args.repeats, args.whiten_rank)
    print(report(result))
    return result


if __name__ == "__main__":
    main()
