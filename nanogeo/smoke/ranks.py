"""
The checks that need every rank: `make gpu-smoke` (launcher.py) runs worker() on N ranks under
torchrun. Each check returns (status, figures): status PASS, FAIL or SKIP (with a "why"); where
ranks must agree, each rank's sha256 of its result is gathered and compared.

    env_figures        versions and the device (launcher.py's env line, and each rank's)
    smoke_codec        compiled kernels give eager's bytes; each format's GB/s against a copy
    smoke_collectives  all_reduce_mean at world size N: the one-process simulator's bytes,
                       within codec_bound of the exact mean, the same bytes on every rank
    smoke_fp8_sum      the paper's NCCL float8 SUM against its emulation (SKIP without CUDA)
    smoke_ddp          single.check_ddp at world size N, the same gradients on every rank
    smoke_fsdp         FSDP2 with use_geofp8 against fp32 reduce-scatters
    worker             one rank: the checks in order; rank 0 writes their results for the
                       launcher, and a crash ends every rank (no mismatched collectives)
"""

import json
import platform
import time
import types

import torch
import torch.distributed as dist

import compress
import model as model_lib
from nanogeo.wire import collective, fp8sum, kernels, packing
from nanogeo.run import runtime
from nanogeo.smoke.single import check_ddp, timed


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
