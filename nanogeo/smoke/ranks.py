"""
The checks that need every rank: `make gpu-smoke` (launcher.py) runs worker() on N ranks under
torchrun. Each check returns (status, figures): status PASS, FAIL or SKIP (with a "why"); where
ranks must agree, each rank's sha256 of its result is gathered and compared.

A check that cannot turn into FAIL is not a check: tests/test_smoke.py injects each one's fault
(corrupted bytes on one rank, a NaN, a rank that disagrees, a hang) and sees FAIL. A NaN never
passes: every bound is written so that NaN fails it (`x <= bound` is False for NaN), and the
largest of several errors is worst()'s, not max()'s (which skips a NaN that is not first).

    env_figures        versions and the device (launcher.py's env line, and each rank's)
    smoke_codec        the device's bytes equal the CPU's and the packed codec's equal
                       compress.quantize's (e4m3, e5m2, nvfp4); compiled kernels give eager's
                       bytes; each format's GB/s against a copy (not checked)
    smoke_collectives  all_reduce_mean at world size N: the one-process simulator's bytes,
                       within codec_bound of the exact mean, the same bytes on every rank
    smoke_fp8_sum      the paper's NCCL float8 SUM against its emulation (SKIP where NCCL cannot
                       sum float8; check_fp8_sum runs anywhere, on gloo against the emulation)
    smoke_ddp          single.check_ddp at world size N, the same gradients on every rank
    smoke_fsdp         FSDP2 with use_compressed_reduce_scatter against fp32 reduce-scatters
    worker             one rank: the checks in order, then on CUDA the figures (figures.py);
                       rank 0 writes the results after every check, and a crash ends every rank
                       (no mismatched collectives); a collective that waits longer than
                       --pg_timeout raises the backend's own diagnosis
"""

import json
import math
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


def worst(values):
    """The largest of `values`; NaN if any of them is NaN (max() would skip one that is not
    first, and a NaN error would pass)."""
    values = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else max(values)


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


def codec_inputs(device):
    """Tensors that exercise the codec: a partial last group, several magnitudes, a zero group,
    groups near fp32's smallest normals (scales near fp32's max)."""
    g = torch.Generator().manual_seed(0)
    sizes_and_scales = ((130, 1.0), (1000, 1e-3), (4096 + 17, 1e3), (50000, 1.0), (300, 1e-37))
    inputs = [torch.randn(n, generator=g) * scale for n, scale in sizes_and_scales]
    inputs[3][:256] = 0
    return [x.to(device) for x in inputs]


def codec_agreement(device, with_compiled):
    """{check: bool}: the device's wire bytes and decoded values equal the CPU's (each format);
    the packed codec's bytes equal compress.quantize's (e4m3, e5m2); compiled == eager."""
    out = {}
    for fmt in ("e4m3", "e5m2", "nvfp4"):
        same_as_cpu, packed_as_quantize = True, True
        for x in codec_inputs(device):
            q = compress.quantize(x, fmt, 128)
            cpu = compress.quantize(x.cpu(), fmt, 128)
            same_as_cpu &= (torch.equal(q.buffer.cpu(), cpu.buffer)
                            and torch.equal(compress.dequantize(q).cpu(), compress.dequantize(cpu)))
            if fmt != "nvfp4":
                packed = packing.pack_groups(compress.scale_groups(x, 128), fmt)
                packed_as_quantize &= torch.equal(packed, q.buffer)
        out[f"{fmt}_device_equals_cpu"] = bool(same_as_cpu)
        if fmt != "nvfp4":
            out[f"{fmt}_packed_equals_quantize"] = bool(packed_as_quantize)
    if with_compiled:
        for fmt in ("e4m3", "e5m2"):
            trips = []
            for compiled in (False, True):
                kernels.compile_hot_path(compiled)
                trips.append([wire_round_trip(x, fmt) for x in codec_inputs(device)])
            kernels.compile_hot_path(False)
            out[f"{fmt}_compiled_equals_eager"] = all(
                all(torch.equal(a, b) for a, b in zip(eager, compiled))
                for eager, compiled in zip(*trips))
    return out


def wire_round_trip(x, fmt):
    """(stage 1's wire of x, its decode, stage 2's wire of the mean of x, x reversed and -0.7 x
    on 3 ranks - a division by 3 rounds, so an approximate one would show): each call of the
    packed codec (KERNELS), compiled or not."""
    dtype, fmax = compress.FP8_FORMATS[fmt]
    wires = [packing.pack_groups(compress.scale_groups(v, 128), fmt)
             for v in (x, x.flip(0), -0.7 * x)]
    mean = kernels.KERNELS["average_packed"](torch.cat(wires), 3, 128, dtype, fmax,
                                             compress.count_divisor(3, x))
    return wires[0], packing.unpack_groups(wires[0], 128, fmt), mean


def smoke_codec(device, numel, iters, with_compiled):
    """The codec writes the same bytes on the device as on the CPU, packed or not, compiled or
    not (codec_agreement: any False fails); and each format's encode + decode GB/s of fp32
    input against a device copy of the same bytes (figures, not checked)."""
    out = codec_agreement(device, with_compiled)
    status = "PASS" if all(out.values()) else "FAIL"
    if with_compiled and kernels.state["float8_eager"]:
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
        error = worst(((m.double() - e).abs().max() / b).item()
                      for m, e, b in zip(means, exact, codec_bound(fmt, everyone)))
        agree, hashes = same_on_every_rank(sha256(means))
        as_simulated = all(torch.equal(a, b) for a, b in zip(means, simulated))
        out[fmt] = {"error_vs_bound": error, "same_bytes_every_rank": agree,
                    "equals_simulator": as_simulated, "bytes_sent": sent,
                    "sha256": hashes[0][:16]}
        # The owner adds the W copies in rank order (IEEE adds) and divides by W held in a
        # tensor (compress.count_divisor: never CUDA's multiplication by 1 / W), so the
        # simulator's bytes are expected at every W, on every backend: a mismatch fails.
        if not (error <= 1 and agree and as_simulated):
            status = "FAIL"
    return status, out


# fp8-sum's inputs and tolerances. A quarter of each tensor's entries have the same sign and
# size on every rank (3 on even ranks, 6 on odd ones, 6 being the shared amax): their sums
# reach 1.5x the format's max at two ranks, more at more, in any order of addition - a
# fraction that saturates by construction, whatever order NCCL adds in. The other entries are
# small (normal, sd 0.25: their sums stay below the max, 6, up to 16 ranks - 6 sd - and 64 ranks
# saturate 0.2 % of them), so the counts must agree closely; NCCL's order may still tip a
# borderline sum, hence a relative tolerance.
SATURATING = 0.25                # the fraction of entries whose sum saturates by construction
SATURATION_TOLERANCE = 0.1       # |NCCL's fraction - the emulation's| <= this x the emulation's
GAP_TOLERANCE = 0.25             # the largest difference of the means, of the largest mean:
                                 # other orders re-round the partial sums, by a code step or so


def fp8_sum_unavailable(device):
    """None where NCCL can sum float8 codes on this device, else why not."""
    if device.type != "cuda":
        return "no CUDA: gloo has no float8 sum, the emulation is what runs"
    if torch.cuda.get_device_capability(device) < (9, 0) or torch.cuda.nccl.version() < (2, 24):
        return "NCCL sums float8 only from NCCL 2.24 on compute capability 9.0"
    return None


def fp8_sum_inputs(rank):
    g = torch.Generator().manual_seed(200 + rank)
    x = 0.25 * torch.randn(4096, generator=g)
    x[: int(SATURATING * x.numel())] = 3.0 * (1 + rank % 2)
    return [x, torch.randn(77, 33, generator=g)]


def check_fp8_sum(device):
    """The paper's collective (fp8sum.all_reduce_fp8_sum: NCCL's float8 SUM on CUDA, its
    emulation on gloo) against the one-process emulation: the same bytes on every rank, means
    within GAP_TOLERANCE, the saturated fraction of the first tensor within
    SATURATION_TOLERANCE of the emulation's, which must itself reach SATURATING."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = [fp8_sum_inputs(r) for r in range(world)]
    out, status = {}, "PASS"
    for fmt in ("e5m2", "e4m3"):
        try:
            means, _, _, saturated = fp8sum.all_reduce_fp8_sum([t.to(device) for t in everyone[rank]], fmt)
        except RuntimeError as e:
            return "FAIL", {"why": str(e).splitlines()[0]}
        emulated, _, _, emulated_saturated = fp8sum.simulate_fp8_sum(everyone, fmt)
        gap = worst((m.cpu() - e).abs().max().item() / e.abs().max().item()
                    for m, e in zip(means, emulated))
        agree, _ = same_on_every_rank(sha256(means))
        measured, expected = saturated[0].item(), emulated_saturated[0].item()
        out[fmt] = {"max_gap_vs_emulation": gap, "saturated": saturated.cpu().tolist(),
                    "emulated_saturated": emulated_saturated.tolist(), "same_bytes_every_rank": agree}
        if not (agree and gap <= GAP_TOLERANCE and expected >= SATURATING
                and abs(measured - expected) <= SATURATION_TOLERANCE * expected):
            status = "FAIL"
    return status, out


def smoke_fp8_sum(device):
    """check_fp8_sum where NCCL can sum float8; SKIP, saying why, where it cannot."""
    why = fp8_sum_unavailable(device)
    return ("SKIP", {"why": why}) if why else check_fp8_sum(device)


def smoke_ddp(device, toy):
    result = check_ddp(device, width=64 if toy else 256, tokens=16 if toy else 64)
    agree, _ = same_on_every_rank(result.pop("grads_sha256"))
    result["same_grads_every_rank"] = agree
    ok = worst(result["rel_err_per_step"]) < 0.05 and result["geo_matrices"] > 0 and agree
    return ("PASS" if ok else "FAIL"), result


def smoke_fsdp(device, toy):
    """A small Llama under FSDP2, fp32 reduce-scatters against use_compressed_reduce_scatter's
    (Euclidean FP8 and the subspace rotation): full gradients within FP8 error after a few
    steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from nanogeo.parallel.fsdp import use_compressed_reduce_scatter
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
            use_compressed_reduce_scatter(net, geometry=method, geo_rank=4, geo_warmup=1,
                                          vocab_size=cfg.vocab_size)
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
    ok = all(worst(e) < 0.05 for e in errors.values())
    return ("PASS" if ok else "FAIL"), {"rel_err_per_step": errors}


def rank_checks(args, device, toy):
    """[(name, check)] in the order the worker runs them."""
    return [("codec", lambda: smoke_codec(device, 2e5 if toy else args.numel, args.iters,
                                          args.compile)),
            ("collective", lambda: smoke_collectives(device, 1 if toy else 16)),
            ("fp8-sum", lambda: smoke_fp8_sum(device)),
            ("ddp", lambda: smoke_ddp(device, toy)),
            ("fsdp", lambda: smoke_fsdp(device, toy))]


ONE_RANK = ("one rank: nothing is exchanged, so NCCL and the FP8 exchange are NOT tested (NCCL "
            "takes one GPU per rank: run on a node with 2 or more GPUs)")


def worker(args):
    """One rank of torchrun: the checks that need every rank, then (on CUDA) the figures;
    rank 0 writes the results after each of them."""
    rank, world, _, device = runtime.setup_distributed(types.SimpleNamespace(device="auto"),
                                                       timeout=args.pg_timeout)
    toy = device.type == "cpu"
    results = {"env": env_figures(device), "world": world}

    def write():
        if rank == 0:
            with open(args.worker_out, "w") as f:
                json.dump(results, f, indent=1)
    for name, fn in rank_checks(args, device, toy):
        if world == 1 and name != "codec":
            results[name] = {"status": "SKIP", "why": ONE_RANK}
            continue
        t0 = time.perf_counter()
        try:
            status, figures = fn()
        except Exception as e:
            # A check that crashed on this rank may have left the others inside a collective:
            # going on to the next one would pair mismatched collectives (a hang). Record it and
            # re-raise, so that torchrun ends every rank. (A collective that waited longer than
            # --pg_timeout lands here with the backend's diagnosis.)
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            results[name] = {"status": "FAIL", "why": why}
            write()
            raise
        figures["seconds"] = round(time.perf_counter() - t0, 2)
        results[name] = {"status": status, **figures}
        write()
        dist.barrier()
    if device.type == "cuda" and args.figures:
        from nanogeo.smoke import figures
        try:        # figures are not checks: a failure is reported, it fails nothing
            results["figures"] = figures.gpu_figures(device, args.iters)
        except Exception as e:
            results["figures"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        write()
    dist.destroy_process_group()
