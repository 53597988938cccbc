"""
`make gpu-smoke` (--nproc=N): a node's first-contact test. first_contact prints the env line,
starts ranks.worker on N ranks under torchrun, runs train.py for the training check, then prints
one PASS / FAIL / SKIP line per check (describe), what was NOT tested and why, the figures of a
GPU run (not checked), a summary line, and writes smoke.json. A SKIP is never counted as passed.

Time is bounded twice. Inside: the ranks' process group waits --pg_timeout seconds (120) for a
collective, then the backend reports the hang itself (NCCL's watchdog names the collective and
its sequence number; gloo raises "Timed out ..."), and exit_reason quotes that line. Outside:
the whole smoke has --deadline seconds (600 on GPUs; 1200 on CPU ranks, where inductor compiles
slowly); every torchrun goes through run_bounded, in a session of its own, killed with every
process it started (os.killpg) when its share runs out, and what had no time left to run is a
FAIL that says so, never ranks left holding the GPUs.

    run_bounded, exit_reason                   a bounded command, and one line for its failure
    train_command, run_training, step_figures  train.py under torchrun, and its log's figures
    smoke_training                             the train check: geofp8 resumed, and Muon
    describe, coverage                         one line per check; what was not tested, in words
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
from nanogeo.smoke.ranks import env_figures, worst


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


# lines in which a backend reports a hang or a failed collective, most telling first: NCCL's
# watchdog after the process group's timeout, gloo's timeout, torch's distributed errors
DIAGNOSES = ("Watchdog caught collective operation timeout", "Timed out", "timed out",
             "DistBackendError", "NCCL error", "ncclInternalError")


def exit_reason(code, stderr, timeout):
    """One line: why a torchrun command failed - the backend's own diagnosis where its output
    has one (a timeout of the process group), else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    diagnosis = next((line for key in DIAGNOSES for line in lines if key in line), None)
    if code is None:
        return (f"no result after {timeout:.0f} s (a hang: a collective that not every rank "
                "entered?); every process was killed"
                + (f"; the backend said: {diagnosis[:300]}" if diagnosis else ""))
    return f"exited {code}: {(diagnosis or (lines[-1] if lines else '(no stderr)'))[:300]}"


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


class DeadlineSpent(RuntimeError):
    """The smoke's --deadline left no time for the next command."""


def smoke_training(nproc, work, toy, time_left):
    """30 steps of --comm=geofp8, resumed to 40, 30 of Muon, and 30 of each of RECOMMENDED;
    train.py itself compares the
    ranks' parameters (a checksum all-reduce every 10 steps: RankMismatch stops it). Each run
    gets time_left() seconds (DeadlineSpent where none is left). PASS: the resumed run reached
    step 40, the rotation's gain check measured, and each run's loss fell (a NaN loss does not)."""
    geo = ["--comm=geofp8", "--geo_warmup=5", "--geo_refresh=10", "--learning_rate=3e-3"]
    out = {}
    run = os.path.join(work, "geofp8")
    first = run_training(nproc, run, toy, [*geo, "--max_iters=30"], time_left())
    resumed = run_training(nproc, run, toy, [*geo, "--max_iters=40", "--resume"], time_left())
    out["geofp8"] = step_figures(first)
    summary = [r["summary"] for r in resumed if "summary" in r][-1]
    out["geofp8"].update(resumed_to=max(r["step"] for r in resumed if "dt_ms" in r),
                         resumed_last_loss=[r for r in resumed if "dt_ms" in r][-1]["loss"],
                         param_sha256=summary["param_sha256"][:16])
    muon = run_training(nproc, os.path.join(work, "muon"), toy,
                        ["--comm=fp8", "--optimizer=muon", "--max_iters=30", "--learning_rate=3e-3"],
                        time_left())
    out["muon"] = step_figures(muon)
    for name, flags in RECOMMENDED.items():    # what the README's table says to run
        records = run_training(nproc, os.path.join(work, name), toy,
                               [*flags, "--max_iters=30", "--learning_rate=3e-3", "--sync_debug"],
                               time_left())
        out[name] = {**step_figures(records), "gain_measured": gain_measured(records),
                     **reduce_counts(records)}
    out["host_syncs_per_step"] = ("inside the reduce, the picks' host waits (reduce_syncs_*) and "
                                  "kernel launches (reduce_launches_*, logged steps) on a GPU "
                                  "(train.py --sync_debug); the whole step's host reads: "
                                  "tests/test_train.py counts them on the CPU")
    ok = (out["geofp8"]["resumed_to"] == 40 and out["subspace"]["gain_measured"]
          and all(out[k]["last_loss"] < out[k]["first_loss"]
                  for k in ("geofp8", "muon", *RECOMMENDED))
          and all(within_sync_budget(out[k]) for k in RECOMMENDED))
    return ("PASS" if ok else "FAIL"), out


# the README's recommendation under Muon (the rotation on the two-stage FP8 collective, through
# refreshes and judged steps from step 5) and its mixed 4-bit + FP8 wire (the study's arm
# nvfp4-e4m3s2-ef1): both train in the smoke, on one GPU as on many
RECOMMENDED = {"subspace": ["--optimizer=muon", "--comm=subspace", "--geo_warmup=5",
                            "--geo_refresh=5"],
               "nvfp4-e4m3s2-ef1": ["--optimizer=muon", "--comm=fp8", "--fmt=nvfp4",
                                    "--stage2_fmt=e4m3", "--error_feedback",
                                    "--feedback_stages=1"]}


# host waits inside the reduce (train.py --sync_debug, CUDA only): none on most steps - an
# ordinary step has no reason to stop the host - and at most 4 on a step that refreshes or
# judges the geometry (one SVD call waits twice; the gain check reads its decisions once)
SYNC_BUDGET = {"median": 0, "max": 4}


def reduce_counts(records):
    """{"reduce_syncs_median", "reduce_syncs_max"} over the steps after the first (the warm-up's
    allocations), from the log's "reduce_syncs" records, and the same of "reduce_launches" (the
    kernels each reduce launched, by torch.profiler); {} where none was counted (no GPU)."""
    out = {}
    for key in ("reduce_syncs", "reduce_launches"):
        counts = sorted(r[key] for r in records
                        if r.get(key) is not None and r["step"] > 1)
        if counts:
            out.update({f"{key}_median": counts[len(counts) // 2], f"{key}_max": counts[-1]})
    return out


def within_sync_budget(figures):
    """SYNC_BUDGET held (or nothing counted: the CPU has no host waits to count)."""
    return ("reduce_syncs_max" not in figures
            or (figures["reduce_syncs_median"] <= SYNC_BUDGET["median"]
                and figures["reduce_syncs_max"] <= SYNC_BUDGET["max"]))


def gain_measured(records):
    """Did the gain check measure a candidate matrix (a finite gain in a geometry record)?"""
    return any(gain is not None for r in records if "geometry_at" in r
               for _, gain in r["coords"].values())


def describe(name, status, figures):
    """One line for a check: PASS/FAIL/SKIP, its name and its main figures."""
    if "why" in figures:
        return f"{status} {name}: {figures['why']}"
    if name == "env":           # (information, not a check)
        return (f"{status} env: torch {figures['torch']} | CUDA {figures['cuda']} | NCCL "
                f"{figures.get('nccl', '-')} | {figures['machine']} | {figures['device']}"
                + (f" (sm {figures['capability']})" if "capability" in figures else ""))
    if name == "codec":
        rates = " ".join(f"{k[:-9]} {v:.1f}" for k, v in figures.items() if k.endswith("_gb_per_s"))
        agree = {k: v for k, v in figures.items() if isinstance(v, bool)}
        wrong = [k for k, v in agree.items() if not v]
        compiled = any(k.endswith("compiled_equals_eager") for k in agree)
        return (f"{status} codec: {len(agree) - len(wrong)} of {len(agree)} byte comparisons "
                f"equal (device vs CPU, packed vs compress.quantize"
                f"{', compiled vs eager' if compiled else '; not compiled: --no-compile'})"
                + (f", NOT: {', '.join(wrong)}" if wrong else "") + f" | GB/s: {rates}")
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
        return (f"{status} ddp: max rel err vs plain DDP {worst(figures['rel_err_per_step']):.4f}, "
                f"{figures['geo_matrices']} geo matrices, same grads on every rank "
                f"{figures['same_grads_every_rank']}")
    if name == "fsdp":
        return f"{status} fsdp: max rel err vs fp32 " + ", ".join(
            f"{m} {worst(e):.4f}" for m, e in figures["rel_err_per_step"].items())
    if name == "train":
        g, m = figures["geofp8"], figures["muon"]
        return (f"{status} train: geofp8 loss {g['first_loss']:.3f} -> {g['last_loss']:.3f}, "
                f"resumed to {g['resumed_to']} ({g['resumed_last_loss']:.3f}), "
                f"{g['median_step_ms']:.0f} ms/step, slowest step {g['slowest_step']} "
                f"{g['slowest_step_ms']:.0f} ms | muon {m['first_loss']:.3f} -> "
                f"{m['last_loss']:.3f}, {m['median_step_ms']:.0f} ms/step"
                + "".join(f" | {k} {figures[k]['first_loss']:.3f} -> "
                          f"{figures[k]['last_loss']:.3f}, {figures[k]['median_step_ms']:.0f} "
                          "ms/step" + syncs_text(figures[k]) for k in RECOMMENDED if k in figures))
    return f"{status} {name}"


def syncs_text(figures):
    if "reduce_syncs_max" not in figures:
        return ""
    launches = (f", {figures['reduce_launches_median']} kernel launches a step (most "
                f"{figures['reduce_launches_max']})" if "reduce_launches_max" in figures else "")
    return (f", host waits in the reduce {figures['reduce_syncs_median']} a step (most "
            f"{figures['reduce_syncs_max']}; budget {SYNC_BUDGET['median']}/{SYNC_BUDGET['max']})"
            + launches)


CHECKS = ("codec", "collective", "fp8-sum", "ddp", "fsdp", "train")
DEADLINE_GPU, DEADLINE_CPU = 600, 1200     # seconds for the whole smoke (--deadline)


def coverage(results, nproc, cuda):
    """What this run did not test, in plain words: [line]. Every SKIP is listed with its reason,
    and where no two GPUs exchanged anything, the first line says that NCCL was not tested."""
    lines = []
    if not cuda:
        lines.append("NOT TESTED: NCCL and every GPU path - no GPU here: the exchange ran over gloo "
                     f"on {nproc} CPU ranks at toy size (the logic, not the node)")
    elif nproc < 2:
        lines.append("NOT TESTED: NCCL and the FP8 exchange (collective, fp8-sum, ddp, fsdp) - one "
                     "GPU, one rank: NCCL takes one GPU per rank, so nothing was exchanged; run "
                     "make gpu-smoke on a node with 2 or more GPUs")
    for name in CHECKS:
        if results.get(name, {}).get("status") == "SKIP":
            lines.append(f"NOT TESTED: {name} ({results[name]['why']})")
    return lines


def first_contact(args):
    """`make gpu-smoke`: the env line here, the rank checks under torchrun, the training runs
    as train.py; one line per check, what was not tested, the figures, a summary, smoke.json.
    The whole of it within --deadline seconds."""
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
    budget = args.deadline or (DEADLINE_GPU if cuda else DEADLINE_CPU)
    deadline = t_start + budget

    def time_left():
        """Seconds the next command may take: --timeout, or what is left of --deadline."""
        left = deadline - time.time()
        if left < 1:
            raise DeadlineSpent(f"not run: the smoke's {budget:.0f} s deadline was spent")
        return min(args.timeout, left)

    def report(name, status, figures):
        results[name] = {"status": status, **figures}
        lines.append(describe(name, status, figures))
        print(lines[-1], flush=True)

    report("env", "INFO", {**env_figures(device), "nproc": nproc})
    with tempfile.TemporaryDirectory(prefix="nanogeo-smoke-") as work:
        ranks_out = os.path.join(work, "ranks.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", "-m", "nanogeo.smoke", "--worker",
                   f"--worker_out={ranks_out}", f"--numel={args.numel}", f"--iters={args.iters}",
                   f"--pg_timeout={args.pg_timeout}",
                   "--compile" if args.compile else "--no-compile",
                   "--figures" if args.figures else "--no-figures"]
        root = os.path.dirname(os.path.abspath(compress.__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        timeout = time_left()
        code, _, err = run_bounded(command, root, timeout, env)
        ranks = {}
        if os.path.exists(ranks_out):
            with open(ranks_out) as f:
                ranks = json.load(f)
        for name in CHECKS[:-1]:
            figures = dict(ranks.get(name) or {"status": "FAIL", "why": "not run: torchrun "
                                               + exit_reason(code, err, timeout)})
            report(name, figures.pop("status"), figures)
        if args.train:
            try:
                report("train", *smoke_training(nproc, work, toy, time_left))
            except Exception as e:
                report("train", "FAIL", {"why": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
        else:
            report("train", "SKIP", {"why": "--no-train"})
    for line in coverage(results, nproc, cuda):
        print(line, flush=True)
    if "figures" in ranks:
        results["figures"] = ranks["figures"]
        print("figures (not checked; BENCHMARKS.md section 9):", flush=True)
        print("\n".join(ranks["figures"].get("markdown") or
                        [f"not measured: {ranks['figures'].get('error')}"]), flush=True)
    counts = {s: sum(results[name]["status"] == s for name in CHECKS) for s in ("PASS", "FAIL", "SKIP")}
    results["summary"] = {**counts, "seconds": round(time.time() - t_start, 1), "nproc": nproc,
                          "device": results["env"]["device"], "toy": toy,
                          "not_tested": coverage(results, nproc, cuda)}
    print(f"gpu-smoke: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} NOT "
          f"tested (skipped) | {nproc} x {results['env']['device']}{' (toy size)' if toy else ''} "
          f"| {results['summary']['seconds']:.0f}s" + (f" | {args.out}" if args.out else ""),
          flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if counts["FAIL"]:
        sys.exit(1)
    return results
