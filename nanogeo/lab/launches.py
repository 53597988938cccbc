"""
Kernel launches and host waits inside train.py's gradient reduction, per training step, counted
on the CPU: what a GPU would pay for the gradient communication (issue 50, items 2 and 3).

    python -m nanogeo.lab.launches [--nproc 2] [--steps 10-30] [--json OUT] \
        -- --preset=cpu-tiny --comm=subspace [more train.py flags]

A GPU pays a few microseconds per kernel launch and stops the host at every syncing op (an svd,
eigh or cholesky that checks its result on the host, a .item(), a tensor made from a Python
list); a CPU's wall time shows neither. This runs train.py under torchrun (--nproc ranks, gloo
on the CPU; as a user would: the package never imports train.py) and wraps every call of the
communicator's step - all that train.py's reduce_gradients does for a compressed --comm (its
other lines dispatch no aten op) - in nanogeo.lab.probes.OpCounter. Rank 0's counts of the steps
asked for are reported: ops that launch a kernel (`total`), every op dispatched (views included,
the measure issue 50 quoted), syncing ops by name; on average and on the steps that estimate new
geometry. train.py logs and evaluates only after those steps, so nothing else lands in them.
tests/test_launches.py runs the same counting around train.train on gloo ranks of its own.
"""
import argparse
import contextlib
import json
import os
import runpy
import subprocess
import sys
import tempfile

import torch.distributed as dist

import compress
from nanogeo.lab.probes import SYNCING, OpCounter
from nanogeo.parallel.communicator import ProductionCommunicator


def step_flags(first, last, out_dir):
    """train.py flags that keep steps first..last free of logging, evaluation and checkpoints."""
    return [f"--max_iters={last + 1}", "--log_interval=1000", "--eval_interval=1000",
            "--eval_iters=1", "--check_every=0", f"--out_dir={out_dir}", "--overwrite=true"]


@contextlib.contextmanager
def counting(out_path, first, last):
    """While active, every ProductionCommunicator.step (train.py's reduce_gradients calls it)
    is counted; rank 0 appends one JSON line per step first..last (1-based, as train.py numbers
    them) to `out_path`, at once (a finished distributed train.py leaves with os._exit): {"step",
    "total", "dispatched", "syncing", "refresh", "counts"}. refresh: a step whose geometry update
    estimates new geometry (its step % geo_refresh == 0)."""
    saved = vars(ProductionCommunicator)["step"]        # put back as it was, below
    step = ProductionCommunicator.step

    def counted(self, worker_grads, moments=None, *, across_ranks):
        with OpCounter() as ops:
            out = step(self, worker_grads, moments, across_ranks=across_ranks)
        first_rank = not dist.is_initialized() or dist.get_rank() == 0
        if first_rank and first <= self.steps_taken <= last:
            refresh = bool(self.layers) and self.steps_taken % self.opts.geo_refresh == 0
            with open(out_path, "a") as f:
                f.write(json.dumps({"step": self.steps_taken, "total": ops.total,
                                    "dispatched": ops.dispatched, "syncing": ops.syncing,
                                    "refresh": refresh, "counts": ops.counts}) + "\n")
        return out
    ProductionCommunicator.step = counted
    try:
        yield
    finally:
        ProductionCommunicator.step = saved


def read_records(out):
    """The records of `out` in step order (a step written twice, by a rank run again: the last)."""
    with open(out) as f:
        by_step = {r["step"]: r for r in map(json.loads, f)}
    return [by_step[step] for step in sorted(by_step)]


def summarize(records):
    """Averages over the steps, and over the refresh steps: ops, syncing ops (by name), and the
    most ops of any one step."""
    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows) if rows else float("nan")
    syncing = {}
    for r in records:
        for name, n in r["counts"].items():
            if name in SYNCING:
                syncing[name] = syncing.get(name, 0) + n / len(records)
    refresh = [r for r in records if r["refresh"]]
    return {"steps": [records[0]["step"], records[-1]["step"]],
            "ops_per_step": mean(records, "total"), "syncing_per_step": mean(records, "syncing"),
            "dispatched_per_step": mean(records, "dispatched"),
            "dispatched_refresh_step": mean(refresh, "dispatched"),
            "syncing_by_name": syncing, "ops_refresh_step": mean(refresh, "total"),
            "syncing_refresh_step": mean(refresh, "syncing"),
            "ops_most": max(r["total"] for r in records), "refresh_steps": len(refresh)}


def report(flags, summary):
    s = summary
    by_name = ", ".join(f"{k} {v:.2f}" for k, v in sorted(s["syncing_by_name"].items()))
    return (f"{' '.join(flags)}: steps {s['steps'][0]}-{s['steps'][1]}: "
            f"{s['ops_per_step']:.0f} ops/step, {s['ops_refresh_step']:.0f} on a refresh step "
            f"({s['refresh_steps']} of them), most {s['ops_most']} (every op dispatched, views "
            f"included: {s['dispatched_per_step']:.0f}, {s['dispatched_refresh_step']:.0f}); "
            f"syncing {s['syncing_per_step']:.2f}/step ({by_name or 'none'}), "
            f"{s['syncing_refresh_step']:.2f} on a refresh step")


def run_rank(train_flags, first, last, out):
    """One rank (under torchrun): train.py, run as its command line runs it, counted."""
    script = os.path.join(os.path.dirname(os.path.abspath(compress.__file__)), "train.py")
    sys.argv = [script, *train_flags]
    with counting(out, first, last):
        runpy.run_path(script, run_name="__main__")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (gloo on the CPU)")
    parser.add_argument("--steps", default="10-30", help="first-last step counted (1-based)")
    parser.add_argument("--json", default="", help="also keep rank 0's records (JSON lines)")
    parser.add_argument("--out_dir", default="out/launches", help="the run's out_dir (its "
                        "checkpoint is overwritten)")
    parser.add_argument("train_flags", nargs="*", help="train.py's flags (after --)")
    args = parser.parse_args(argv)
    first, last = (int(s) for s in args.steps.split("-"))
    flags = [*args.train_flags, *step_flags(first, last, args.out_dir)]
    if "RANK" in os.environ:            # a rank under torchrun
        if not args.json:
            parser.error("under torchrun each rank needs --json=FILE (rank 0 writes its counts "
                         "there); or run it with python, which starts torchrun itself")
        return run_rank(flags, first, last, args.json)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.json or os.path.join(tmp, "records.jsonl")
        if os.path.exists(out):
            os.remove(out)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.nproc}", "-m", "nanogeo.lab.launches",
                        f"--steps={args.steps}", f"--json={out}", f"--out_dir={args.out_dir}",
                        "--", *args.train_flags], check=True)
        summary = summarize(read_records(out))
    print(report(args.train_flags, summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
