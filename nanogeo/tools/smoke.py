"""
The GPU smoke test: does the NCCL/CUDA path work on this node, and how fast are its parts?

    make gpu-smoke        # = python -m nanogeo.tools.smoke --nproc=<GPUs, else 2> --out=smoke.json
    python -m nanogeo.tools.smoke --out smoke.json                       # on one GPU (GH200, H100, ...)
    python -m nanogeo.tools.smoke --preset cpu-tiny --numel 1e6 --iters 3  # the same checks on a CPU
    python -m nanogeo.tools.smoke ... --no-compile    # skip the compiled rows (minutes of inductor on a CPU)

One process, so no network is measured (two processes cannot share one GPU's NCCL; the wire
is measured by `torchrun ... -m nanogeo.tools.bench collective` on a real node). What it checks:

  env        device, torch, CUDA and NCCL versions
  nccl       a 1-rank NCCL process group runs the collective's calls on uint8 buffers
             (all_to_all_single, all_gather) and all_reduce_mean returns finite means
  codec      a packed round trip's throughput in GB/s of fp32 input (e4m3, e5m2: eager and
             torch.compile'd, kernels.compile_hot_path, unless --no-compile; nvfp4 eager)
  transform  GeoFP8's encode + decode of every rotated matrix of the preset, ms per step
             (eager: the transforms are not compiled), and the bytes of the geometry state
  ddp        the DDP hook on the CUDA side stream: gradients of a small model equal plain
             DDP's within FP8 error
  step       the preset's forward + backward + AdamW step (bf16 autocast on GPU), ms and
             tokens/s, eager and (unless --no-compile) compiled; GeoFP8's transform as a
             fraction of it

Each timing is the median of --iters after a warm-up, with the device synchronized.

With --nproc=N (`make gpu-smoke`) it is a node's first-contact test instead: torchrun starts N
ranks (one per GPU; 2 gloo CPU ranks at toy size where there is none), and every check prints one
PASS / FAIL / SKIP line, then a summary; smoke.json keeps the figures. It stops at once, with one
line, where GPUs are visible but torch has no CUDA. The checks:

  env          torch, CUDA and NCCL versions, platform.machine(), device name and capability
  codec        compiled and eager kernels give the same bytes; encode + decode GB/s of fp32 input
               (e4m3, e5m2, nvfp4) against a device copy of the same bytes (the roofline)
  collective   e4m3 / e5m2 / nvfp4 all_reduce_mean: the same bytes as the one-process simulator
               of the gathered inputs, within the codec's bound of the exact mean, and the same
               bytes on every rank (sha256 gathered)
  fp8-sum      NCCL's float8 SUM against its emulation (saturation included), where NCCL can
               sum float8 (CUDA, compute capability >= 9.0); else SKIP, saying why
  ddp          the DDP hook against plain DDP at world size N (ranks see different data)
  fsdp         FSDP2 with use_geofp8 against FP32 reduce-scatters
  train        cpu-tiny on the bundled corpus (toy: 4 x 32 tokens), --comm=geofp8 (--compile on
               a GPU), 30 steps resumed
               to 40, and a Muon run: train.py's all-rank parameter checksum every 10 steps, a
               falling loss, ms per step, the slowest step against the median
"""

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist

import compress
from nanogeo.parallel import hooks
import model as model_lib
from nanogeo.wire import collective, fp8sum, kernels, packing
from nanogeo.parallel.communicator import Options
from nanogeo.run import runtime


def timed(fn, iters):
    """Median seconds of fn() over iters runs, after one warm-up run (compiles happen there)."""
    fn()
    seconds = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return sorted(seconds)[len(seconds) // 2]


def check_env(device):
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
    return info


def check_nccl(device):
    """The collective's calls on a 1-rank group of the backend train.py would pick."""
    x = torch.arange(1000, dtype=torch.uint8, device=device)
    recv = torch.empty_like(x)
    dist.all_to_all_single(recv, x, [1000], [1000])
    slots = list(torch.zeros(1, 1000, dtype=torch.uint8, device=device).unbind())
    dist.all_gather(slots, x)
    grads = [torch.randn(256, 512, device=device), torch.randn(300, device=device)]
    means, _ = compress.all_reduce_mean(grads)
    error = (sum((a - b).pow(2).sum() for a, b in zip(means, grads))
             / sum(g.pow(2).sum() for g in grads)).sqrt().item()
    # the paper's collective sums float8 codes in NCCL itself (needs NCCL >= 2.24, sm >= 90)
    codes = torch.full((1000,), 2.0, device=device).to(torch.float8_e5m2)
    try:
        dist.all_reduce(codes)
        float8_sum = bool((codes.float() == 2.0).all())   # one rank: the sum is the input
    except RuntimeError as e:
        float8_sum = f"unsupported: {str(e).splitlines()[0]}"
    return {"backend": dist.get_backend(), "uint8_all_to_all": torch.equal(recv, x),
            "uint8_all_gather": torch.equal(slots[0], x), "all_reduce_mean_rel_err": error,
            "float8_all_reduce_sum": float8_sum}


def check_codec(device, numel, iters, with_compiled=True):
    """One round trip of numel values in blocks of 128 through the packed codec (FP8: eager and,
    with_compiled, compiled) and NVFP4's."""
    x = torch.randn(numel, device=device)
    groups = compress.scale_groups(x, 128)
    rows = []
    for fmt in ("e4m3", "e5m2", "nvfp4"):
        for compiled in ((False, True) if fmt != "nvfp4" and with_compiled else (False,)):
            kernels.compile_hot_path(compiled)
            trip = ((lambda: packing.unpack_groups(packing.pack_groups(groups, fmt), 128, fmt))
                    if fmt != "nvfp4" else (lambda: compress.dequantize(compress.quantize(x, fmt, 128))))
            seconds = timed(trip, iters)
            rows.append({"fmt": fmt, "compiled": compiled, "ms": seconds * 1000,
                         "gb_per_s": 4 * numel / seconds / 1e9})
    kernels.compile_hot_path(False)
    return rows


def rotated_shapes(net):
    opts = Options(geometry="subspace", vocab_size=net.config.vocab_size)
    return [tuple(p.shape) for n, p in net.named_parameters()
            if compress.exemption(n, tuple(p.shape), opts, set(hooks.linear_layers(net))) is None]


def check_transform(device, net, iters, geo_rank=16):
    """encode_geo + decode_geo of every rotated matrix once: GeoFP8's per-step transform."""
    shapes = rotated_shapes(net)
    work = []
    for k, (m, n) in enumerate(shapes):
        g = torch.Generator().manual_seed(k)
        U = torch.linalg.qr(torch.randn(m, geo_rank, generator=g)).Q.to(device)
        V = torch.linalg.qr(torch.randn(n, geo_rank, generator=g)).Q.to(device)
        bases = (compress.HouseholderBasis.complete(U), compress.HouseholderBasis.complete(V))
        work.append((torch.randn(m, n, device=device), bases))

    def step():
        for G, bases in work:
            compress.decode_geo(compress.encode_geo(G, *bases), *bases)

    out = {"matrices": len(shapes), "elements": sum(m * n for m, n in shapes), "geo_rank": geo_rank,
           "state_mb": sum((m + n) * geo_rank * 4 for m, n in shapes) / 1e6}
    out["eager_ms"] = timed(step, iters) * 1000        # (the transforms are not compiled)
    return out


def check_ddp(device, width=256, tokens=64):
    """The hook on the GPU side stream against plain DDP, on every rank of the default group (each
    rank its own inputs): equal within FP8 error."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from nanogeo.parallel.ddp import GeoFP8HookState, geofp8_hook
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
    nets = []
    for hooked in (False, True):
        torch.manual_seed(0)
        net = torch.nn.TransformerEncoder(layer, 2).to(device)
        ids = [device.index] if device.type == "cuda" else None
        net = DDP(net, device_ids=ids)
        if hooked:
            state = GeoFP8HookState(net, geometry="subspace", geo_warmup=1, geo_rank=8)
            net.register_comm_hook(state, geofp8_hook)
        nets.append(net)
    errors = []
    inputs = torch.Generator().manual_seed(1000 + dist.get_rank())
    for step in range(4):
        x = torch.randn(8, tokens, width, generator=inputs).to(device)
        for net in nets:
            net.zero_grad()
            net(x).pow(2).mean().backward()
        ref, got = ([p.grad for p in net.parameters()] for net in nets)
        errors.append((sum((a - b).pow(2).sum() for a, b in zip(ref, got))
                       / sum(a.pow(2).sum() for a in ref)).sqrt().item())
    coords = [c.coords(n) for c in state.communicators.values() for n in c.names]
    return {"rel_err_per_step": errors, "geo_matrices": coords.count("geo"),
            "side_stream": bool(state.streams), "bytes_sent": state.reset_bytes(),
            "grads_sha256": runtime.parameter_checksum([p.grad for p in nets[1].parameters()])}


def check_step(device, preset, batch_size, block_size, iters, with_compiled=True):
    cfg = model_lib.model_config(preset, block_size=block_size)
    raw = model_lib.Llama(cfg).to(device)
    optimizer = raw.configure_optimizers(0.1, 3e-4, (0.9, 0.95), fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (batch_size, block_size), device=device)
    out = {"preset": preset, "params_m": sum(p.numel() for p in raw.parameters()) / 1e6,
           "tokens": batch_size * block_size}
    for compiled in (False, True) if with_compiled else (False,):
        net = torch.compile(raw, dynamic=False) if compiled else raw

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = net(x, x)[1]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = timed(step, iters)
        key = "compiled" if compiled else "eager"
        out[f"{key}_ms"] = seconds * 1000
        out[f"{key}_tokens_per_s"] = batch_size * block_size / seconds
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return out, raw


# ---------------------------------------------------------------------------- make gpu-smoke
# Every check returns (status, figures): status PASS, FAIL or SKIP (with a "why").

MANTISSA_BITS = {"e4m3": 3, "e5m2": 2, "nvfp4": 1}


def sha256(tensors):
    return runtime.parameter_checksum(tensors)


def same_on_every_rank(text):
    """Is `text` (a hash) the same on every rank? All ranks' values are gathered."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, text)
    return len(set(everyone)) == 1, everyone


def env_figures(device):
    """Versions and the device, for the env line and smoke.json."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "machine": platform.machine(),
            "python": platform.python_version(), "visible_gpus": runtime.visible_gpus(),
            "device": "cpu"}
    if device.type == "cuda":
        info.update(device=torch.cuda.get_device_name(device),
                    capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                    nccl=".".join(map(str, torch.cuda.nccl.version())),
                    memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2 ** 30, 1))
    return info


def smoke_codec(device, numel, iters, with_compiled):
    """Compiled kernels against eager (identical bytes, several group counts), and each format's
    encode + decode GB/s of fp32 input against a device copy of the same bytes."""
    out, status = {}, "PASS"
    if with_compiled:
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randn(n, generator=g).to(device) * 10 ** (k % 5 - 2)
                  for k, n in enumerate((130, 1000, 4096 + 17, 50000))]
        for fmt in ("e4m3", "e5m2"):
            trips = []
            for compiled in (False, True):
                kernels.compile_hot_path(compiled)
                trips.append([(b, packing.unpack_groups(b, 128, fmt)) for b in
                              (packing.pack_groups(compress.scale_groups(x, 128), fmt)
                               for x in inputs)])
            kernels.compile_hot_path(False)
            same = all(torch.equal(a, b) and torch.equal(c, d)
                       for (a, c), (b, d) in zip(*trips))
            out[f"{fmt}_compiled_equals_eager"] = same
            status = status if same else "FAIL"
        if kernels.state["float8_eager"]:
            out["why"] = "this GPU has no float8 casts in Triton: eager only"
    x = torch.randn(int(numel), device=device)
    copy = torch.empty_like(x)
    copy_s = timed(lambda: copy.copy_(x), iters)
    out["copy_gb_per_s"] = 4 * x.numel() / copy_s / 1e9
    groups = compress.scale_groups(x, 128)
    for fmt in ("e4m3", "e5m2", "nvfp4"):
        for compiled in ((False, True) if with_compiled and fmt != "nvfp4" else (False,)):
            kernels.compile_hot_path(compiled)
            trip = ((lambda: packing.unpack_groups(packing.pack_groups(groups, fmt), 128, fmt))
                    if fmt != "nvfp4" else (lambda: compress.dequantize(compress.quantize(x, fmt, 128))))
            seconds = timed(trip, iters)
            key = f"{fmt}_{'compiled' if compiled else 'eager'}"
            out[f"{key}_gb_per_s"] = 4 * x.numel() / seconds / 1e9
            out[f"{key}_vs_copy"] = copy_s / seconds
    kernels.compile_hot_path(False)
    return status, out


def codec_bound(fmt, tensors_of_ranks):
    """A bound on |mean - exact mean| per element of each tensor: each of the two stages rounds to
    within half a code step at the block's largest magnitude, at most 2^-(m+1) of the tensor's
    amax over the ranks (m mantissa bits); NVFP4's e4m3 block scales may round down and
    saturate the largest value by up to 2^-4 of it, once per stage."""
    unit = 2.0 ** -(MANTISSA_BITS[fmt] + 1) + (2.0 ** -4 if fmt == "nvfp4" else 0.0)
    return [2 * unit * 1.001 * torch.stack([t.abs().amax() for t in ts]).amax()
            for ts in zip(*tensors_of_ranks)]


def smoke_collectives(device, scale):
    """collective.mean_over_ranks at world size N for each format: equal to the simulator of the gathered
    inputs, within codec_bound of the exact mean, the same bytes on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = [(64 * scale, 96 * scale), (1000 * scale,), (3, 5)]

    def inputs(r):
        g = torch.Generator().manual_seed(100 + r)
        return [torch.randn(s, generator=g) * 10 ** (k - 1) for k, s in enumerate(shapes)]
    everyone = [inputs(r) for r in range(world)]        # every rank can make every rank's input
    exact = [torch.stack(ts).double().mean(0) for ts in zip(*everyone)]
    out, status = {}, "PASS"
    for fmt in ("e4m3", "e5m2", "nvfp4"):
        means, sent = collective.mean_over_ranks([t.to(device) for t in everyone[rank]], fmt)
        means = [m.cpu() for m in means]
        simulated = collective.mean_over_workers(everyone, fmt)[0]
        worst = max(((m.double() - e).abs().max() / b).item()
                    for m, e, b in zip(means, exact, codec_bound(fmt, everyone)))
        agree, hashes = same_on_every_rank(sha256(means))
        as_simulated = all(torch.equal(a, b) for a, b in zip(means, simulated))
        out[fmt] = {"error_vs_bound": worst, "same_bytes_every_rank": agree,
                    "equals_simulator": as_simulated, "bytes_sent": sent,
                    "sha256": hashes[0][:16]}
        # NCCL adds the stage-2 pieces on the GPU: same order, IEEE adds, so the simulator's
        # bytes are expected; a mismatch is reported but only the bound and agreement fail it
        if not (worst <= 1 and agree):
            status = "FAIL"
    return status, out


def smoke_fp8_sum(device):
    """The paper's collective on NCCL's float8 SUM against its emulation, with values that
    saturate; SKIP where NCCL cannot sum float8."""
    if device.type != "cuda":
        return "SKIP", {"why": "no CUDA: gloo has no float8 sum, the emulation is what runs"}
    if torch.cuda.get_device_capability(device) < (9, 0) or torch.cuda.nccl.version() < (2, 24):
        return "SKIP", {"why": "NCCL sums float8 only from NCCL 2.24 on compute capability 9.0"}
    rank, world = dist.get_rank(), dist.get_world_size()

    def inputs(r):
        g = torch.Generator().manual_seed(200 + r)
        x = torch.randn(4096, generator=g)
        x[:64] = 3.0 * (1 + r % 2)      # the same sign on every rank: their sum saturates
        return [x, torch.randn(77, 33, generator=g)]
    everyone = [inputs(r) for r in range(world)]
    out, status = {}, "PASS"
    for fmt in ("e5m2", "e4m3"):
        try:
            means, _, _, saturated = fp8sum.all_reduce_fp8_sum([t.to(device) for t in everyone[rank]], fmt)
        except RuntimeError as e:
            return "FAIL", {"why": str(e).splitlines()[0]}
        emulated, _, _, emulated_saturated = fp8sum.simulate_fp8_sum(everyone, fmt)
        gap = max((m.cpu() - e).abs().max().item() / e.abs().max().item()
                  for m, e in zip(means, emulated))
        agree, _ = same_on_every_rank(sha256(means))
        out[fmt] = {"max_gap_vs_emulation": gap, "saturated": saturated.cpu().tolist(),
                    "emulated_saturated": emulated_saturated.tolist(), "same_bytes_every_rank": agree}
        # NCCL adds in its own order (ring or tree): codes may differ by a rounding of the sum;
        # the saturated fractions and the means must still agree closely
        if not agree or gap > 0.25 or abs(saturated[0].item() - emulated_saturated[0].item()) > 0.05:
            status = "FAIL"
    return status, out


def smoke_ddp(device, toy):
    result = check_ddp(device, width=64 if toy else 256, tokens=16 if toy else 64)
    agree, _ = same_on_every_rank(result.pop("grads_sha256"))
    result["same_grads_every_rank"] = agree
    ok = max(result["rel_err_per_step"]) < 0.05 and result["geo_matrices"] > 0 and agree
    return ("PASS" if ok else "FAIL"), result


def smoke_fsdp(device, toy):
    """A small Llama under FSDP2, fp32 reduce-scatters against use_geofp8's (Euclidean FP8 and
    the subspace rotation): full gradients within FP8 error after a few steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from nanogeo.parallel.fsdp import use_geofp8
    cfg = model_lib.model_config("char-study" if toy else "cpu-tiny", block_size=32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    nets = {}
    for method in ("fp32", "euclidean", "subspace"):
        torch.manual_seed(0)
        net = model_lib.Llama(cfg).to(device)
        for block in net.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        if method != "fp32":
            use_geofp8(net, geometry=method, geo_rank=4, geo_warmup=1, vocab_size=cfg.vocab_size)
        nets[method] = net
    data = torch.Generator().manual_seed(300 + dist.get_rank())
    errors = {m: [] for m in nets if m != "fp32"}
    for step in range(4):
        x = torch.randint(0, cfg.vocab_size, (2, 32), generator=data).to(device)
        for net in nets.values():
            net.zero_grad(set_to_none=True)
            net(x, x)[1].backward()
        ref = [p.grad.full_tensor().double() for p in nets["fp32"].parameters()]
        norm = sum(r.pow(2).sum() for r in ref).sqrt()
        for m in errors:
            got = [p.grad.full_tensor().double() for p in nets[m].parameters()]
            errors[m].append((sum((a - b).pow(2).sum() for a, b in zip(got, ref)).sqrt()
                              / norm).item())
    ok = all(max(e) < 0.05 for e in errors.values())
    return ("PASS" if ok else "FAIL"), {"rel_err_per_step": errors}


def worker(args):
    """One rank of torchrun: the checks that need every rank; rank 0 writes their results."""
    rank, world, _, device = runtime.setup_distributed(types.SimpleNamespace(device="auto"))
    toy = device.type == "cpu"
    checks = [("codec", lambda: smoke_codec(device, 2e5 if toy else args.numel,
                                            args.iters, args.compile)),
              ("collective", lambda: smoke_collectives(device, 1 if toy else 16)),
              ("fp8-sum", lambda: smoke_fp8_sum(device)),
              ("ddp", lambda: smoke_ddp(device, toy)),
              ("fsdp", lambda: smoke_fsdp(device, toy))]
    results = {"env": env_figures(device), "world": world}

    def write():
        if rank == 0:
            with open(args.worker_out, "w") as f:
                json.dump(results, f, indent=1)
    for name, fn in checks:
        if world == 1 and name != "codec":      # one rank adds nothing: no check of the exchange
            results[name] = {"status": "SKIP", "why": "world size 1: nothing is exchanged"}
            continue
        t0 = time.perf_counter()
        try:
            status, figures = fn()
        except Exception as e:
            # A check that crashed on this rank may have left the others inside a collective:
            # going on to the next one would pair mismatched collectives (a hang). Record it and
            # re-raise, so that torchrun ends every rank.
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            results[name] = {"status": "FAIL", "why": why}
            write()
            raise
        figures["seconds"] = round(time.perf_counter() - t0, 2)
        results[name] = {"status": status, **figures}
        dist.barrier()
    write()
    dist.destroy_process_group()


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
                   f"--nproc_per_node={nproc}", "-m", "nanogeo.tools.smoke", "--worker",
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", default="llama-600m", choices=list(model_lib.PRESETS))
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=2048)
    parser.add_argument("--numel", type=float, default=64e6, help="codec test tensor size")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the torch.compile'd codec and step (--no-compile: eager "
                             "only; on a CPU inductor's compile takes minutes)")
    parser.add_argument("--nproc", type=int, default=0,
                        help="make gpu-smoke: torchrun this many ranks (one per GPU) and run the "
                             "first-contact checks; 0: the single-process checks above")
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="--nproc: include the training check (train.py runs)")
    parser.add_argument("--timeout", type=float, default=480,
                        help="--nproc: seconds allowed for each torchrun")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.nproc:
        return first_contact(args)
    if reason := runtime.cuda_build_missing():
        print(f"nanogeo.tools.smoke: error: {reason}", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    results = {"env": check_env(device)}
    print(json.dumps(results["env"]), flush=True)
    checks = [("nccl", lambda: check_nccl(device)),
              ("codec", lambda: check_codec(device, int(args.numel), args.iters, args.compile)),
              ("ddp", lambda: check_ddp(device))]
    for name, fn in checks:
        results[name] = fn()
        print(name, json.dumps(results[name]), flush=True)
    results["step"], net = check_step(device, args.preset, args.batch_size, args.block_size,
                                      args.iters, args.compile)
    print("step", json.dumps(results["step"]), flush=True)
    results["transform"] = check_transform(device, net, args.iters)
    results["transform"]["fraction_of_step"] = (results["transform"]["eager_ms"]
                                                / results["step"]["eager_ms"])
    print("transform", json.dumps(results["transform"]), flush=True)
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
