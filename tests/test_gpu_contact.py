"""First contact with a GPU, proven on the CPU (issue 43): a CPU-only torch on a GPU node stops
with one line, the CPU suite stays on the CPU, the benchmark timer waits for the device, the
compiled codec does not recompile per bucket size, evaluation keeps the log-probabilities on the
device, GQA without copies, the old import path, and `make gpu-smoke` on 2 CPU ranks."""
import json
import os
import shutil
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import compress
import model as model_lib
from conftest import ROOT, run_ranks

GH200_LIST = "GPU 0: NVIDIA GH200 480GB (UUID: GPU-00000000-0000-0000-0000-000000000000)"


def fake_gpu_node(tmp_path):
    """The environment of a GH200 node whose torch is a CPU-only build: an `nvidia-smi` on PATH
    that lists one GPU (and prints a compute capability, as the Makefile asks), GPUs not hidden."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n  -L) echo '" + GH200_LIST + "';;\n"
                   "  *) echo 9.0;;\nesac\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def one_line_error(result, *words):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# ---------------------------------------------------------------- 1. silent CPU on a GH200

def test_cpu_only_torch_on_a_gpu_node_stops_with_one_line(tmp_path, tiny_corpus):
    """--device=auto (train.py's default), the smoke tool (both modes) and the Makefile's check
    before torchrun stop with one line naming the fix; --device=cpu still trains on purpose."""
    assert not torch.cuda.is_available()
    env = fake_gpu_node(tmp_path)
    run = dict(cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    args = ["--preset=char-study", f"--data_dir={tiny_corpus}", "--max_iters=2",
            "--batch_size=2", "--block_size=16", "--eval_iters=1", "--final_evals=1",
            f"--out_dir={tmp_path}/out"]
    line = one_line_error(subprocess.run([sys.executable, "train.py", *args], **run),
                          "NVIDIA GPU", "CPU-only", "PIP_ARGS", "download.pytorch.org/whl/cu",
                          "docs/guide.md", "--device=cpu")
    assert line.startswith("train.py: error:")
    for argv in (["--nproc=2"], ["--preset=cpu-tiny", "--numel=1000", "--iters=1"]):
        one_line_error(subprocess.run([sys.executable, "-m", "nanogeo.smoke", *argv], **run),
                       "CPU-only", "PIP_ARGS")
    # on purpose: the CPU
    cpu = subprocess.run([sys.executable, "train.py", *args, "--device=cpu"], **run)
    assert cpu.returncode == 0, cpu.stderr[-2000:]
    assert "device cpu" in cpu.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_makefile_checks_the_torch_build_before_starting_ranks(tmp_path):
    """`make train` and `make gpu-smoke` run the check before torchrun (the dry run's order), and
    the check itself stops with the one line; PIP_ARGS reaches pip."""
    env = fake_gpu_node(tmp_path)
    bin_dir = os.path.dirname(sys.executable)
    check = subprocess.run(["make", "-s", "device-check", f"BIN={bin_dir}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode != 0
    assert [line for line in check.stderr.splitlines() if "error:" in line and "PIP_ARGS" in line]
    for target in ("train", "gpu-smoke"):
        dry = subprocess.run(["make", "-n", "-W", "pyproject.toml", target,
                              f"VENV={tmp_path}/venv", "PIP_ARGS=--index-url https://example/whl"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        out = dry.stdout
        assert "pip install -q --index-url https://example/whl" in out, out
        assert out.index("-m nanogeo.run.runtime") < out.index(
            "torchrun" if target == "train" else "-m nanogeo.smoke"), out


def test_device_node_counts_and_hidden_gpus(tmp_path, monkeypatch):
    """/dev/nvidia0 counts as a visible GPU when nvidia-smi is missing; an empty
    CUDA_VISIBLE_DEVICES hides the GPUs on purpose (the CPU suite's pin); --device=cpu and
    --device=auto then take the CPU."""
    from nanogeo.run import runtime
    from nanogeo.run.config import ConfigError
    node = tmp_path / "nvidia0"
    node.write_text("")
    monkeypatch.setattr(runtime, "NVIDIA_DEVICE_FILE", str(node))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert runtime.visible_gpus() == 1
    assert "CPU-only" in runtime.cuda_build_missing()
    with pytest.raises(ConfigError, match="install a CUDA build of torch"):
        runtime.setup_distributed(types.SimpleNamespace(device="auto"))
    with pytest.raises(ConfigError, match="install a CUDA build of torch"):
        runtime.setup_distributed(types.SimpleNamespace(device="cuda"))
    monkeypatch.delenv("RANK", raising=False)
    assert runtime.setup_distributed(types.SimpleNamespace(device="cpu"))[3].type == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runtime.visible_gpus() == 0 and runtime.cuda_build_missing() is None
    assert runtime.setup_distributed(types.SimpleNamespace(device="auto"))[3].type == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(runtime, "NVIDIA_DEVICE_FILE", str(tmp_path / "none"))
    assert runtime.visible_gpus() == 0


# ---------------------------------------------------------------- 2. the suite on the CPU

def test_cpu_suite_is_pinned_to_the_cpu():
    """conftest hides CUDA from this session and every process it starts (run_ranks' ranks set
    LOCAL_RANK; with a GPU visible, rank 1 would ask for GPU 1); train.py's test runs name
    --device=cpu; the GPU twins are deselected unless `pytest -m gpu`."""
    from test_train import tiny_args
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert "--device=cpu" in tiny_args("corpus", "out")
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", "tests/test_gpu.py"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert "deselected" in listed.stdout and "::" not in listed.stdout, listed.stdout[-2000:]
    marked = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                             "-p", "no:cacheprovider", "tests/test_gpu.py"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert "tests/test_gpu.py::" in marked.stdout, marked.stdout[-2000:]


# ---------------------------------------------------------------- 7. timers wait for the device

def test_stage_timer_synchronizes_the_device(monkeypatch):
    from nanogeo.lab import bench
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    timer = bench.StageTimer(device="cuda:0")
    with timer.stage("quantize"):
        pass
    assert calls == [torch.device("cuda:0")] * 2 and "quantize" in timer.seconds


def timed_collective_rank(rank, world_size, out):
    """time_collective on gloo ranks, with every clock read and device sync of bench logged."""
    import torch.distributed as dist
    from nanogeo.lab import bench
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    events = []
    real_clock = time.perf_counter
    bench.time = types.SimpleNamespace(perf_counter=lambda: events.append("clock") or real_clock(),
                                       time=time.time)
    bench.synchronize = lambda device: events.append("sync")
    bench.time_collective([0.005], 2, ["fp32", "bf16", "fp8"], device="cpu")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(events, f)
    dist.destroy_process_group()


def test_collective_timer_reads_the_clock_after_a_device_sync(tmp_path):
    """Every clock read of the collective benchmark (the fp32/bf16 baselines' included) comes
    right after a device synchronisation: kernels, not launches, are timed."""
    out = str(tmp_path / "events.json")
    run_ranks(timed_collective_rank, 2, out)
    events = json.load(open(f"{out}.0"))
    clocks = [k for k, e in enumerate(events) if e == "clock"]
    assert len(clocks) >= 2 * 3 * 7
    assert all(k > 0 and events[k - 1] == "sync" for k in clocks), events


# ---------------------------------------------------------------- 9. smaller

def test_compiled_codec_compiles_once_for_many_bucket_sizes(monkeypatch):
    """70 group counts (a DDP model's bucket sizes and more than dynamo's recompile limit of 64):
    a handful of compiles, not one per size, and the bytes of eager for every size. A counting
    backend stands in for inductor (same dynamo tracing and guards, no code generation)."""
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounter
    from nanogeo.wire import kernels, packing
    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter))
    monkeypatch.setattr(kernels, "COMPILED", {})
    dynamo.reset()
    g = torch.Generator().manual_seed(0)
    try:
        for groups in range(2, 72):
            x = torch.randn(groups * 128 - 5, generator=g) * 10 ** (groups % 5 - 2)
            for fmt in ("e4m3", "e5m2") if groups < 6 else ("e4m3",):
                wires = []
                for compiled in (True, False):
                    kernels.compile_hot_path(compiled)
                    wire = packing.pack_groups(compress.scale_groups(x, 128), fmt)
                    wires.append((wire, packing.unpack_groups(wire, 128, fmt)))
                assert torch.equal(wires[0][0], wires[1][0]) and torch.equal(wires[0][1], wires[1][1])
    finally:
        kernels.compile_hot_path(False)
        dynamo.reset()
    assert counter.frame_count <= 6, counter.frame_count


def test_evaluation_keeps_log_probabilities_on_the_device(monkeypatch):
    """score_requests moves (B, T) numbers to the host, never the (B, T, vocab) log-probabilities,
    and scores as before (log-likelihood and greedy match of every request)."""
    from nanogeo.run import eval as ev
    from prepare_data import get_tokenizer
    torch.manual_seed(0)
    net = model_lib.Llama(model_lib.ModelConfig(block_size=32, n_layer=1, n_embd=32, n_head=2,
                                                n_kv_head=1)).eval()
    enc = get_tokenizer()
    requests = [("Goal: boil water.", " Use a kettle."), ("Cats", " purr."), ("To open a jar,", " twist"),
                ("A", " b c d e f g h")]
    moved, real_cpu = [], torch.Tensor.cpu

    def cpu(t, *a, **k):
        moved.append(tuple(t.shape))
        return real_cpu(t, *a, **k)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    scores = ev.score_requests(net, enc, requests, batch_size=3)
    monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
    assert moved and all(s[-1] != net.config.vocab_size for s in moved), moved
    for (context, continuation), (ll, greedy) in zip(requests, scores):
        ctx, cont = enc.encode_ordinary(context), enc.encode_ordinary(continuation)
        ids = torch.tensor(ctx + cont)
        with torch.no_grad():
            logp = F.log_softmax(net(ids[None, :-1])[0][0].float(), -1)[len(ctx) - 1:]
        assert ll == pytest.approx(logp.gather(1, torch.tensor(cont)[:, None]).sum().item(), abs=1e-4)
        assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())


@pytest.mark.parametrize("preset", ["char-study", "cpu-tiny", "llama-300m"])
def test_sdpa_enable_gqa_is_bit_equal_to_repeated_heads(preset):
    """At each preset's head shapes: SDPA's enable_gqa gives the repeated-heads forward bit for
    bit on the CPU; its backward adds the shared heads' gradients in another order (equal to
    rounding), which is why model.py keeps the copy on the CPU."""
    cfg = model_lib.model_config(preset)
    hs, T = cfg.n_embd // cfg.n_head, min(cfg.block_size, 64)
    repeat = cfg.n_head // cfg.n_kv_head
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, cfg.n_head, T, hs, generator=g, requires_grad=True)
    k, v = (torch.randn(2, cfg.n_kv_head, T, hs, generator=g, requires_grad=True) for _ in "kv")
    copied = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1),
                                            v.repeat_interleave(repeat, 1), is_causal=True)
    shared = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(copied, shared)
    dy = torch.randn(copied.shape, generator=g)
    for a, b in zip(torch.autograd.grad(copied, (q, k, v), dy), torch.autograd.grad(shared, (q, k, v), dy)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_attention_shares_kv_heads_in_the_kernel_off_the_cpu(monkeypatch):
    """Off the CPU (here the meta device stands for a GPU) the attention hands SDPA the n_kv_head
    K/V heads with enable_gqa, no repeated copy; on the CPU the copy stays (the bits of every
    recorded CPU run)."""
    cfg = model_lib.model_config("cpu-tiny", block_size=16)
    seen, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((k.shape[1], kw.get("enable_gqa", False)))
        return real(q, k, v, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cos, sin = model_lib.rotary_table(cfg.n_embd // cfg.n_head, 16, cfg.rope_theta)
    for device in ("meta", "cpu"):
        with torch.device(device):
            attention = model_lib.Attention(cfg)
            x = torch.randn(2, 16, cfg.n_embd)
        attention(x, cos.to(device), sin.to(device))
    assert seen == [(cfg.n_kv_head, True), (cfg.n_head, False)], seen


# ---------------------------------------------------------------- 10. the old import path

def test_old_import_path_warns_and_gives_the_same_module():
    code = """
import os, warnings
import nanogeo
assert not os.path.exists(os.path.join(os.path.dirname(nanogeo.__file__), "dist"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from nanogeo.dist.ddp import CompressHookState
    import nanogeo.dist.fsdp as old_fsdp
import nanogeo.parallel.ddp, nanogeo.parallel.fsdp
assert CompressHookState is nanogeo.parallel.ddp.CompressHookState
assert old_fsdp is nanogeo.parallel.fsdp
messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
assert any("nanogeo.dist.ddp" in m and "nanogeo.parallel.ddp" in m for m in messages), messages
assert all(w.filename.endswith("<string>") for w in caught if w.category is DeprecationWarning)
try:
    import nanogeo.dist.nothing
except ModuleNotFoundError as e:
    assert "nanogeo.parallel.nothing" in str(e)
else:
    raise AssertionError("a missing module imported")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ---------------------------------------------------------------- 8. make gpu-smoke on the CPU

def test_gpu_smoke_on_two_cpu_ranks(tmp_path):
    """`make gpu-smoke`'s tool without a GPU: 2 gloo ranks at toy size, one line per check and a
    summary, smoke.json with every check. (The training check and the compiled codec are left
    to .ci/run's `make gpu-smoke`: they cost a minute more.)"""
    out = tmp_path / "smoke.json"
    done = subprocess.run([sys.executable, "-m", "nanogeo.smoke", "--nproc=2", "--iters=1",
                           "--no-compile", "--no-train", f"--out={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:7]] == [
        "INFO env", "PASS codec", "PASS collective", "SKIP fp8-sum", "PASS ddp", "PASS fsdp",
        "SKIP train"], lines
    assert lines[7].startswith("NOT TESTED: NCCL and every GPU path - no GPU here"), lines
    assert [line.split(" (")[0] for line in lines[8:-1]] == ["NOT TESTED: fp8-sum",
                                                             "NOT TESTED: train"], lines
    assert lines[-1].startswith("gpu-smoke: 4 passed, 0 failed, 2 NOT tested (skipped) | "
                                "2 x cpu (toy size)")
    result = json.loads(out.read_text())
    for fmt in ("e4m3", "e5m2", "nvfp4"):
        r = result["collective"][fmt]
        assert r["same_bytes_every_rank"] and r["equals_simulator"] and 0 < r["error_vs_bound"] <= 1
        assert result["codec"][f"{fmt}_eager_gb_per_s"] > 0
    assert result["ddp"]["same_grads_every_rank"] and result["env"]["machine"]
    assert result["codec"]["e4m3_device_equals_cpu"] and result["codec"]["e5m2_packed_equals_quantize"]
    assert result["summary"]["FAIL"] == 0 and "figures" not in result     # (CUDA only)


def test_smoke_kills_a_hung_torchrun_with_its_ranks(tmp_path):
    """make gpu-smoke runs torchrun in a session of its own: a command that outlives its timeout
    (a hung collective) is reported as such, and every process it started is killed - no rank
    left holding a GPU, no traceback instead of the summary."""
    from nanogeo import smoke
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    code, _, err = smoke.run_bounded([sys.executable, "-c", script], str(tmp_path), timeout=20)
    assert code is None
    assert "a hang" in smoke.exit_reason(code, err, 20)
    child = int(pid_file.read_text())
    for _ in range(100):            # SIGKILL is delivered at once; wait for the reaping
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":    # killed, not yet reaped
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the command's child {child} outlived the timeout")


# ---------------------------------------------------------------- issue 50: first contact, again

def test_compiled_codec_divides_as_eager_does_whenever_it_is_compiled(monkeypatch):
    """Inductor's Triton code divides approximately unless eager_numerics.division_rounding is
    set; the C++ backend divides exactly, so no CPU run can see the difference in the bytes.
    What a CPU can see: the setting in force whenever inductor generates the codec's code (a
    spy on its code generation reads the config), every op of the compiled graphs among the
    audited EXACT_OPS (a new op gets audited before it ships), the bytes of eager - and the
    setting NOT in force for another torch.compile after it (the model's compile keeps
    Triton's faster division)."""
    import torch._dynamo as dynamo
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor import config as inductor_config
    from nanogeo.smoke.ranks import wire_round_trip
    from nanogeo.wire import kernels
    seen, real = [], compile_fx.fx_codegen_and_compile

    def spy(gm, *args, **kwargs):
        ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        seen.append((inductor_config.eager_numerics.division_rounding, ops))
        return real(gm, *args, **kwargs)
    monkeypatch.setattr(compile_fx, "fx_codegen_and_compile", spy)
    monkeypatch.setattr(kernels, "COMPILED", {})
    dynamo.reset()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-3
    try:
        # (the config modules' own patch: monkeypatch's undo would delete the entry, and every
        # later torch.compile in this process would fail on the missing key)
        with inductor_config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            wires = []
            for compiled in (False, True):     # stage 1's wire, its decode, stage 2 at W = 3
                kernels.compile_hot_path(compiled)
                wires.append(wire_round_trip(x, "e4m3"))
            kernels.compile_hot_path(False)
            codec_graphs = len(seen)
            torch.compile(lambda a, b: a / b)(x, x + 2)         # a model's compile, after it
    finally:
        kernels.compile_hot_path(False)
        dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(*wires))
    assert codec_graphs == 3, seen                                  # encode, decode, average
    for rounding, ops in seen[:codec_graphs]:
        assert rounding, "the codec was compiled with Triton's approximate division"
        assert ops <= kernels.EXACT_OPS, ops - kernels.EXACT_OPS
    assert {"aten.reciprocal.default", "aten.div.Tensor"} <= set().union(*(o for _, o in seen[:3]))
    assert [r for r, _ in seen[codec_graphs:]] == [False]           # not leaked to the model's
    assert not inductor_config.eager_numerics.division_rounding


class FakeCudaBatch:
    """Stands in for torch.Tensor.pin_memory and .to on a CPU-only torch: records each call and
    keeps the data on the CPU, so get_batch can be given a CUDA device."""

    def __init__(self, monkeypatch):
        self.calls = []
        real_to = torch.Tensor.to

        def pin_memory(t):
            self.calls.append("pin_memory")
            return t

        def to(t, *args, **kwargs):
            device = args[0] if args else kwargs.get("device")
            self.calls.append(("to", str(device), kwargs.get("non_blocking", False)))
            return t if str(device).startswith("cuda") else real_to(t, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "to", to)


def test_batches_are_copied_pinned_and_non_blocking_on_a_gpu(monkeypatch):
    """get_batch: on CUDA the host batch is pinned and copied non_blocking (a pageable copy makes
    the host wait every step); on the CPU a plain copy, no pinning, and the batch bit for bit
    the one read before (the windows of the same random starts)."""
    import numpy as np
    from nanogeo.run.steps import batch_rng, get_batch
    tokens = np.arange(10_000, dtype=np.uint16) * 7 % 50257
    starts = batch_rng(1, 0, 3, 0).integers(0, len(tokens) - 33, size=4)
    expected = torch.from_numpy(np.stack([tokens[s: s + 33] for s in starts]).astype(np.int64))
    x, y = get_batch(tokens, 4, 32, batch_rng(1, 0, 3, 0), torch.device("cpu"))
    assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])
    fake = FakeCudaBatch(monkeypatch)
    get_batch(tokens, 4, 32, batch_rng(1, 0, 3, 0), torch.device("cpu"))
    assert fake.calls == [("to", "cpu", False)], fake.calls
    fake.calls.clear()
    x, y = get_batch(tokens, 4, 32, batch_rng(1, 0, 3, 0), torch.device("cuda", 0))
    assert fake.calls == ["pin_memory", ("to", "cuda:0", True)], fake.calls
    assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])


def fake_driver(tmp_path, version):
    """An nvidia-smi that lists one GH200 and reports driver `version`."""
    bin_dir = tmp_path / f"driver-{version}"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n  -L) echo '" + GH200_LIST + "';;\n"
                   f"  --query-gpu=driver_version) echo {version};;\n  *) echo 9.0;;\nesac\n")
    smi.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("driver, index", [("535.183.01", "cu128"), ("580.65.06", "cu130"),
                                           ("470.256.02", None)])
def test_install_advice_names_the_wheel_index_that_fits_the_driver(tmp_path, monkeypatch,
                                                                  driver, index):
    """A CPU-only torch on a GPU node: the one line names the CUDA wheel index that the driver
    nvidia-smi reports can run (CUDA 13 needs >= 580, CUDA 12 >= 525: NVIDIA's compatibility
    table), not cu130 always; below every minimum it says to update the driver."""
    from nanogeo.run import runtime
    monkeypatch.setenv("PATH", fake_driver(tmp_path, driver) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.driver_version() == driver
    line = runtime.cuda_build_missing()
    assert f"driver {driver}" in line and "--device=cpu" in line
    if index:
        assert line.count("download.pytorch.org/whl/") == 1
        assert f"download.pytorch.org/whl/{index}\"" in line, line
    else:
        assert "update the NVIDIA driver to >= 525" in line, line


def differing_init_rank(rank, world_size, argv, out):
    """train.train on a rank whose initial parameters differ from rank 0's (another seed, as two
    hosts' CPUs might draw) when `differ` is set."""
    import json
    import train
    if "--differ" in argv:
        argv = [a for a in argv if a != "--differ"]
        real_seed = torch.manual_seed
        torch.manual_seed = lambda seed: real_seed(seed + 1000 * rank)
    summary = train.train(train.parse_config(argv))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(summary["param_sha256"], f)


def test_ranks_start_from_rank_0s_parameters(tmp_path, tiny_corpus):
    """Two gloo ranks whose initial parameters differ train as if they had not: every rank
    takes rank 0's parameters at the start (at the old code the ranks diverged, and the
    agreement check at step 1 stopped the run), bit for bit the run of two ranks that agree."""
    import json
    from test_train import tiny_args
    hashes = {}
    for variant in ("same", "differ"):
        argv = tiny_args(tiny_corpus, tmp_path / variant, "--max_iters=3", "--check_every=1",
                         "--comm=fp8", *(["--differ"] if variant == "differ" else []))
        out = str(tmp_path / f"{variant}.json")
        run_ranks(differing_init_rank, 2, argv, out)
        hashes[variant] = [json.load(open(f"{out}.{r}")) for r in (0, 1)]
    assert hashes["differ"][0] == hashes["differ"][1] == hashes["same"][0] == hashes["same"][1]


def test_the_codec_never_divides_by_a_python_number():
    """CUDA divides a tensor by a Python number as a multiplication by the number's reciprocal
    (PyTorch's div_true_kernel_cuda: "may lose one bit of precision"); the CPU divides. A codec
    that did would write other bytes on a GPU than on the CPU and the simulator: NVFP4's tensor
    scale, amax / 2688, did for about a quarter of all amax; so did the stage-1 mean, sum / W,
    at any W not a power of two. A dispatch mode sees every division of the codecs and of the
    means (FP8 and NVFP4, compress.py's and the packed forms, an e4m3 stage 2 after NVFP4, the
    fp32 average, FSDP's, at 3 ranks; the K-FAC moments' token-weighted mean, 15 tokens): none is
    by a Python number, unless a power of two (then both are exact). The moments' mean keeps
    the CPU's bits of the division by a number."""
    import math
    from torch.utils._python_dispatch import TorchDispatchMode
    from nanogeo.wire import collective

    class Divisions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by_number = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_) and \
                    isinstance(args[1], (int, float)):
                self.by_number.append(args[1])
            return func(*args, **(kwargs or {}))
    from nanogeo.parallel import fsdp, hooks, simulated
    g = torch.Generator().manual_seed(0)
    workers = [[torch.randn(40, 48, generator=g), torch.randn(1000, generator=g) * 1e-3]
               for _ in range(3)]
    moments = [{"input": {"w": torch.randn(48, 48, generator=g)}, "tokens": {"input": {"w": t}}}
               for t in (3, 5, 7)]
    with Divisions() as seen:
        for fmt in ("e4m3", "e5m2", "nvfp4"):
            for x in workers[0]:
                compress.dequantize(compress.quantize(x, fmt, 128))
            compress.simulate_mean(workers, compress.ShardLayout(
                [t.shape for t in workers[0]], fmt, 128, len(workers)))
            collective.mean_over_workers(workers, fmt)             # the packed forms
        collective.mean_over_workers(workers, "nvfp4", stage2_fmt="e4m3")
        simulated.average(workers, "fp32", None)
        fsdp.average(workers[0][0], "avg", 3)
        mean = hooks.average_worker_moments(moments, {"w": (40, 48)}, ("input",), "cpu")
    odd = [d for d in seen.by_number if not math.log2(abs(d)).is_integer()]
    assert not odd, f"divisions by Python numbers that are not powers of two: {odd}"
    total = sum((m["input"]["w"].reshape(-1) * m["tokens"]["input"]["w"] for m in moments[1:]),
                moments[0]["input"]["w"].reshape(-1) * 3)
    assert torch.equal(mean["input"]["w"], total.view(48, 48) / 15.0)
