"""
A study's runs: each run's directory and train.py command, running it (skipped when it finished
with the same command: a study resumes), the record results.json keeps of it with its provenance
(commit, machine), and results.json's locked read-merge-write.
"""

import fcntl
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

from nanogeo.lab.study.arms import COMMS
from nanogeo.lab.study.report import table
from nanogeo.lab.study.sweep import sweep_summary, sweep_table

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the repo
LR_FIELDS = ("learning_rate", "min_lr", "muon_lr", "muon_adjust_lr")    # recorded from the config


@dataclass(frozen=True)
class StudyRun:
    """One training run of a study: a method (arm) x optimizer x W x seed."""
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
        raise SystemExit(f"nanogeo.lab.study: {label} failed (exit code {code}); its output is at "
                         f"the end of {log_path}")
    return record(run, *done, nproc, cmd), f"{time.time() - t0:.0f}s"


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
