"""`make gpu-smoke` can fail (issue 50, item 5): every check of nanogeo.smoke is run with its
fault injected - corrupted bytes on one rank, a NaN, a rank that disagrees, a hang - and must say
FAIL (a PASS that cannot turn into FAIL is not a check); a one-GPU node's summary says that
NCCL and the FP8 exchange were not tested; the whole smoke keeps a deadline; the DDP check at
its GPU size and the GPU figures (item 7) run on the CPU at toy size."""
import contextlib
import datetime
import json
import math
import os
import time
import types
from unittest import mock

import pytest
import torch

import compress
from conftest import run_ranks
from nanogeo.smoke import launcher, ranks


# ---------------------------------------------------------------- helpers that run on gloo ranks

def perturb(tensors, value=None, scale=1.001):
    """Each tensor scaled by `scale`, or its first element set to `value` (NaN), in place."""
    for t in tensors:
        if value is None:
            t.mul_(scale)
        else:
            t.view(-1)[0] = value
    return tensors


@contextlib.contextmanager
def collective_fault(fault, rank):
    """The collective check's faults: one rank's means off by 0.1 % (well within the codec's
    bound: only the agreement can see it), a NaN in the second tensor's mean on every rank
    (the ranks agree; max() over the tensors would skip it), or one mean's first entry a bit
    off on every rank (as CUDA's multiplication by 1 / W made it: only the simulator sees it)."""
    from nanogeo.wire import collective
    real = collective.mean_over_ranks

    def faulty(tensors, fmt, *args, **kwargs):
        means, sent = real(tensors, fmt, *args, **kwargs)
        if fault == "one rank off" and rank == 1:
            perturb(means)
        if fault == "nan":
            perturb(means[1:2], value=math.nan)
        if fault == "last bit":
            first = means[0].view(-1)[:1]
            first.copy_(torch.nextafter(first, first + 1))
        return means, sent
    with mock.patch.object(collective, "mean_over_ranks", faulty if fault else real):
        yield


@contextlib.contextmanager
def fp8_sum_fault(fault, rank):
    """fp8-sum's faults: a NaN, one rank's means off, a saturated fraction that misses what the
    inputs make saturate (NCCL saturating half as often as its emulation)."""
    from nanogeo.wire import fp8sum
    real = fp8sum.all_reduce_fp8_sum

    def faulty(tensors, fmt, *args, **kwargs):
        means, sent, local, saturated = real(tensors, fmt, *args, **kwargs)
        if fault == "nan":
            perturb(means[1:2], value=math.nan)
        if fault == "one rank off" and rank == 1:
            perturb(means)
        if fault == "saturation":
            saturated = saturated / 2
        return means, sent, local, saturated
    with mock.patch.object(fp8sum, "all_reduce_fp8_sum", faulty):
        yield


@contextlib.contextmanager
def ddp_fault(fault, rank):
    """The DDP check's faults: the hook's mean 0.1 % off on one rank, or a NaN in it."""
    from nanogeo.parallel import ddp
    real = ddp.compress_hook

    def faulty(state, bucket):
        future = real(state, bucket)
        if fault == "one rank off" and rank == 1:
            perturb([future.value()])
        if fault == "nan":
            perturb([future.value()], value=math.nan)
        return future
    with mock.patch.object(ddp, "compress_hook", faulty):
        yield


@contextlib.contextmanager
def fsdp_fault(fault, rank):
    """The FSDP check's faults: one rank's reduce-scattered sums 50 % off, or a NaN in them."""
    from nanogeo.parallel import fsdp
    real = fsdp.exchange_and_sum

    def faulty(send, layout, group):
        totals = real(send, layout, group)
        if fault == "one rank off" and rank == 1:
            perturb(totals, scale=1.5)
        if fault == "nan":
            perturb(totals[:1], value=math.nan)
        return totals
    with mock.patch.object(fsdp, "exchange_and_sum", faulty):
        yield


CHECKS = {   # check -> (run it on a gloo rank, inject a fault, the faults)
    "collective": (lambda: ranks.smoke_collectives(torch.device("cpu"), 1), collective_fault,
                   ("one rank off", "nan", "last bit")),
    "fp8-sum": (lambda: ranks.check_fp8_sum(torch.device("cpu")), fp8_sum_fault,
                ("nan", "one rank off", "saturation")),
    "ddp": (lambda: ranks.smoke_ddp(torch.device("cpu"), toy=True), ddp_fault,
            ("one rank off", "nan")),
    "fsdp": (lambda: ranks.smoke_fsdp(torch.device("cpu"), toy=True), fsdp_fault,
             ("one rank off", "nan")),
}


def faults_rank(rank, world_size, check, out):
    """One check, clean and then with each of its faults: {fault or "none": status}."""
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    run, inject, faults = CHECKS[check]
    statuses = {}
    for fault in (None, *faults):
        with inject(fault, rank):
            try:
                statuses[fault or "none"] = run()[0]
            except Exception as e:      # the worker records a check that raises as a FAIL
                statuses[fault or "none"] = f"FAIL ({type(e).__name__})"
    with open(f"{out}.{rank}", "w") as f:
        json.dump(statuses, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("check", list(CHECKS))
def test_each_rank_check_fails_on_its_fault(tmp_path, check):
    """Clean, the check passes (fp8-sum on gloo: the emulation against itself); with a rank
    that disagrees, a NaN, or (fp8-sum) a saturation count that misses, it fails - on every
    rank."""
    out = str(tmp_path / "statuses")
    run_ranks(faults_rank, 2, check, out)
    for rank in (0, 1):
        statuses = json.load(open(f"{out}.{rank}"))
        assert statuses.pop("none") == "PASS"
        assert {f: s.split()[0] for f, s in statuses.items()} == {
            fault: "FAIL" for fault in CHECKS[check][2]}, (rank, statuses)


def test_fp8_sum_inputs_saturate_a_stated_fraction():
    """fp8-sum's inputs make a quarter of the first tensor's sums saturate (the emulation, at 2
    and 8 ranks, both formats) - a fraction the check can tell from 0, where the old 64 of 4096
    (0.016) sat inside its 0.05 tolerance."""
    from nanogeo.wire import fp8sum
    for world in (2, 8):
        everyone = [ranks.fp8_sum_inputs(r) for r in range(world)]
        for fmt in ("e5m2", "e4m3"):
            saturated = fp8sum.simulate_fp8_sum(everyone, fmt)[3]
            assert ranks.SATURATING <= saturated[0].item() <= ranks.SATURATING * 1.01


def test_codec_check_fails_on_its_faults(monkeypatch):
    """The codec check (one rank, in process): PASS clean; FAIL when the packed codec writes
    other bytes than compress.quantize (one byte), when the "compiled" kernels decode other
    values than eager (a stand-in for a compile with Triton's approximate division), and when
    the codec decodes a NaN."""
    from nanogeo.wire import kernels, packing
    cpu = torch.device("cpu")
    assert ranks.smoke_codec(cpu, 1e4, 1, with_compiled=False)[0] == "PASS"
    real_pack, real_compile = packing.pack_groups, kernels.compile_hot_path

    def one_byte_off(groups, fmt, *args, **kwargs):
        wire = real_pack(groups, fmt, *args, **kwargs).clone()
        wire[-1] ^= 1
        return wire
    with monkeypatch.context() as m:
        m.setattr(packing, "pack_groups", one_byte_off)
        status, figures = ranks.smoke_codec(cpu, 1e4, 1, with_compiled=False)
        assert status == "FAIL" and not figures["e4m3_packed_equals_quantize"]

    def approximate_compile(enabled=True):
        real_compile(False)
        if enabled:
            kernels.KERNELS["decode_packed"] = lambda wire, block, dtype: (
                kernels.decode_packed(wire, block, dtype) * (1 + 2 ** -22))
    with monkeypatch.context() as m:
        m.setattr(kernels, "compile_hot_path", approximate_compile)
        status, figures = ranks.smoke_codec(cpu, 1e4, 1, with_compiled=True)
        assert status == "FAIL" and not figures["e4m3_compiled_equals_eager"]
    assert not kernels.compiled()
    with monkeypatch.context() as m:           # e4m3's decoder in compress.py's registry
        encode, real_decode = compress.BYTE_CODECS["e4m3"]
        m.setitem(compress.BYTE_CODECS, "e4m3",
                  (encode, lambda *args, **kwargs: real_decode(*args, **kwargs) * math.nan))
        status, figures = ranks.smoke_codec(cpu, 1e4, 1, with_compiled=False)
        assert status == "FAIL" and not figures["e4m3_device_equals_cpu"]


def records(losses, resumed_to=40, first_step=0):
    """A train.py log.jsonl: one record per step, and the summary."""
    steps = [{"step": first_step + k + 1, "loss": loss, "dt_ms": 10.0}
             for k, loss in enumerate(losses)]
    return steps + [{"summary": {"param_sha256": "0" * 64}}] if resumed_to else steps


@pytest.mark.parametrize("fault", [None, "nan loss", "loss rises", "resume stops short",
                                   "mixed wire diverges", "rotation never judged",
                                   "host waits in ordinary steps"])
def test_training_check_fails_on_its_fault(monkeypatch, tmp_path, fault):
    """The train check on stand-in train.py logs: PASS when the loss falls and the resumed run
    reaches step 40; FAIL on a NaN loss, a loss that rises, a resume that stops short, the mixed
    wire's loss ending infinite, a rotation run whose gain check never measured, a reduce that
    waits for the host on ordinary steps (over the sync budget)."""
    falling = [3.0 - 0.05 * k for k in range(30)]
    judged = [{"geometry_at": 10, "coords": {"w": ["geo", 1.3]}}]
    runs = {"first": records(falling), "resumed": records([1.4] * 10, first_step=30),
            "muon": records(falling), "subspace": records(falling) + judged,
            "nvfp4-e4m3s2-ef1": records(falling)}
    if fault == "nan loss":
        runs["muon"] = records(falling[:-1] + [math.nan])
    if fault == "loss rises":
        runs["first"] = records(falling[::-1])
    if fault == "resume stops short":
        runs["resumed"] = records([1.4] * 5, first_step=30)
    if fault == "mixed wire diverges":
        runs["nvfp4-e4m3s2-ef1"] = records(falling[:-1] + [math.inf])
    if fault == "rotation never judged":
        runs["subspace"] = records(falling)
    if fault == "host waits in ordinary steps":     # --sync_debug's counts, as a GPU logs them
        runs["subspace"] += [{"step": k, "reduce_syncs": 1} for k in range(2, 31)]
    if fault is None:
        runs["subspace"] += [{"step": k, "reduce_syncs": 2 if k % 5 == 0 else 0}
                             for k in range(2, 31)]
    order = iter(["first", "resumed", "muon", "subspace", "nvfp4-e4m3s2-ef1"])
    monkeypatch.setattr(launcher, "run_training", lambda *args: runs[next(order)])
    status, _ = launcher.smoke_training(2, str(tmp_path), True, lambda: 100)
    assert status == ("PASS" if fault is None else "FAIL")


# ---------------------------------------------------------------- a hang: the process group's timeout

def hang_rank(rank, world_size, out):
    """The smoke's worker with the collective check only, and a process group timeout of 5 s;
    rank 1 never enters the collective: it waits until rank 0 has recorded the check's end."""
    def hung(device, scale):
        for _ in range(600):            # (a bound, should rank 0 never record anything)
            if os.path.exists(out) and "collective" in json.load(open(out)):
                break
            time.sleep(0.2)
        return "PASS", {}
    check = ranks.smoke_collectives if rank == 0 else hung
    args = types.SimpleNamespace(worker_out=out, pg_timeout=5, figures=False)
    with mock.patch.object(ranks, "rank_checks",
                           lambda args, device, toy: [("collective", lambda: check(device, 1))]):
        try:
            ranks.worker(args)
        except RuntimeError:
            pass                        # the timeout on rank 0; rank 1's barrier without it


def test_a_hung_collective_fails_with_the_backends_diagnosis(tmp_path):
    """A rank that never enters a collective: after --pg_timeout the other rank's wait ends with
    the backend's own error (gloo: "Timed out ..."; NCCL's watchdog names the collective), and
    the check is a FAIL that quotes it - not a smoke test that waits for its outer deadline."""
    out = str(tmp_path / "ranks.json")
    run_ranks(hang_rank, 2, out)
    result = json.load(open(out))["collective"]
    assert result["status"] == "FAIL" and "timed out" in result["why"].lower(), result


def test_exit_reason_quotes_nccls_diagnosis():
    """Of a torchrun's stderr, the line in which NCCL's watchdog reports the timeout, not the
    last line (torchrun's own summary)."""
    stderr = ("[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation "
              "timeout: WorkNCCL(SeqNum=7, OpType=ALLTOALL_BASE, NumelIn=4096, NumelOut=4096, "
              "Timeout(ms)=120000) ran for 120012 milliseconds before timing out.\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
              "  time      : 2027-01-01_00:00:00\n")
    line = launcher.exit_reason(1, stderr, 300)
    assert "Watchdog caught collective operation timeout" in line and "ALLTOALL_BASE" in line
    assert "Watchdog" in launcher.exit_reason(None, stderr, 300)
    assert launcher.exit_reason(1, "a\nlast line\n", 300) == "exited 1: last line"


# ---------------------------------------------------------------- the launcher: deadline, one GPU

class FakeClock:
    """time.time for the launcher, moved on by the stand-in commands: no test waits."""

    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now


def smoke_args(*extra):
    """make gpu-smoke's arguments as its command line parses them."""
    from nanogeo.smoke import cli
    return cli.make_parser().parse_args(["--nproc=2", *extra])


def test_the_whole_smoke_keeps_its_deadline(monkeypatch, tmp_path, capsys):
    """Every command hangs until it is killed: the commands' timeouts add up to no more than
    --deadline, and what finds no time left is a FAIL saying so (the old launcher gave each
    of its four torchruns 480 s)."""
    clock, timeouts = FakeClock(), []

    def hung_command(command, cwd, timeout, env=None):
        timeouts.append(timeout)
        clock.now += timeout
        return None, "", ""
    monkeypatch.setattr(launcher, "time", types.SimpleNamespace(time=clock.time))
    monkeypatch.setattr(launcher, "run_bounded", hung_command)
    with pytest.raises(SystemExit) as stop:
        launcher.first_contact(smoke_args("--deadline=600", f"--out={tmp_path}/smoke.json",
                                          "--no-compile"))
    assert stop.value.code == 1
    assert sum(timeouts) <= 600 and len(timeouts) == 2, timeouts
    result = json.load(open(tmp_path / "smoke.json"))
    assert result["collective"]["status"] == "FAIL" and "no result after" in result["collective"]["why"]
    assert result["train"]["status"] == "FAIL"
    assert result["summary"]["PASS"] == 0


def test_one_gpu_summary_says_what_was_not_tested(monkeypatch, tmp_path, capsys):
    """A one-GPU node (faked: CUDA available, one device; the ranks' results as a one-rank worker
    writes them): the exchange checks are SKIP, none counted as passed, and the summary says
    plainly that NCCL and the FP8 exchange were NOT tested (the old launcher printed "2 passed"
    and nothing more)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launcher, "env_figures", lambda device: {
        "torch": torch.__version__, "cuda": "13.0", "nccl": "2.28.3", "machine": "aarch64",
        "device": "NVIDIA GH200 480GB", "capability": "9.0"})

    def one_rank_worker(command, cwd, timeout, env=None):
        out = next(a.split("=", 1)[1] for a in command if a.startswith("--worker_out="))
        result = {"codec": {"status": "PASS", "e4m3_device_equals_cpu": True}}
        result.update({name: {"status": "SKIP", "why": ranks.ONE_RANK}
                       for name in ("collective", "fp8-sum", "ddp", "fsdp")})
        with open(out, "w") as f:
            json.dump(result, f)
        return 0, "", ""
    monkeypatch.setattr(launcher, "run_bounded", one_rank_worker)
    result = launcher.first_contact(smoke_args("--no-train", f"--out={tmp_path}/smoke.json"))
    printed = capsys.readouterr().out
    assert "NOT TESTED: NCCL and the FP8 exchange" in printed, printed
    assert "gpu-smoke: 1 passed, 0 failed, 5 NOT tested" in printed, printed
    assert result["summary"]["PASS"] == 1 and result["summary"]["not_tested"]
    assert "INFO env" in printed and "PASS env" not in printed


# ---------------------------------------------------------------- GPU sizes and figures, on the CPU

def gpu_sized_ddp_rank(rank, world_size, out):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    status, figures = ranks.smoke_ddp(torch.device("cpu"), toy=False)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"status": status, **figures}, f)
    dist.destroy_process_group()


def test_ddp_check_at_its_gpu_size_passes_on_the_cpu(tmp_path):
    """The DDP check as a GPU node runs it (width 256, 64 tokens), once, on 2 gloo ranks: it
    passes, with matrices in rotated coordinates."""
    out = str(tmp_path / "ddp")
    run_ranks(gpu_sized_ddp_rank, 2, out)
    for rank in (0, 1):
        r = json.load(open(f"{out}.{rank}"))
        assert r["status"] == "PASS" and r["geo_matrices"] > 0, r
        assert ranks.worst(r["rel_err_per_step"]) < 0.05 and r["same_grads_every_rank"]


def figures_rank(rank, world_size, out):
    import torch.distributed as dist
    from nanogeo.smoke import figures
    dist.init_process_group("gloo")
    result = figures.gpu_figures(torch.device("cpu"), 1, sizes=(0.01, 0.02), preset="char-study",
                                 batch_size=2, block_size=32)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_gpu_figures_run_at_toy_size_on_gloo(tmp_path):
    """The figures a GPU run prints (item 7), through the same functions at toy size on 2 gloo
    ranks: every collective against bf16 at each size, every step's comm against bf16, and the
    markdown rows BENCHMARKS.md takes."""
    out = str(tmp_path / "figures")
    run_ranks(figures_rank, 2, out)
    result = json.load(open(f"{out}.0"))
    exchange = result["exchange"]
    assert [(r["million_elements"], r["method"]) for r in exchange] == [
        (size, method) for size in (0.01, 0.02) for method in ("bf16", "fp8", "nvfp4")]
    for r in exchange:
        assert r["ms"] > 0 and r["bus_gb_per_s"] > 0 and r["world"] == 2
        assert (r["vs_bf16"] == 1.0) == (r["method"] == "bf16")
    bf16 = {r["million_elements"]: r["bytes_sent"] for r in exchange if r["method"] == "bf16"}
    for r in exchange:       # the wire: ~0.52x (e4m3) and ~0.3x (NVFP4) of bf16's, plus headers
        assert r["bytes_sent"] < {"bf16": 1.01, "fp8": 0.6, "nvfp4": 0.4}[r["method"]] * bf16[
            r["million_elements"]]
    assert [r["comm"] for r in result["step"]] == ["bf16", "fp8", "subspace"]
    assert all(r["ms"] > 0 and r["peak_memory_gib"] is None for r in result["step"])
    table = result["markdown"]
    assert sum(line.startswith("| two-stage") for line in table) == 4
    assert sum(line.startswith("| char-study") for line in table) == 3


# ---------------------------------------------------------------- the fault matrix (BENCHMARKS §19)

def codec_faults():
    """{fault: status} of the codec check (one rank, in process), without pytest."""
    from nanogeo.wire import packing
    cpu, statuses = torch.device("cpu"), {}
    real_pack, real_decode = packing.pack_groups, compress.fp8_decode

    def one_byte_off(groups, fmt, *args, **kwargs):
        wire = real_pack(groups, fmt, *args, **kwargs).clone()
        wire[-1] ^= 1
        return wire
    for fault, module, name, replacement in (
            ("none", packing, "pack_groups", real_pack),
            ("one byte off", packing, "pack_groups", one_byte_off),
            ("nan", compress, "fp8_decode",
             lambda codes, scale, dtype: real_decode(codes, scale, dtype) * math.nan)):
        with mock.patch.object(module, name, replacement):
            statuses[fault] = ranks.smoke_codec(cpu, 1e4, 1, with_compiled=False)[0]
    return statuses


if __name__ == "__main__":
    # `python tests/test_smoke.py`: each check's status, clean and with each fault, for the
    # nanogeo of this checkout (copy this file into an older checkout to see its statuses)
    import sys
    import tempfile
    print("codec", json.dumps(codec_faults()), flush=True)
    with tempfile.TemporaryDirectory() as work:
        for check in CHECKS:
            out = os.path.join(work, check)
            try:
                run_ranks(faults_rank, 2, check, out)
                print(check, open(f"{out}.0").read(), flush=True)
            except Exception as e:      # a check that does not exist in this checkout
                print(check, f"cannot run: {type(e).__name__}", file=sys.stderr, flush=True)


def test_host_waits_are_counted_under_sync_debug_mode(monkeypatch):
    """runtime.counting_syncs: torch.cuda's sync debug mode "warn" turned on for the block and off
    after it, each synchronizing call's warning counted (stand-ins: the CPU has no CUDA syncs);
    not enabled, nothing is counted and the mode is never touched."""
    import warnings
    from nanogeo.run import runtime
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with runtime.counting_syncs(True) as syncs:
        warnings.warn(f"an op {runtime.SYNC_WARNING}")
        warnings.warn("something else")
        warnings.warn(f"an op {runtime.SYNC_WARNING}")
    assert syncs == [2] and modes == ["warn", 0]
    with runtime.counting_syncs(False) as syncs:
        warnings.warn(f"an op {runtime.SYNC_WARNING}")
    assert syncs == [] and modes == ["warn", 0]


def test_kernel_launches_are_counted_from_the_profile(monkeypatch):
    """runtime.counting_launches: the CUDA launch calls among a profile's events (stand-ins: the
    CPU launches no kernel), and the smoke's per-step figures of them beside the host waits."""
    import types
    from nanogeo.run import runtime
    from nanogeo.smoke import launcher
    events = [types.SimpleNamespace(name=n) for n in
              ("cudaLaunchKernel", "aten::mm", "cuLaunchKernel", "cudaMemcpyAsync",
               "cudaLaunchKernelExC")]
    assert runtime.launches_in(events) == 3
    profile = types.SimpleNamespace(events=lambda: events)
    monkeypatch.setattr(torch.profiler, "profile",
                        lambda activities: type("P", (), {"__enter__": lambda self: profile,
                                                          "__exit__": lambda self, *a: False})())
    with runtime.counting_launches(True) as launches:
        pass
    assert launches == [3]
    with runtime.counting_launches(False) as launches:
        pass
    assert launches == []
    monkeypatch.undo()          # the real profiler: a CPU matmul launches no CUDA kernel
    with runtime.counting_launches(True) as launches:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert launches == [0]
    records = [{"step": k, "reduce_syncs": 0, "reduce_launches": 100 + k} for k in range(1, 6)]
    assert launcher.reduce_counts(records) == {"reduce_syncs_median": 0, "reduce_syncs_max": 0,
                                              "reduce_launches_median": 104,
                                              "reduce_launches_max": 105}


def test_sync_debug_counts_nothing_on_the_cpu(tiny_corpus, tmp_path):
    """train.py --sync_debug on the CPU trains as without it and logs no count (no CUDA)."""
    import train
    args = [f"--data_dir={tiny_corpus}", "--preset=char-study", "--optimizer=muon",
            "--comm=subspace", "--simulate_workers=2", "--max_iters=3", "--eval_iters=1",
            "--log_interval=1", "--device=cpu"]
    plain = train.train(train.parse_config([*args, f"--out_dir={tmp_path / 'plain'}"]))
    debug = train.train(train.parse_config([*args, f"--out_dir={tmp_path / 'debug'}",
                                            "--sync_debug"]))
    assert plain["param_sha256"] == debug["param_sha256"]
    assert not any("reduce_syncs" in line for line in open(tmp_path / "debug" / "log.jsonl"))
