"""
`make gpu-smoke` (--nproc=N): a node's first-contact test. first_contact prints the env line,
starts ranks.worker on N ranks under torchrun, runs train.py for the training check, then prints
one PASS / FAIL / SKIP line per check (describe), a summary line, and writes smoke.json.

Every torchrun goes through run_bounded: a session of its own, killed with every process it
started (os.killpg) after --timeout seconds, so a hung collective becomes a FAIL line that says
so (exit_reason), never ranks left holding the GPUs.

    run_bounded, exit_reason                   a bounded command, and one line for its failure
    train_command, run_training, step_figures  train.py under torchrun, and its log's figures
    smoke_training                             the train check: geofp8 resumed, and Muon
    describe                                   one line per check
    first_contact                              the whole of make gpu-smoke
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

import compress
from nanogeo.run import runtime
from nanogeo.smoke.ranks import env_figures


def train_command(nproc, out_dir, toy, extra):
    """train.py under torchrun for the training check (the package never imports train.py: it
    runs it, as a user would)."""
    root = os.path.dirname(os.path.abspath(compress.__file__))
    shape = (["--preset=cpu-tiny", "--batch_size=4", "--block_size=32", "--device=cpu"] if toy
             else ["--preset=cpu-tiny", "--compile", "--device=cuda"])
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={nproc}", os.path.join(root, "train.py"), *shape,
             f"--out_dir={out_dir}", "--overwrite=true", "--log_interval=1", "--eval_interval=1000",
             "--eval_iters=2", "--final_evals=1", "--check_every=10", "--warmup_iters=5", *extra],
            root)


def run_bounded(command, cwd, timeout, env=None):
    """subprocess.run(command) in a session of its own, killed with every process it started
    (torchrun and its ranks) after `timeout` seconds: (exit code or None on a timeout, stdout,
    stderr). A hung collective shows as a timeout, never as ranks left holding the GPUs."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def exit_reason(code, stderr, timeout):
    """One line: why a torchrun command failed."""
    if code is None:
        return (f"no result after {timeout:.0f} s (a hang: a collective that not every rank "
                "entered?); every process was killed")
    tail = [line for line in stderr.splitlines() if line.strip()][-1:] or ["(no stderr)"]
    return f"exited {code}: {tail[0][:300]}"


def run_training(nproc, out_dir, toy, extra, timeout):
    command, root = train_command(nproc, out_dir, toy, extra)
    code, _, err = run_bounded(command, root, timeout)
    if code != 0:
        raise RuntimeError(f"train.py {exit_reason(code, err, timeout)}")
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_figures(records, first_step=0):
    steps = [r for r in records if "dt_ms" in r and r["step"] > first_step]
    ms = sorted(r["dt_ms"] for r in steps[1:])      # the first step compiles
    slowest = max(steps[1:], key=lambda r: r["dt_ms"])
    return {"first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "median_step_ms": ms[len(ms) // 2], "slowest_step": slowest["step"],
            "slowest_step_ms": slowest["dt_ms"], "first_step_ms": steps[0]["dt_ms"]}


def smoke_training(nproc, work, toy, timeout):
    """30 steps of --comm=geofp8, resumed to 40, and 30 of Muon; train.py itself compares the
    ranks' parameters (a checksum all-reduce every 10 steps: RankMismatch stops it)."""
    geo = ["--comm=geofp8", "--geo_warmup=5", "--geo_refresh=10", "--learning_rate=3e-3"]
    out = {}
    run = os.path.join(work, "geofp8")
    first = run_training(nproc, run, toy, [*geo, "--max_iters=30"], timeout)
    resumed = run_training(nproc, run, toy, [*geo, "--max_iters=40", "--resume"], timeout)
    out["geofp8"] = step_figures(first)
    summary = [r["summary"] for r in resumed if "summary" in r][-1]
    out["geofp8"].update(resumed_to=max(r["step"] for r in resumed if "dt_ms" in r),
                         resumed_last_loss=[r for r in resumed if "dt_ms" in r][-1]["loss"],
                         param_sha256=summary["param_sha256"][:16])
    muon = run_training(nproc, os.path.join(work, "muon"), toy,
                        ["--comm=fp8", "--optimizer=muon", "--max_iters=30", "--learning_rate=3e-3"],
                        timeout)
    out["muon"] = step_figures(muon)
    out["host_syncs_per_step"] = ("not measured by the smoke test: tests/test_train.py counts "
                                  "them on the CPU")
    ok = (out["geofp8"]["resumed_to"] == 40
          and all(out[k]["last_loss"] < out[k]["first_loss"] for k in ("geofp8", "muon")))
    return ("PASS" if ok else "FAIL"), out


def describe(name, status, figures):
    """One line for a check: PASS/FAIL/SKIP, its name and its main figures."""
    if "why" in figures:
        return f"{status} {name}: {figures['why']}"
    if name == "env":
        return (f"{status} env: torch {figures['torch']} | CUDA {figures['cuda']} | NCCL "
                f"{figures.get('nccl', '-')} | {figures['machine']} | {figures['device']}"
                + (f" (sm {figures['capability']})" if "capability" in figures else ""))
    if name == "codec":
        rates = " ".join(f"{k[:-9]} {v:.1f}" for k, v in figures.items() if k.endswith("_gb_per_s"))
        same = [v for k, v in figures.items() if k.endswith("equals_eager")]
        return (f"{status} codec: compiled == eager bytes: "
                f"{all(same) if same else 'not compiled (--no-compile)'} | GB/s: {rates}")
    if name == "collective":
        return f"{status} collective: " + " | ".join(
            f"{fmt} error/bound {r['error_vs_bound']:.2f}, same bytes on every rank "
            f"{r['same_bytes_every_rank']}, = simulator {r['equals_simulator']}"
            for fmt, r in figures.items() if isinstance(r, dict))
    if name == "fp8-sum":
        return f"{status} fp8-sum: " + " | ".join(
            f"{fmt} gap vs emulation {r['max_gap_vs_emulation']:.3f}, saturated "
            f"{r['saturated'][0]:.3f} (emulated {r['emulated_saturated'][0]:.3f})"
            for fmt, r in figures.items() if isinstance(r, dict))
    if name == "ddp":
        return (f"{status} ddp: max rel err vs plain DDP {max(figures['rel_err_per_step']):.4f}, "
                f"{figures['geo_matrices']} geo matrices, same grads on every rank "
                f"{figures['same_grads_every_rank']}")
    if name == "fsdp":
        return f"{status} fsdp: max rel err vs fp32 " + ", ".join(
            f"{m} {max(e):.4f}" for m, e in figures["rel_err_per_step"].items())
    if name == "train":
        g, m = figures["geofp8"], figures["muon"]
        return (f"{status} train: geofp8 loss {g['first_loss']:.3f} -> {g['last_loss']:.3f}, "
                f"resumed to {g['resumed_to']} ({g['resumed_last_loss']:.3f}), "
                f"{g['median_step_ms']:.0f} ms/step, slowest step {g['slowest_step']} "
                f"{g['slowest_step_ms']:.0f} ms | muon {m['first_loss']:.3f} -> "
                f"{m['last_loss']:.3f}, {m['median_step_ms']:.0f} ms/step")
    return f"{status} {name}"


def first_contact(args):
    """`make gpu-smoke`: the env check here, the rank checks under torchrun, the training runs
    as train.py; one line per check, a summary, smoke.json."""
    reason = runtime.cuda_build_missing()
    if reason:                          # the one-line stop of a CPU-only torch on a GPU node
        print(f"FAIL env: {reason}", file=sys.stderr)
        sys.exit(2)
    cuda = torch.cuda.is_available()
    toy = not cuda
    nproc = args.nproc
    if cuda and nproc > torch.cuda.device_count():
        nproc = torch.cuda.device_count()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    results, lines, t_start = {}, [], time.time()

    def report(name, status, figures):
        results[name] = {"status": status, **figures}
        lines.append(describe(name, status, figures))
        print(lines[-1], flush=True)

    report("env", "PASS", {**env_figures(device), "nproc": nproc})
    with tempfile.TemporaryDirectory(prefix="nanogeo-smoke-") as work:
        ranks_out = os.path.join(work, "ranks.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", "-m", "nanogeo.smoke", "--worker",
                   f"--worker_out={ranks_out}", f"--numel={args.numel}", f"--iters={args.iters}",
                   "--compile" if args.compile else "--no-compile"]
        root = os.path.dirname(os.path.abspath(compress.__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        code, _, err = run_bounded(command, root, args.timeout, env)
        ranks = {}
        if os.path.exists(ranks_out):
            with open(ranks_out) as f:
                ranks = json.load(f)
        for name in ("codec", "collective", "fp8-sum", "ddp", "fsdp"):
            figures = dict(ranks.get(name) or {"status": "FAIL", "why": "not run: torchrun "
                                               + exit_reason(code, err, args.timeout)})
            report(name, figures.pop("status"), figures)
        if args.train:
            try:
                report("train", *smoke_training(nproc, work, toy, args.timeout))
            except Exception as e:
                report("train", "FAIL", {"why": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
        else:
            report("train", "SKIP", {"why": "--no-train"})
    counts = {s: sum(r["status"] == s for r in results.values()) for s in ("PASS", "FAIL", "SKIP")}
    results["summary"] = {**counts, "seconds": round(time.time() - t_start, 1), "nproc": nproc,
                          "device": results["env"]["device"], "toy": toy}
    print(f"gpu-smoke: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"| {nproc} x {results['env']['device']}{' (toy size)' if toy else ''} | "
          f"{results['summary']['seconds']:.0f}s" + (f" | {args.out}" if args.out else ""),
          flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if counts["FAIL"]:
        sys.exit(1)
    return results
