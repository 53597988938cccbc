"""
Convergence studies: the same training run with each gradient communication method, over a grid
of methods x optimizers x seeds x data-parallel ranks, compared seed by seed with Student t
intervals; and the short fp32 learning-rate sweep that tunes each optimizer before a study.

    python -m nanogeo.tools.study --comms fp32,bf16,fp8,geofp8 --nproc 2 --out_dir out/ablate [-- TRAIN FLAGS]
    python -m nanogeo.tools.study --sweep muon_lr=1e-3,3e-3,1e-2 --optimizers muon --workers 32 \\
        --seeds 0,1 --out_dir out/sweep -- --preset=char-study --max_iters=300
    python -m nanogeo.tools.study --comms fp32,fp8-paper,subspace-paper --workers 32 --seeds 0,1,2 \\
        --optimizers muon --lr_from out/sweep/sweep.json --out_dir out/study -- --preset=char-study

Runs. One process per run: `torchrun --nproc_per_node=N train.py` for real ranks (--nproc), or
`python train.py --simulate_workers=W` for W ranks simulated in one process (--workers; the
same numerics, see train.py). Runs live in out_dir/COMM/OPTIMIZER/simW (or ranksN)/seedS (a
sweep's in out_dir/FLAG=VALUE/fp32/...); a run whose log ends with its summary and whose command
(command.json) was this one is skipped, so an interrupted study resumes where it stopped; an
unfinished run starts again from step 0. Extra flags after `--` go to every run.

What a run's record holds (out_dir/results.json, rewritten after every run): the whole command
(train.py and every flag), the train flags its group shares (learning rates and the flags after
`--`), the commit it ran at (git rev-parse HEAD, and whether tracked files had changes) and the
machine (CPU, torch version, OMP_NUM_THREADS: another CPU rounds differently, machine()), its
preset, steps and the learning rates train.py resolved; its final val loss (train.py's summary:
the mean of the last --final_evals evaluations, 3 with --preset=char-study), the bytes each rank
sent per step averaged over all steps (every collective of the gradient communication: the
two-stage collective's all_to_all and all_gather, or the paper's FP8 all-reduce and the MAX
all-reduce of its scales, and the K-FAC statistics' all-reduce of the published GeoFP8; not
the few-number all-reduces of the gain check, the finiteness flag and the geometry checksum,
nor those every method shares), ms per step and the train-loss curve. Records are merged by
their whole command: a call with other flags adds records beside the earlier ones, never
mixes with them; records from before the command was stored are kept, on their own. (A run
is not repeated for a new commit or machine; each table's heading lists both.)

Statistics (out_dir/study.md): per optimizer, W and set of train flags, every method's runs are
compared with fp32's and the reference's runs of the same seeds (same initialisation, same
data), so what a seed does to every method alike cancels:
  * final val loss: mean over seeds +- the half-width of the 95 % Student t interval;
  * gap to fp32 and gap to the reference (--reference, default the first compressed Euclidean
    method in --comms): the per-seed differences, their mean +- 95 % t half-width (a paired
    t interval);
  * recovered fraction of the reference's gap: per seed f = 1 - gap / reference gap, then the
    mean of f with a 95 % t interval over seeds; with >= 8 seeds a 95 % percentile bootstrap
    of that mean instead, labelled "bootstrap" (with 3 seeds a bootstrap has 27 resamples and
    its cut-offs are just the lowest and highest seed). No fraction is printed when the
    reference's own gap is not established: its paired t interval includes 0 ("reference gap
    not significant"), or some seed's reference gap is <= 0.
A row with one seed says "one seed" where an interval would be. t intervals assume per-seed
values spread roughly normally; with 2 or 3 seeds they are wide (t = 12.7 and 4.30), honestly.

The sweep (--sweep FLAG=V1,V2,...; FLAG: learning_rate or muon_lr) runs fp32 at every value
and writes out_dir/sweep.json and sweep.md: per optimizer and W the mean final val loss of each
value over the seeds all values share, its paired gap to the best value, and the best (lowest
mean; flagged when it lies at an end of the grid). --lr_from sweep.json then passes the best
value of every flag swept for an optimizer to every method of that optimizer at that W (one
flag at a time: each flag's best is the one its own sweep found). The schedule's floor
--min_lr stays as set, so a learning_rate sweep moves the peak only; Muon's lr follows
learning_rate's warm-up and cosine scaled to its own peak, so a muon_lr sweep keeps the shape.

With matplotlib installed, out_dir/loss_OPTIMIZER_simW.png (or _ranksN): the study's train-loss
curves, mean over seeds with a min-max band.
"""

import argparse
import fcntl
import importlib.metadata
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from nanogeo.run import config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
         "nvfp4": ["--comm=fp8", "--fmt=nvfp4"],
         "nvfp4-ef": ["--comm=fp8", "--fmt=nvfp4", "--error_feedback"], "geo-nvfp4": ["--comm=geofp8", "--fmt=nvfp4"],
         "subspace-nvfp4": ["--comm=subspace", "--fmt=nvfp4"],
         # the geometry-agnostic control: a randomized Hadamard rotation (train.py --comm=hadamard)
         "hadamard": ["--comm=hadamard"], "hadamard-paper": ["--comm=hadamard", *PAPER_SUM],
         "hadamard-nvfp4": ["--comm=hadamard", "--fmt=nvfp4"],
         # 4 bits: the controls forced on every candidate matrix (no gain check), so that they
         # act; 16-entry Walsh-Hadamard blocks, one per NVFP4 scaling block, as NVIDIA's NVFP4
         # recipe applies them
         "hadamard-nvfp4-all": ["--comm=hadamard", "--fmt=nvfp4", "--geo_layers=all"],
         "hadamard16-nvfp4-all": ["--comm=hadamard", "--fmt=nvfp4", "--geo_layers=all",
                                  "--hadamard_block=16"],
         "subspace-nvfp4-all": ["--comm=subspace", "--fmt=nvfp4", "--geo_layers=all"],
         # 4 bits: the 4-bit training recipes' levers, alone and with the rotation: unbiased
         # stochastic rounding in both stages or one (1: each rank's send, whose errors average
         # over W; 2: the re-quantized mean), error feedback, the rotation's rank and refresh
         "nvfp4-sr": ["--comm=fp8", "--fmt=nvfp4", "--stochastic_round"],
         "nvfp4-sr1": ["--comm=fp8", "--fmt=nvfp4", "--stochastic_round",
                       "--stochastic_stages=1"],
         "nvfp4-sr2": ["--comm=fp8", "--fmt=nvfp4", "--stochastic_round",
                       "--stochastic_stages=2"],
         "subspace-nvfp4-sr": ["--comm=subspace", "--fmt=nvfp4", "--stochastic_round"],
         "subspace-nvfp4-ef": ["--comm=subspace", "--fmt=nvfp4", "--error_feedback"],
         "subspace-nvfp4-r8": ["--comm=subspace", "--fmt=nvfp4", "--geo_rank=8"],
         "subspace-nvfp4-r32": ["--comm=subspace", "--fmt=nvfp4", "--geo_rank=32"],
         "subspace-nvfp4-refresh1": ["--comm=subspace", "--fmt=nvfp4", "--geo_refresh=1"],
         "hadamard16-nvfp4-all-sr": ["--comm=hadamard", "--fmt=nvfp4", "--geo_layers=all",
                                     "--hadamard_block=16", "--stochastic_round"],
         # error feedback on stage 2 (each averaged shard's re-quantization, kept by its owner),
         # the stage --log_stages finds largest at 4 bits; and on both stages
         "nvfp4-ef2": ["--comm=fp8", "--fmt=nvfp4", "--error_feedback", "--feedback_stages=2"],
         "nvfp4-ef12": ["--comm=fp8", "--fmt=nvfp4", "--error_feedback",
                        "--feedback_stages=both"],
         "subspace-nvfp4-ef2": ["--comm=subspace", "--fmt=nvfp4", "--error_feedback",
                                "--feedback_stages=2"],
         "hadamard16-nvfp4-all-ef2": ["--comm=hadamard", "--fmt=nvfp4", "--geo_layers=all",
                                      "--hadamard_block=16", "--error_feedback",
                                      "--feedback_stages=2"]}
EUCLIDEAN = ("fp8", "fp8-paper", "e5m2-tensor", "nvfp4")      # candidates for --reference
SWEEPABLE = {"learning_rate": ("adamw", "muon"), "muon_lr": ("muon",)}  # flag: its optimizers
LR_FIELDS = ("learning_rate", "min_lr", "muon_lr", "muon_adjust_lr")    # recorded from the config
MIN_BOOTSTRAP_SEEDS = 8
# Student t, two-sided 95 %, by degrees of freedom (1.96 beyond 30)
T95 = dict(enumerate((12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                      2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
                      2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042), 1))


# -----------------------------------------------------------------------------
# runs

@dataclass(frozen=True)
class Run:
    comm: str
    optimizer: str
    workers: int            # simulated ranks; 0: real ranks (--nproc of them, through torchrun)
    seed: int
    path: str
    flags: tuple            # the train flags its group shares: learning rates, then extra flags
    sweep: tuple = ()       # (flag, value) of a sweep run


def run_dir(out_dir, comm, optimizer, workers, nproc, seed):
    """out_dir/COMM/OPTIMIZER/simW (simulated ranks) or rankN (real ones)/seedS."""
    ranks = f"sim{workers}" if workers else f"ranks{nproc}"
    return os.path.join(out_dir, comm, optimizer, ranks, f"seed{seed}")


def command(run, nproc):
    flags = [f"--out_dir={run.path}", "--overwrite=true", f"--optimizer={run.optimizer}",
             f"--seed={run.seed}", *COMMS[run.comm], *run.flags]
    if run.workers:
        return [sys.executable, "train.py", f"--simulate_workers={run.workers}", *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "train.py", *flags]


def finished(path, cmd):
    """The run's summary, loss records and geometry records, if it ran with this command and
    its log ends with a summary that records the resolved config; else None: a run with other
    flags is run again, and so is one of a train.py from before the summary held its config and
    the mean of the final evaluations (the same command may have meant other presets then)."""
    log, ran = os.path.join(path, "log.jsonl"), os.path.join(path, "command.json")
    if not os.path.exists(log) or (os.path.exists(ran) and json.load(open(ran)) != cmd[1:]):
        return None
    records = [json.loads(line) for line in open(log) if line.strip()]
    if not records or "config" not in records[-1].get("summary", {}):
        return None
    return (records[-1]["summary"], [r for r in records if "loss" in r],
            [r for r in records if "geometry_at" in r], [r for r in records if "stages" in r])


def git_commit():
    """{"commit": HEAD, "dirty": whether tracked files differ from it}, or Nones outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


CPU_FIELDS = ("model name", "cpu family", "model", "CPU implementer", "CPU part")  # x86, ARM


def machine(cpuinfo="/proc/cpuinfo"):
    """The machine runs ran on: its CPU (name, family and model, or ARM's implementer and part),
    the torch version and OMP_NUM_THREADS. Another CPU rounds differently: the same 300-step run
    ended up to 0.006 apart on two machines at the same commit (BENCHMARKS.md section 14), as
    much as a gap the study measures, so paired arms belong on one machine."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in CPU_FIELDS and value.strip():
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = " ".join(fields[k] if k == "model name" else f"{k} {fields[k]}"
                   for k in CPU_FIELDS if k in fields)
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (f"{cpu or platform.processor() or platform.machine() or 'unknown CPU'}, "
            f"torch {version}, OMP_NUM_THREADS {threads}")


def provenance(path):
    """The commit and machine a finished run ran at (provenance.json; None where runs of older
    drivers did not record them)."""
    file = os.path.join(path, "provenance.json")
    found = json.load(open(file)) if os.path.exists(file) else {}
    return {"commit": None, "dirty": None, "machine": None, **found}


def record(run, summary, steps, geometry, stages, nproc, cmd):
    config = summary["config"]              # as train.py resolved it: preset, flags, defaults
    return {"comm": run.comm, "optimizer": run.optimizer, "workers": run.workers or nproc,
            "simulated": bool(run.workers), "seed": run.seed,
            "command": cmd[1:], "flags": list(run.flags), "sweep": list(run.sweep) or None,
            **provenance(run.path), "preset": config["preset"], "steps": config["max_iters"],
            "learning_rates": {k: config[k] for k in LR_FIELDS if k in config
                               and (run.optimizer == "muon" or not k.startswith("muon"))},
            "final_val_loss": summary["final_val_loss"],
            "final_val_losses": summary.get("final_val_losses"),
            # the second end point (train.py --tail_evals), where the run measured it
            "tail_val_loss": summary.get("tail_val_loss"),
            "final_train_loss": summary["final_train_loss"],
            "ms_per_step": summary["ms_per_step"],
            "mean_wire_bytes": summary.get("mean_wire_bytes"),
            "mean_wire_vs_bf16": summary.get("mean_wire_vs_bf16"),
            "curve": [(s["step"], s["loss"]) for s in steps],
            # which candidate layers were in geometry-aware coordinates at each logged step
            "geometry": [(g["geometry_at"], sorted(n for n, (coords, _) in g["coords"].items()
                                                   if coords.startswith("geo")))
                         for g in geometry] or None,
            # train.py --log_stages: the error of the mean by stage, per logged step
            "stages": [(s["step"], s["stages"]) for s in stages] or None}


def execute(run, nproc, out_dir, origin, label):
    """Run it unless it finished with this command before; returns (its record, what happened)."""
    cmd = command(run, nproc)
    done = finished(run.path, cmd)
    if done is not None:
        return record(run, *done, nproc, cmd), "done before, skipped"
    t0 = time.time()
    print(f"{label}: running", flush=True)
    log_path = os.path.join(out_dir, "runs.log")
    os.makedirs(run.path, exist_ok=True)
    with open(os.path.join(run.path, "command.json"), "w") as f:
        json.dump(cmd[1:], f)
    with open(os.path.join(run.path, "provenance.json"), "w") as f:
        json.dump(origin, f)
    with open(log_path, "a") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    done = finished(run.path, cmd)
    if code or done is None:
        raise SystemExit(f"nanogeo.tools.study: {label} failed (exit code {code}); its output is at "
                         f"the end of {log_path}")
    return record(run, *done, nproc, cmd), f"{time.time() - t0:.0f}s"


# -----------------------------------------------------------------------------
# statistics

def mean_ci(values):
    """(mean, half-width of the 95 % Student t interval); nan half-width for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, T95.get(n - 1, 1.96) * sd / math.sqrt(n)


def reference_problem(reference_gaps):
    """Why no fraction of the reference's gap (per seed: reference - fp32) can be given, or None:
    one seed; a run that diverged; its paired t interval includes 0 (no gap established) or
    lies below it; or a seed in which it did not lose to fp32 (that seed's fraction would divide
    by a number <= 0)."""
    if len(reference_gaps) < 2:
        return "one seed"
    if not all(math.isfinite(g) for g in reference_gaps):
        return "reference gap not finite"
    mean, half = mean_ci(reference_gaps)
    if mean + half < 0:
        return "reference better than fp32"
    if mean - half <= 0:
        return "reference gap not significant"
    if min(reference_gaps) <= 0:
        return "reference gap <= 0 in a seed"
    return None


def recovered(gaps, reference_gaps, draws=2000):
    """The fraction of the reference's gap a method recovers, from per-seed fractions
    f = 1 - gap / reference gap (paired by seed): (mean of f, low, high, interval), a 95 % t
    interval - or with >= MIN_BOOTSTRAP_SEEDS seeds a 95 % percentile bootstrap of the mean
    (interval "bootstrap"). Ask reference_problem(reference_gaps) first."""
    fractions = [1 - g / r for g, r in zip(gaps, reference_gaps)]
    n = len(fractions)
    mean, half = mean_ci(fractions)
    if n < MIN_BOOTSTRAP_SEEDS:
        return mean, mean - half, mean + half, "t"
    rng = random.Random(0)
    means = sorted(sum(fractions[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return mean, means[int(0.025 * draws)], means[int(0.975 * draws) - 1], "bootstrap"


def estimate(values, digits=4, sign=""):
    """'mean ± half-width' (95 % t), or 'mean (one seed)'."""
    mean, half = mean_ci(values)
    if len(values) < 2:
        return f"{mean:{sign}.{digits}f} (one seed)"
    return f"{mean:{sign}.{digits}f} ± {half:.{digits}f}"


def paired(runs, other):
    """The seeds both dicts {seed: record} hold, and runs' val loss minus other's on each."""
    seeds = [s for s in sorted(runs) if s in other]
    return seeds, [runs[s]["final_val_loss"] - other[s]["final_val_loss"] for s in seeds]


def gap_cell(runs, other, row_seeds):
    seeds, gaps = paired(runs, other)
    if not seeds:
        return "—"
    return estimate(gaps, sign="+") + (f" ({len(seeds)} paired)" if len(seeds) < row_seeds else "")


def fraction_cell(runs, fp32, ref):
    seeds = [s for s in sorted(runs) if s in fp32 and s in ref]
    if not seeds:
        return "—"
    _, gaps = paired({s: runs[s] for s in seeds}, fp32)
    _, ref_gaps = paired({s: ref[s] for s in seeds}, fp32)
    problem = reference_problem(ref_gaps)
    if problem:
        return problem
    mean, lo, hi, interval = recovered(gaps, ref_gaps)
    return f"{100 * mean:.0f} % ({100 * lo:.0f} to {100 * hi:.0f} %, {interval})"


# -----------------------------------------------------------------------------
# tables

def group(r):
    """Runs compared with one another: same optimizer, W, kind of ranks, train flags (None: a
    record from before the flags were stored) and machine (None: not recorded). Runs of two
    machines are never paired: another CPU (or thread count) rounds differently, and over 300
    steps that moves a 4-bit run as far as a method's effect (BENCHMARKS.md section 14)."""
    flags = r.get("flags")
    return (r["optimizer"], r["workers"], r.get("simulated", False),
            None if flags is None else tuple(flags), r.get("machine"))


def group_order(key):
    optimizer, workers, simulated, flags, machine = key
    return optimizer, workers, simulated, flags is not None, flags or (), machine or ""


def heading(key, results):
    optimizer, workers, simulated, flags, machine = key
    rows = [r for r in results if group(r) == key]
    commits = sorted({(r.get("commit") or "?")[:10] + ("+dirty" if r.get("dirty") else "")
                      for r in rows})
    ranks = "simulated" if simulated else "real"
    flag_text = ("train flags not recorded (records from an older driver)" if flags is None
                 else "train flags: " + (" ".join(f"`{f}`" for f in flags) or "none"))
    mixed = (f" (**{len(commits)} commits**: pairs across them assume the code did not change "
             "their numbers)" if len(commits) > 1 else "")
    return [f"\n### {optimizer}, W = {workers} ({ranks} ranks)\n",
            f"{flag_text}; commit {', '.join(commits)}{mixed}; machine "
            f"{machine or 'not recorded (pairs may mix machines)'}\n"]


def wire_cell(rows):
    """Bytes per rank per step against a bf16 ring all-reduce, averaged over all steps (older
    records: the last step's)."""
    means = [r["mean_wire_vs_bf16"] for r in rows if r.get("mean_wire_vs_bf16") is not None]
    if means:
        return f"{sum(means) / len(means):.3f}"
    last = rows[0].get("wire_vs_bf16")
    return "-" if last is None else f"{last:.3f} (last step)"


def row(comm, runs, fp32, ref, baseline):
    """One method's row; runs, fp32, ref: {seed: record}. baseline: fp32 or the reference."""
    seeds = sorted(runs)
    return (f"| {comm} | {len(seeds)} | {estimate([runs[s]['final_val_loss'] for s in seeds])}"
            f" | {'—' if comm == 'fp32' else gap_cell(runs, fp32, len(seeds))}"
            f" | {'—' if baseline else gap_cell(runs, ref, len(seeds))}"
            f" | {'—' if baseline else fraction_cell(runs, fp32, ref)}"
            f" | {wire_cell([runs[s] for s in seeds])}"
            f" | {sum(runs[s]['ms_per_step'] for s in seeds) / len(seeds):.0f} |")


def table(results, reference):
    """The markdown tables of a study: per optimizer, W and train flags, one row per method."""
    lines = []
    study = [r for r in results if not r.get("sweep")]
    for key in sorted({group(r) for r in study}, key=group_order):
        by = {}
        for r in study:
            if group(r) == key:
                by.setdefault(r["comm"], {})[r["seed"]] = r
        fp32, ref = by.get("fp32", {}), by.get(reference, {})
        lines += heading(key, study)
        lines += [f"| method | seeds | final val loss (95 % t) | gap to fp32 (paired, 95 % t) | "
                  f"gap to {reference} (paired, 95 % t) | recovers of {reference}'s gap (95 %) | "
                  f"wire vs bf16 | ms/step |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [row(comm, runs, fp32, ref, comm in ("fp32", reference))
                  for comm, runs in by.items()]
        _, ref_gaps = paired(ref, fp32)
        problem = reference_problem(ref_gaps)
        if problem not in (None, "one seed"):
            lines.append(f"\n{reference}'s gap to fp32 is {estimate(ref_gaps, sign='+')}: "
                         f"{problem}, so no fraction of it is given.")
    legend = ("\nFinal val loss: train.py's, the mean of its last --final_evals evaluations. "
              "Intervals: 95 % Student t over seeds; gaps are paired by seed; the recovered "
              "fraction is the mean over seeds of 1 - gap / reference gap (a percentile "
              f"bootstrap, so labelled, from {MIN_BOOTSTRAP_SEEDS} seeds). Wire: the bytes a rank "
              "sends per step, averaged over all steps, in every collective of the gradient "
              "communication (with the scales' MAX and the K-FAC statistics' all-reduces), "
              "against a bf16 ring all-reduce.")
    return "\n".join(lines + ([legend] if lines else [])) + "\n"


# -----------------------------------------------------------------------------
# the learning-rate sweep

def gain_history(results):
    """Markdown: for each geometry arm (optimizer, W, simulated or real ranks, method), per
    seed, how many candidate layers were sent in geometry-aware coordinates at the first logged
    step and at every logged step where that changed ("step:count"), and how many distinct layers
    ever were."""
    arms = {}
    for r in results:
        if r.get("geometry") and not r.get("sweep"):
            key = r["optimizer"], r["workers"], r.get("simulated", False), r["comm"]
            arms.setdefault(key, []).append(r)
    lines = ["| optimizer | W | method | per seed: step:count at each change | layers ever |",
             "| --- | --- | --- | --- | --- |"]
    for (optimizer, workers, simulated, comm), runs in sorted(arms.items()):
        per_seed, ever = [], set()
        for r in sorted(runs, key=lambda r: r["seed"]):
            counts = [(step, len(names)) for step, names in r["geometry"]]
            changes = [f"{step}:{n}" for k, (step, n) in enumerate(counts)
                       if k == 0 or n != counts[k - 1][1]]
            per_seed.append(f"{r['seed']}: {' → '.join(changes)}")
            ever |= {name for _, names in r["geometry"] for name in names}
        ranks = workers if simulated else f"{workers} (real ranks)"
        lines.append(f"| {optimizer} | {ranks} | {comm} | {'; '.join(per_seed)} | {len(ever)} |")
    return "\n".join(lines) + "\n" if arms else ""


def parse_sweep(text, optimizers):
    """--sweep FLAG=V1,V2,... -> (flag, [value texts]); a message naming the fix otherwise."""
    flag, _, values = text.partition("=")
    if flag not in SWEEPABLE:
        raise ValueError(f"--sweep {text}: sweep one of {', '.join(SWEEPABLE)}, e.g. "
                         "--sweep muon_lr=1e-3,3e-3,1e-2")
    values = [v for v in values.split(",") if v]
    try:
        bad = [v for v in values if not float(v) > 0]
    except ValueError:
        bad = values
    if len(values) < 2 or bad:
        raise ValueError(f"--sweep {text}: give two or more positive numbers, e.g. "
                         f"--sweep {flag}=1e-3,3e-3,1e-2")
    wrong = [o for o in optimizers if o not in SWEEPABLE[flag]]
    if wrong:
        raise ValueError(f"--sweep {flag} applies to --optimizers "
                         f"{','.join(SWEEPABLE[flag])}, not {wrong[0]}")
    return flag, values


def sweep_groups(results):
    """{(optimizer, W, simulated, flag, the other train flags): {value: {seed: record}}}."""
    groups = {}
    for r in results:
        if r.get("sweep"):
            flag, value = r["sweep"]
            others = tuple(f for f in r["flags"] if f != f"--{flag}={value}")
            key = (r["optimizer"], r["workers"], r["simulated"], flag, others)
            groups.setdefault(key, {}).setdefault(value, {})[r["seed"]] = r
    return groups


def sweep_summary(results):
    """sweep.json's content: per sweep group every value's final val losses over the seeds
    all its values share, and the best value (the lowest mean; nan counts as worst)."""
    entries = []
    for (optimizer, workers, simulated, flag, others), by_value in sweep_groups(results).items():
        seeds = sorted(set.intersection(*(set(runs) for runs in by_value.values())))
        values = sorted(by_value, key=float)
        losses = {v: [by_value[v][s]["final_val_loss"] for s in seeds] for v in values}
        means = {v: mean_ci(losses[v])[0] if seeds else float("nan") for v in values}
        best = min(values, key=lambda v: (math.isnan(means[v]), means[v]))
        entries.append({"optimizer": optimizer, "workers": workers, "simulated": simulated,
                        "flag": flag, "train_flags": list(others), "seeds": seeds,
                        "values": [{"value": v, "final_val_loss": losses[v], "mean": means[v]}
                                   for v in values],
                        "best": best, "best_at_edge": best in (values[0], values[-1])})
    return entries


def sweep_table(entries):
    lines = []
    for e in entries:
        ranks = "simulated" if e["simulated"] else "real"
        lines += [f"\n### {e['optimizer']}, W = {e['workers']} ({ranks} ranks): {e['flag']}\n",
                  "train flags: " + (" ".join(f"`{f}`" for f in e["train_flags"]) or "none")
                  + f"; seeds {', '.join(map(str, e['seeds']))}\n",
                  f"| {e['flag']} | final val loss (95 % t) | gap to the best (paired, 95 % t) |",
                  "| --- | --- | --- |"]
        best = next(v["final_val_loss"] for v in e["values"] if v["value"] == e["best"])
        for v in e["values"]:
            gaps = [a - b for a, b in zip(v["final_val_loss"], best)]
            mark = " (best)" if v["value"] == e["best"] else ""
            lines.append(f"| {v['value']}{mark} | {estimate(v['final_val_loss'])} | "
                         f"{'—' if mark or not gaps else estimate(gaps, sign='+')} |")
        if e["best_at_edge"]:
            lines.append(f"\nThe best value is at an end of the grid: extend it past {e['best']}.")
    return "\n".join(lines) + "\n"


def lr_flags(path, optimizer, workers):
    """The best value of every flag swept for this optimizer and W in sweep.json at `path`, as
    train flags; a ValueError naming the fix when there is none or more than one. Simulated
    and real ranks count alike (the same numerics: train.py --simulate_workers)."""
    try:
        entries = json.load(open(path))["sweeps"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"--lr_from {path}: not a sweep.json written by "
                         "`python -m nanogeo.tools.study --sweep ...`") from None
    ranks = f"W = {workers}"
    mine = [e for e in entries if (e["optimizer"], e["workers"]) == (optimizer, workers)]
    if not mine:
        raise ValueError(f"--lr_from {path} has no sweep for {optimizer} at {ranks}: run "
                         f"--sweep with --optimizers {optimizer} at this W first, or "
                         "leave --lr_from out")
    flags = [e["flag"] for e in mine]
    twice = [f for f in flags if flags.count(f) > 1]
    if twice:
        raise ValueError(f"--lr_from {path} holds {flags.count(twice[0])} sweeps of {twice[0]} "
                         f"for {optimizer} at {ranks} (other train flags): keep one sweep of a "
                         "flag per out_dir")
    return [f"--{e['flag']}={e['best']}" for e in mine]


# -----------------------------------------------------------------------------
# outputs

def merge(earlier, new):
    """results.json's records: the earlier ones, except those with the command of one of this
    call's runs (run again now), then this call's. A record without a command (from an older
    driver) is kept as it was, never replaced."""
    commands = {tuple(r["command"]) for r in new}
    return [r for r in earlier if tuple(r.get("command", ())) not in commands] + new


def write(results, out_dir, reference):
    """results.json keeps the records of earlier invocations on the same out_dir (another grid,
    other flags, another process running now) too: a study can grow one call at a time, and
    two calls may run at once (the read-merge-write is locked). Returns all records."""
    path = os.path.join(out_dir, "results.json")
    with open(os.path.join(out_dir, "results.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        earlier = json.load(open(path)) if os.path.exists(path) else []
        results = merge(earlier, results)
        replace_json(path, results)
        if any(not r.get("sweep") for r in results):
            with open(os.path.join(out_dir, "study.md"), "w") as f:
                f.write(table(results, reference))
        sweeps = sweep_summary(results)
        if sweeps:
            replace_json(os.path.join(out_dir, "sweep.json"), {"sweeps": sweeps})
            with open(os.path.join(out_dir, "sweep.md"), "w") as f:
                f.write(sweep_table(sweeps))
    return results          # the lock is released when its file closes


def replace_json(path, content):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=1)
    os.replace(tmp, path)


def plot(results, out_dir):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no loss plots")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    study = [r for r in results if not r.get("sweep")]
    keys = sorted({group(r) for r in study}, key=group_order)
    for key in keys:
        optimizer, workers, simulated, *_ = key
        fig, ax = plt.subplots(figsize=(7, 4))
        for comm in dict.fromkeys(r["comm"] for r in study):
            curves = [r["curve"] for r in study if r["comm"] == comm and group(r) == key]
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
        # one file per group; a second set of train flags for the same optimizer and W gets _2
        same = [k for k in keys if k[:3] == key[:3]]
        suffix = f"_{same.index(key) + 1}" if same.index(key) else ""
        ranks = "sim" if simulated else "ranks"
        fig.savefig(os.path.join(out_dir, f"loss_{optimizer}_{ranks}{workers}{suffix}.png"),
                    dpi=120)
        plt.close(fig)


# -----------------------------------------------------------------------------
# the answer: which method to run, per optimizer and wire budget

# the wire formats a user chooses between, and the bytes (vs a bf16 ring all-reduce) the study's
# goals allow each: FP8 = e4m3/e5m2 codes, 4-bit = NVFP4
BUDGETS = (("FP8", 0.52), ("4-bit", 0.30))


def wire_format(comm):
    """"FP8", "4-bit", or None (fp32, bf16): the budget row a method belongs to."""
    flags = COMMS[comm]
    if flags[0] in ("--comm=fp32", "--comm=bf16"):
        return None
    return "4-bit" if "--fmt=nvfp4" in flags else "FP8"
ANSWER_BEGIN, ANSWER_END = "<!-- answer: begin -->", "<!-- answer: end -->"


def cost(comm):
    """How much a method adds to plain quantisation: 0 Euclidean, 1 error feedback or
    stochastic rounding, 2 the Hadamard rotation (no statistics), 3 a geometry (statistics,
    refreshes, gain checks)."""
    flags = COMMS[comm]
    kind = flags[0].partition("=")[2]
    if kind in ("fp32", "bf16", "fp8"):
        return int("--error_feedback" in flags or "--stochastic_round" in flags)
    return 2 if kind == "hadamard" else 3


def collective(comm):
    """The wire format and collective flags of a method (the same for its Euclidean twin)."""
    return [f for f in COMMS[comm] if f.startswith(("--fmt", "--block", "--collective"))]


def mean_ms(runs):
    return sum(r["ms_per_step"] for r in runs.values()) / len(runs)


def study_groups(results, workers):
    """{optimizer: {comm: {seed: record}}} of the study's runs at W = workers; per optimizer
    one set of train flags and one machine (a study has one set of flags, from --lr_from and --,
    and runs every arm on one machine): the group with the most runs among those whose machine
    was recorded (the others' pairs may mix machines), or among all when none was; a tie goes to
    the first in group_order, so the table never depends on hashing."""
    out = {}
    for optimizer in sorted({r["optimizer"] for r in results}):
        rows = [r for r in results if not r.get("sweep") and r["optimizer"] == optimizer
                and r["workers"] == workers]
        if not rows:
            continue
        keys = [group(r) for r in rows]
        main = min(set(keys), key=lambda k: (k[-1] is None, -keys.count(k), group_order(k)))
        for r in rows:
            if group(r) == main:
                out.setdefault(optimizer, {}).setdefault(r["comm"], {})[r["seed"]] = r
    return out


def includes_zero(values):
    mean, half = mean_ci(values)
    return abs(mean) <= half


def wire_of(runs):
    """A method's bytes vs bf16, averaged over its runs; None for records without them."""
    means = [r.get("mean_wire_vs_bf16") for r in runs.values()]
    return None if None in means else sum(means) / len(means)


def recommend(by_comm, name):
    """The method to run with a wire format (name: "FP8" or "4-bit"): among its methods with
    >= 2 seeds paired with fp32 and every run finite, the best is the one with the lowest mean
    gap to fp32 (on the seeds it shares with the format's plain method); the recommendation is
    the cheapest method (cost()) whose paired difference to the best includes 0 at 95 % on
    every seed the best has (the best itself when none does). Returns (recommended, best) or
    None."""
    fp32 = by_comm.get("fp32", {})
    gaps = {c: paired(runs, fp32)[1] for c, runs in by_comm.items() if c != "fp32"}
    fits = [c for c, g in gaps.items() if len(g) >= 2 and all(map(math.isfinite, g))
            and wire_format(c) == name and wire_of(by_comm[c]) is not None]
    if not fits:
        return None
    # methods with other seeds are compared on the seeds they share: by their mean paired
    # difference to the format's plain method with the most seeds (0 for itself)
    plain = max((c for c in fits if cost(c) == 0), key=lambda c: (len(by_comm[c]), c),
                default=None)

    def score(c):
        if plain is None:
            return mean_ci(gaps[c])[0]
        return 0.0 if c == plain else mean_ci(paired(by_comm[c], by_comm[plain])[1])[0]
    best = min(fits, key=lambda c: (score(c), cost(c), c))

    best_seeds = len(gaps[best])

    def as_good_as_best(c):
        """Paired with the best on every seed the best was measured on (fewer seeds, a wider
        interval, must not make a method look as good), and the difference includes 0."""
        seeds, diff = paired(by_comm[c], by_comm[best])
        return c == best or (len(seeds) >= max(2, best_seeds) and includes_zero(diff))
    recommended = min((c for c in fits if as_good_as_best(c)),
                      key=lambda c: (cost(c), mean_ci(gaps[c])[0], c))
    return recommended, best


def answer_row(optimizer, name, budget, by_comm):
    """One row of the answer table (a wire format's recommendation), and its notes."""
    label = f"| {optimizer} | {name} |"
    picked = recommend(by_comm, name)
    if picked is None:
        return label + " nothing measured yet (>= 2 finite seeds paired with fp32) | | | | | | |", []
    comm, best = picked
    fp32, bf16, runs = by_comm.get("fp32", {}), by_comm.get("bf16", {}), by_comm[comm]
    seeds, gaps = paired(runs, fp32)
    euclid = [c for c in by_comm if cost(c) == 0 and c not in ("fp32", "bf16")
              and collective(c) == collective(comm)]
    speed = f"{mean_ms(runs) / mean_ms(by_comm[euclid[0]]):.2f}×" if euclid else "—"
    other = "—" if best == comm else f"{best}: {estimate(paired(by_comm[best], fp32)[1], sign='+')}"
    row = (f"{label} {comm} | {len(seeds)} | {estimate(gaps, sign='+')} | "
           f"{gap_cell(runs, bf16, len(seeds)) if bf16 else '—'} | {wire_of(runs):.3f} | "
           f"{speed} | {other} |")
    notes = []
    if cost(comm) == 0 and includes_zero(gaps):
        notes.append(f"{optimizer}, {name}: plain {comm} is indistinguishable from fp32 here "
                     "(its paired gap's 95 % interval includes 0).")
    if wire_of(runs) > budget:
        notes.append(f"{optimizer}, {name}: {comm} sends {wire_of(runs):.3f}× bf16's bytes here, "
                     f"above the {budget:.2f}× the goal allows.")
    return row, notes


def answer(results, workers=32):
    """The README's answer table (markdown) from a study's records at W = workers; a
    ValueError when the records hold no study run at that W."""
    groups = study_groups(results, workers)
    if not groups:
        raise ValueError(f"no study run at W = {workers} in these results: pass the W the "
                         "study ran at (--answer_workers)")
    lines = ["| optimizer | wire format | run this | seeds | gap to fp32 (paired, 95 % t) | "
             "gap to bf16 (paired, 95 % t) | wire vs bf16 | ms/step vs Euclidean | "
             "best measured, if another |", "| --- " * 9 + "|"]
    notes = []
    for optimizer, by_comm in groups.items():
        for name, budget in BUDGETS:
            row, row_notes = answer_row(optimizer, name, budget, by_comm)
            lines.append(row)
            notes += row_notes
    used = [r for runs in groups.values() for seed_runs in runs.values()
            for r in seed_runs.values()]
    for optimizer, by_comm in groups.items():
        # every run of a group shares its machine (the machine is part of the group)
        machine = next(r.get("machine") for runs in by_comm.values() for r in runs.values())
        notes.append(f"{optimizer}: " + (f"runs of one machine, {machine}." if machine else
                                         "machine not recorded: pairs may mix machines."))
    unfinished = sorted({r["comm"] for r in used if not math.isfinite(r["final_val_loss"])})
    if unfinished:
        notes.append(f"Not finite in some run, so in no row: {', '.join(unfinished)}.")
    rule = ("Run this: among the methods measured with that wire format (>= 2 seeds paired "
            "with fp32), the cheapest (Euclidean, then error feedback or stochastic rounding, "
            "then the Hadamard rotation, then a geometry) whose paired difference to the best "
            "one's gap includes 0 at 95 % on every seed the best one has - with few seeds that "
            "is weak evidence of equality, so the best measured method is shown beside it. "
            f"W = {workers} ranks; seeds: those paired with fp32; ms/step: the study's simulated "
            "step against Euclidean on the same collective (the whole step, on a shared CPU: a "
            "rough guide, not a GPU timing).")
    return "\n".join(lines + [""] + notes + ([""] if notes else []) + [rule]) + "\n"


def answers(results, workers=(32,)):
    """answer() at each W in `workers`, one table after another, each under a "W = ..." line
    when there are several: the README's block."""
    if len(workers) == 1:
        return answer(results, workers[0])
    return "\n".join(f"**W = {w} ranks**\n\n{answer(results, w)}" for w in workers)


def write_answer(results_path, readme, workers=(32,)):
    """Replace the README's text between the answer markers with answers(results_path's
    records, workers) and return that text; a ValueError naming the fix when the markers are
    missing."""
    text = open(readme).read()
    head, begin, rest = text.partition(ANSWER_BEGIN)
    _, end, tail = rest.partition(ANSWER_END)
    if not begin or not end:
        raise ValueError(f"{readme} has no {ANSWER_BEGIN} ... {ANSWER_END} block: add one "
                         "where the table goes")
    table_text = answers(json.load(open(results_path)), workers)
    with open(readme + ".tmp", "w") as f:
        f.write(f"{head}{ANSWER_BEGIN}\n{table_text}{ANSWER_END}{tail}")
    os.replace(readme + ".tmp", readme)
    return table_text


def stage_table(results):
    """Markdown: per method and W, the error of the mean by stage (train.py --log_stages) as a
    ratio to the mean's sampling noise, in L2 and as each optimizer sees it - the mean over the
    logged steps after the first quarter of the run (the warm-up's first steps are not
    representative) and over the seeds."""
    cells = {}
    for r in results:
        late = [stages for step, stages in r.get("stages") or [] if step > r["steps"] // 4]
        for stages in late:
            for metric, parts in stages.items():
                key = (r["optimizer"], r["workers"], r["comm"], metric)
                cells.setdefault(key, []).append(parts)
    if not cells:
        return ""
    lines = ["| optimizer | method | W | metric | stage 1 | stage 2 | total | logged steps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (optimizer, workers, comm, metric), parts in sorted(cells.items()):
        mean = {k: sum(p[k] for p in parts) / len(parts) for k in ("stage1", "stage2", "total")}
        lines.append(f"| {optimizer} | {comm} | {workers} | {metric} | {mean['stage1']:.3f} | "
                     f"{mean['stage2']:.3f} | {mean['total']:.3f} | {len(parts)} |")
    return "\n".join(lines) + "\n"


def sensitivity(results, other):
    """Markdown: the same runs (method, optimizer, W, seed, steps) in two results files - two
    thread counts, compiled or not, two machines - and how far apart their final val losses
    ended: per method the mean and the largest |difference| over the seeds both have. (Pass
    files of one study each: a run met twice in a file counts once, the later record.)"""
    def key(r):
        return r["comm"], r["optimizer"], r["workers"], r["seed"], r["steps"]
    theirs = {key(r): r for r in other if not r.get("sweep")}
    by_comm = {}
    for r in results:
        if not r.get("sweep") and key(r) in theirs:
            diff = r["final_val_loss"] - theirs[key(r)]["final_val_loss"]
            by_comm.setdefault((r["comm"], r["optimizer"], r["workers"]), []).append(diff)
    lines = ["| method | optimizer | W | seeds | mean abs difference | largest abs difference | "
             "differences |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for (comm, optimizer, workers), diffs in sorted(by_comm.items()):
        lines.append(f"| {comm} | {optimizer} | {workers} | {len(diffs)} | "
                     f"{sum(map(abs, diffs)) / len(diffs):.4f} | {max(map(abs, diffs)):.4f} | "
                     + ", ".join(f"{d:+.4f}" for d in diffs) + " |")
    return "\n".join(lines) + "\n"


def at_endpoint(results, endpoint):
    """The records with their final_val_loss taken from one end point: "final" (train.py's
    final val loss, as recorded) or "tail" (its tail val loss, --tail_evals; records without
    one are left out)."""
    if endpoint == "final":
        return results
    return [{**r, "final_val_loss": r["tail_val_loss"]} for r in results
            if r.get("tail_val_loss") is not None]


# -----------------------------------------------------------------------------
# the command line

def parse_args(argv):
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--comms", default=None, help="methods (default fp32,bf16,fp8,geofp8), "
                        f"from: {', '.join(COMMS)} (hadamard*: needs train.py --comm=hadamard)")
    parser.add_argument("--optimizers", default="adamw", help="adamw, muon or both")
    parser.add_argument("--seeds", default="1337", help="comma-separated seeds")
    parser.add_argument("--workers", default="0", help="simulated ranks per run, comma-separated "
                        "(0: real ranks, --nproc of them, through torchrun)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reference", default=None, help="the Euclidean method whose gap the "
                        "others recover (default: the first of fp8, fp8-paper, e5m2-tensor, "
                        "nvfp4 in --comms)")
    parser.add_argument("--sweep", default=None, help="FLAG=V1,V2,...: fp32 runs at each value "
                        f"of FLAG ({', '.join(SWEEPABLE)}); the best goes to out_dir/sweep.json")
    parser.add_argument("--lr_from", default=None, help="a sweep.json: every method of an "
                        "optimizer trains with the best values swept for it at that W")
    parser.add_argument("--answer", default=None, metavar="RESULTS", help="print the "
                        "which-method-to-run table from a study's results.json (no runs); with "
                        "--readme FILE, write it between FILE's answer markers")
    parser.add_argument("--readme", default=None)
    parser.add_argument("--table", default=None, metavar="RESULTS", help="print study.md's "
                        "tables of a results.json again (no runs), e.g. with another --reference")
    parser.add_argument("--stages", default=None, metavar="RESULTS", help="print the error of "
                        "the mean by stage of runs with train.py --log_stages (no runs)")
    parser.add_argument("--sensitivity", default=None, nargs=2, metavar="RESULTS",
                        help="print how far the same runs in two results files ended apart "
                        "(two thread counts, compiled or not, two machines)")
    parser.add_argument("--endpoint", default="final", choices=("final", "tail"),
                        help="--table compares the runs' final val loss (default) or their "
                        "tail val loss (train.py --tail_evals)")
    parser.add_argument("--answer_workers", default=None, help="W of --answer's table (default "
                        "32); several (e.g. 32,64): one table per W, in that order")
    parser.add_argument("--out_dir", default="out/ablate")
    args = parser.parse_args(argv)
    return parser, args, extra


def tuned_flags(args, optimizers, workers, flag, extra):
    """{(optimizer, W): the learning-rate flags --lr_from gives it}; a ValueError when they,
    the swept flag and the flags after -- set one thing twice."""
    lrs = {(o, w): lr_flags(args.lr_from, o, w or args.nproc) if args.lr_from else []
           for o in optimizers for w in workers}
    from_file = {f.partition("=")[0] for flags in lrs.values() for f in flags}
    if flag and f"--{flag}" in from_file:
        raise ValueError(f"--lr_from sets the {flag} that --sweep sweeps: drop one of them")
    clash = [f for f in extra if f.partition("=")[0] in from_file | {f"--{flag}"}]
    if clash:
        raise ValueError(f"{clash[0]} after -- sets what --sweep / --lr_from set: drop one of "
                         "them")
    return lrs


def plan(parser, args, extra):
    """Every run of this call, in order: [Run]."""
    if args.sweep and args.comms not in (None, "fp32"):
        parser.error("--sweep runs fp32 only: leave --comms out")
    comms = (args.comms or ("fp32" if args.sweep else "fp32,bf16,fp8,geofp8")).split(",")
    optimizers = args.optimizers.split(",")
    unknown = [c for c in comms if c not in COMMS] + [o for o in optimizers
                                                      if o not in ("adamw", "muon")]
    if unknown:
        parser.error(f"unknown method or optimizer {unknown[0]!r}; methods: {', '.join(COMMS)}")
    choices = config.TRAIN_CHOICES["comm"]
    missing = [c for c in comms if COMMS[c][0].partition("=")[2] not in choices]
    if missing:
        parser.error(f"method {missing[0]} needs train.py {COMMS[missing[0]][0]}, which this "
                     "train.py does not have yet: leave it out of --comms")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error("--seeds and --workers take comma-separated integers, e.g. --seeds 0,1,2")
    try:
        flag, values = parse_sweep(args.sweep, optimizers) if args.sweep else (None, [None])
        lrs = tuned_flags(args, optimizers, workers, flag, extra)
    except ValueError as e:
        parser.error(str(e))
    runs = []
    for value in values:
        root = os.path.join(args.out_dir, f"{flag}={value}") if flag else args.out_dir
        swept = [f"--{flag}={value}"] if flag else []
        runs += [Run(c, o, w, s, run_dir(root, c, o, w, args.nproc, s),
                     tuple(lrs[(o, w)] + swept + extra), (flag, value) if flag else ())
                 for o in optimizers for w in workers for s in seeds for c in comms]
    return comms, runs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser, args, extra = parse_args(argv)
    if args.stages or args.sensitivity:
        try:
            print(stage_table(json.load(open(args.stages))) if args.stages else
                  sensitivity(*(json.load(open(f)) for f in args.sensitivity)), end="")
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"--stages / --sensitivity: {e}")
        return
    if args.table:
        try:
            results = at_endpoint(json.load(open(args.table)), args.endpoint)
            print(table(results, args.reference or "fp8"), end="")
            history = gain_history(results)
            if history:
                print("\nCandidate layers in geometry-aware coordinates (logged steps):\n")
                print(history, end="")
        except (OSError, ValueError) as e:
            parser.error(f"--table {args.table}: {e}")
        return
    if (args.readme or args.answer_workers) and not args.answer:
        parser.error("--readme and --answer_workers go with --answer RESULTS: give both")
    if args.answer:
        if not os.path.exists(args.answer):
            parser.error(f"--answer {args.answer}: no such results file (a study's "
                         "out_dir/results.json)")
        try:
            workers = [int(w) for w in (args.answer_workers or "32").split(",")]
        except ValueError:
            parser.error(f"--answer_workers {args.answer_workers!r}: comma-separated integers, "
                         "e.g. 32,64")
        if len(set(workers)) < len(workers):
            parser.error(f"--answer_workers {args.answer_workers!r} names a W twice")
        try:
            text = (write_answer(args.answer, args.readme, workers) if args.readme
                    else answers(json.load(open(args.answer)), workers))
            print(text, end="")
        except ValueError as e:
            parser.error(str(e))
        return
    comms, runs = plan(parser, args, extra)
    reference = args.reference or next((c for c in comms if c in EUCLIDEAN), "fp8")
    os.makedirs(args.out_dir, exist_ok=True)
    origin = {**git_commit(), "machine": machine()}     # where the runs run: provenance.json
    results, everything = [], []
    for k, run in enumerate(runs, 1):
        sweep = f" {run.sweep[0]}={run.sweep[1]}" if run.sweep else ""
        label = (f"[{k}/{len(runs)}] {run.comm} {run.optimizer} W={run.workers or args.nproc} "
                 f"seed={run.seed}{sweep}")
        result, state = execute(run, args.nproc, args.out_dir, origin, label)
        results.append(result)
        print(f"{label}: val {result['final_val_loss']:.4f} ({state})", flush=True)
        everything = write(results, args.out_dir, reference)
    if args.sweep:
        print(sweep_table(sweep_summary(everything)))
        print(f"best values: {os.path.join(args.out_dir, 'sweep.json')} (use it with --lr_from)")
        return
    plot(everything, args.out_dir)
    print(table(everything, reference))


if __name__ == "__main__":
    main()
