"""
Convergence studies: the same training run with each gradient communication method, over a grid
of methods x optimizers x seeds x data-parallel ranks, with confidence intervals.

    python -m nanogeo.ablate --comms fp32,bf16,fp8,geofp8 --nproc 2 --out_dir out/ablate [-- TRAIN FLAGS]
    python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper --workers 32 --seeds 0,1,2 \\
        --optimizers adamw,muon --out_dir out/study -- --preset=char-study --max_iters=300

One process per run: `torchrun --nproc_per_node=N train.py` for real ranks (--nproc), or
`python train.py --simulate_workers=W` for W ranks simulated in one process (--workers; the
same numerics, see train.py). Runs live in out_dir/COMM/OPTIMIZER/simW (or ranksN)/seedS; a run
whose log ends with its summary and whose command (command.json) was this one is skipped, so an
interrupted study resumes where it stopped; an unfinished run starts again from step 0. Extra
flags after `--` go to every run.

Writes, after every run: out_dir/results.json (one record per run: its final losses, bytes,
time and loss curve; earlier calls' records on the same out_dir are kept) and out_dir/study.md: per optimizer and W, for each method the final
validation loss as mean +- 95 % confidence interval over seeds (Student t), its gap to fp32
(paired by seed: same initialisation and data), and the fraction of the reference method's
gap that it recovers, 1 - gap / reference gap, with a 95 % bootstrap interval over seeds
(--reference, default the first compressed Euclidean method in --comms); and, with
matplotlib installed, out_dir/loss_OPTIMIZER_simW.png (or _ranksN): train-loss curves, mean
over seeds with a min-max band.
"""

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_SUM = ["--fmt=e5m2", "--block=tensor", "--collective=fp8-sum"]   # the paper's collective
COMMS = {"fp32": ["--comm=fp32"], "bf16": ["--comm=bf16"], "fp8": ["--comm=fp8"],
         "fp8-ef": ["--comm=fp8", "--error_feedback"],
         "e5m2-tensor": ["--comm=fp8", "--fmt=e5m2", "--block=tensor"],
         # the published Euclidean baseline: per-tensor e5m2, one FP8 all_reduce SUM
         "fp8-paper": ["--comm=fp8", *PAPER_SUM],
         "fp8-paper-ef": ["--comm=fp8", *PAPER_SUM, "--error_feedback"],
         # the published GeoFP8 on its collective: layers chosen by the saturation profiler
         # during the warm-up, kept fixed; error feedback on those layers; EMA factors
         "geofp8-paper": ["--comm=geofp8", *PAPER_SUM, "--geo_layers=fragile:4",
                          "--error_feedback", "--feedback_geo_only",
                          "--whiten_factor=lowrank-dense", "--factor_decay=0.95",
                          "--geo_enter_gain=0", "--geo_exit_gain=0"],
         "subspace-paper": ["--comm=subspace", *PAPER_SUM],
         # ... with every candidate rotated, no gain check (to see what the check prevents)
         "subspace-paper-all": ["--comm=subspace", *PAPER_SUM, "--geo_layers=all"],
         "geofp8": ["--comm=geofp8"], "subspace": ["--comm=subspace"],
         "nvfp4": ["--comm=fp8", "--fmt=nvfp4"], "geo-nvfp4": ["--comm=geofp8", "--fmt=nvfp4"],
         "subspace-nvfp4": ["--comm=subspace", "--fmt=nvfp4"]}
EUCLIDEAN = ("fp8", "fp8-paper", "e5m2-tensor", "nvfp4")      # candidates for --reference
# Student t, two-sided 95 %, by degrees of freedom (1.96 beyond 30)
T95 = dict(enumerate((12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                      2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
                      2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042), 1))


def run_dir(out_dir, comm, optimizer, workers, nproc, seed):
    """out_dir/COMM/OPTIMIZER/simW (simulated ranks) or rankN (real ones)/seedS."""
    ranks = f"sim{workers}" if workers else f"ranks{nproc}"
    return os.path.join(out_dir, comm, optimizer, ranks, f"seed{seed}")


def finished(path, cmd):
    """The run's summary and loss records, if it ran with this command and its log ends with
    a summary; else None (a run with other flags is run again)."""
    log, ran = os.path.join(path, "log.jsonl"), os.path.join(path, "command.json")
    if not os.path.exists(log) or (os.path.exists(ran) and json.load(open(ran)) != cmd[1:]):
        return None
    records = [json.loads(line) for line in open(log) if line.strip()]
    if not records or "summary" not in records[-1]:
        return None
    return records[-1]["summary"], [r for r in records if "loss" in r]


def command(run, nproc, extra):
    comm, optimizer, workers, seed, path = run
    flags = [f"--out_dir={path}", "--overwrite=true", f"--optimizer={optimizer}",
             f"--seed={seed}", *COMMS[comm], *extra]
    if workers:
        return [sys.executable, "train.py", f"--simulate_workers={workers}", *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "train.py", *flags]


def record(run, summary, steps, nproc):
    comm, optimizer, workers, seed, _ = run
    return {"comm": comm, "optimizer": optimizer, "workers": workers or nproc,
            "simulated": bool(workers), "seed": seed,
            "final_val_loss": summary["final_val_loss"],
            "final_train_loss": summary["final_train_loss"],
            "ms_per_step": summary["ms_per_step"],
            "wire_bytes": steps[-1]["wire_bytes"] if steps else None,
            "wire_vs_bf16": steps[-1]["wire_vs_bf16"] if steps else None,
            "curve": [(s["step"], s["loss"]) for s in steps]}


def mean_ci(values):
    """(mean, half-width of the 95 % t interval); nan half-width for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, T95.get(n - 1, 1.96) * sd / math.sqrt(n)


def recovered(gaps, reference_gaps, draws=2000):
    """1 - mean gap / mean reference gap, and a 95 % bootstrap interval over the paired seeds.
    The interval is (nan, nan) when some resample has no reference gap (mean <= 0): then the
    fraction is unbounded and the reference's gap itself is not established."""
    def fraction(idx):
        ref = sum(reference_gaps[i] for i in idx)
        return 1 - sum(gaps[i] for i in idx) / ref if ref > 0 else float("nan")
    n = len(gaps)
    point = fraction(range(n))
    rng = random.Random(0)
    boot = [fraction([rng.randrange(n) for _ in range(n)]) for _ in range(draws)]
    if n < 2 or any(math.isnan(b) for b in boot):
        return point, float("nan"), float("nan")
    boot.sort()
    return point, boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1]


def group(r):
    return r["optimizer"], r["workers"], r.get("simulated", False)


def table(results, reference):
    """The markdown table: per optimizer and W, one row per method."""
    lines = []
    groups = sorted({group(r) for r in results})
    for optimizer, workers, simulated in groups:
        rows = [r for r in results if group(r) == (optimizer, workers, simulated)]
        by = {}
        for r in rows:
            by.setdefault(r["comm"], {})[r["seed"]] = r
        fp32 = by.get("fp32", {})
        ref = by.get(reference, {})
        ranks = "simulated" if simulated else "real"
        lines += [f"\n### {optimizer}, W = {workers} ({ranks} ranks)\n",
                  f"| method | seeds | final val loss (95 % CI) | gap to fp32 (95 % CI) | "
                  f"recovers of {reference}'s gap (95 % bootstrap) | wire vs bf16 | ms/step |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for comm, runs in by.items():
            seeds = sorted(runs)
            val, val_ci = mean_ci([runs[s]["final_val_loss"] for s in seeds])
            paired = [s for s in seeds if s in fp32]
            gaps = [runs[s]["final_val_loss"] - fp32[s]["final_val_loss"] for s in paired]
            gap, gap_ci = mean_ci(gaps) if gaps else (float("nan"), float("nan"))
            with_ref = [s for s in paired if s in ref]
            rec = "—"
            if comm not in ("fp32", reference) and with_ref:
                point, lo, hi = recovered(
                    [runs[s]["final_val_loss"] - fp32[s]["final_val_loss"] for s in with_ref],
                    [ref[s]["final_val_loss"] - fp32[s]["final_val_loss"] for s in with_ref])
                rec = f"{100 * point:.0f} % " + (
                    "(unbounded: no reference gap in some resample)" if math.isnan(lo)
                    else f"({100 * lo:.0f} to {100 * hi:.0f} %)")
            wire = runs[seeds[0]]["wire_vs_bf16"]
            ms = sum(runs[s]["ms_per_step"] for s in seeds) / len(seeds)
            lines.append(f"| {comm} | {len(seeds)} | {val:.4f} ± {val_ci:.4f} | "
                         f"{gap:+.4f} ± {gap_ci:.4f} | {rec} | "
                         f"{'-' if wire is None else f'{wire:.3f}'} | {ms:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results, out_dir):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no loss plots")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for key in sorted({group(r) for r in results}):
        optimizer, workers, simulated = key
        fig, ax = plt.subplots(figsize=(7, 4))
        for comm in dict.fromkeys(r["comm"] for r in results):
            curves = [r["curve"] for r in results if r["comm"] == comm and group(r) == key]
            if not curves:
                continue
            steps = [s for s, _ in curves[0]]
            values = [[c[i][1] for c in curves if len(c) > i] for i in range(len(steps))]
            mean = [sum(v) / len(v) for v in values]
            line, = ax.plot(steps, mean, label=f"{comm} ({len(curves)} seeds)", lw=1)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values],
                            color=line.get_color(), alpha=0.2)
        ax.set(xlabel="step", ylabel="train loss (rank 0)", title=f"{optimizer}, W = {workers}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        ranks = "sim" if simulated else "ranks"
        fig.savefig(os.path.join(out_dir, f"loss_{optimizer}_{ranks}{workers}.png"), dpi=120)
        plt.close(fig)


def write(results, out_dir, reference):
    """results.json keeps the records of earlier invocations on the same out_dir (another
    grid) too: a study can grow one call at a time. Returns all records."""
    path = os.path.join(out_dir, "results.json")
    key = lambda r: (r["comm"], *group(r), r["seed"])   # noqa: E731
    new = {key(r) for r in results}
    earlier = json.load(open(path)) if os.path.exists(path) else []
    results = [r for r in earlier if key(r) not in new] + results
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)
    with open(os.path.join(out_dir, "study.md"), "w") as f:
        f.write(table(results, reference))
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--comms", default="fp32,bf16,fp8,geofp8",
                        help=f"methods, from: {', '.join(COMMS)}")
    parser.add_argument("--optimizers", default="adamw", help="adamw, muon or both")
    parser.add_argument("--seeds", default="1337", help="comma-separated seeds")
    parser.add_argument("--workers", default="0", help="simulated ranks per run, comma-separated "
                        "(0: real ranks, --nproc of them, through torchrun)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reference", default=None, help="the Euclidean method whose gap the "
                        "others recover (default: the first of fp8, fp8-paper, e5m2-tensor, "
                        "nvfp4 in --comms)")
    parser.add_argument("--out_dir", default="out/ablate")
    args = parser.parse_args(argv)
    comms, optimizers = args.comms.split(","), args.optimizers.split(",")
    unknown = [c for c in comms if c not in COMMS] + [o for o in optimizers
                                                      if o not in ("adamw", "muon")]
    if unknown:
        parser.error(f"unknown method or optimizer {unknown[0]!r}; methods: {', '.join(COMMS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error("--seeds and --workers take comma-separated integers, e.g. --seeds 0,1,2")
    reference = args.reference or next((c for c in comms if c in EUCLIDEAN), "fp8")
    os.makedirs(args.out_dir, exist_ok=True)
    runs = [(c, o, w, s, run_dir(args.out_dir, c, o, w, args.nproc, s))
            for o in optimizers for w in workers for s in seeds for c in comms]
    results = []
    for k, run in enumerate(runs, 1):
        label = f"[{k}/{len(runs)}] {run[0]} {run[1]} W={run[2] or args.nproc} seed={run[3]}"
        cmd = command(run, args.nproc, extra)
        done = finished(run[4], cmd)
        if done is None:
            t0 = time.time()
            print(f"{label}: running", flush=True)
            log_path = os.path.join(args.out_dir, "runs.log")
            os.makedirs(run[4], exist_ok=True)
            with open(os.path.join(run[4], "command.json"), "w") as f:
                json.dump(cmd[1:], f)
            with open(log_path, "a") as log:
                code = subprocess.run(cmd, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT).returncode
            done = finished(run[4], cmd)
            if code or done is None:
                raise SystemExit(f"nanogeo.ablate: {label} failed (exit code {code}); its output "
                                 f"is at the end of {log_path}")
            state = f"{time.time() - t0:.0f}s"
        else:
            state = "done before, skipped"
        results.append(record(run, *done, args.nproc))
        print(f"{label}: val {done[0]['final_val_loss']:.4f} ({state})", flush=True)
        everything = write(results, args.out_dir, reference)
    plot(everything, args.out_dir)
    print(table(everything, reference))


if __name__ == "__main__":
    main()
