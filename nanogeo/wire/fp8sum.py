"""
The paper's collective, an option of ProductionCommunicator (collective="fp8-sum"): one
scale per tensor, one all_reduce SUM of the FP8 codes themselves.

The published GeoFP8 sends each tensor with ONE e5m2 scale that is the same on every rank
(s = fmax / max over ranks of amax: one tiny all-reduce MAX), and sums the FP8 codes
themselves with NCCL's float8 all_reduce. NCCL adds two FP8 values by widening both to fp16,
adding, and rounding back to FP8 with saturation at the format's max - at every hop. So,
unlike the two-stage collective (which sums in fp32), the partial sums are re-rounded W - 1
times, and a sum that outgrows the format's max is clipped: the shared scale only guarantees
that ONE rank's values fit. Decode: sum / (s W). On GPU this is NCCL's own all_reduce; on CPU
(gloo) and in the simulator the same arithmetic is emulated hop by hop, so its error growth
with W can be measured on one machine. Wire bytes per rank (ring estimates): 2 (W-1)/W N, one
byte an element, plus 2 (W-1)/W 4 T for the MAX all-reduce of the T tensors' fp32 amax.
"""
import math

import torch
import torch.distributed as dist

import compress
from nanogeo.wire.collective import ring_allreduce_bytes

FP8_MAX = {dtype: fmax for dtype, fmax in compress.FP8_FORMATS.values()}   # by torch dtype


def fp8_add(a, b, dtype):
    """One hop of NCCL's FP8 sum on uint8 codes: widen to fp16, add in fp16, round back to FP8,
    saturating at +-max (fp16 itself overflows to inf above 65504; that saturates too).
    Elementwise, any shape. (The clamp stays in fp32: in fp16 the numbers are the same, but a
    NaN code's sign bit can come out different - in torch it depends on the element's position.)"""
    fmax = FP8_MAX[dtype]
    total = a.view(dtype).half()
    total += b.view(dtype).half()
    return total.float().clamp_(-fmax, fmax).to(dtype).view(torch.uint8)


def ring_chunks(n, world):
    """The ring's W chunks of an n-element buffer, as (start, end): element i is in chunk
    i W // n, so chunk c is [ceil(c n / W), ceil((c + 1) n / W)) (empty ones when n < W)."""
    bounds = [-(-c * n // world) for c in range(world + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def fp8_sum(codes, dtype, order="ring"):
    """Sum W ranks' FP8 codes as NCCL's all_reduce does: codes (W, N) uint8 -> (N,) uint8.

    ring: the buffer is cut into W chunks; chunk c's partial sum starts at rank c+1 and travels
      once around the ring (c+1, c+2, ..., c), each rank adding its own value: W - 1 roundings.
    tree: a balanced binary tree in rank order, ((x0 + x1) + (x2 + x3)) + ...: log2 W roundings
      per element - a model of the shallower orders NCCL prefers for FP8 where its topology
      allows (not NCCL's exact tree).
    Each hop is one fp8_add over the whole buffer, every chunk at once: W - 1 of them."""
    world, n = codes.shape
    if order == "ring":
        chunks = ring_chunks(n, world)
        def arriving(hop):      # (N,) the codes taken in at a hop (1: the start): in chunk c,
                                # rank (c + hop) mod W's - W slices, no per-element index
            out = torch.empty_like(codes[0])
            for c, (start, end) in enumerate(chunks):
                out[start:end] = codes[(c + hop) % world, start:end]
            return out
        total = arriving(1)
        for hop in range(2, world + 1):
            total = fp8_add(total, arriving(hop), dtype)
        return total
    level = list(codes.unbind(0))
    while len(level) > 1:
        pairs = [fp8_add(level[i], level[i + 1], dtype) for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2:]
    return level[0]


def fp8_sum_encode(tensors, fmt, amax):
    """Per-tensor codes (one flat uint8 buffer) and scales s = fmax / amax (amax: (T,) fp32).
    The simulator's form: each tensor stacked over R ranks, (R, ...), with amax (R, T) ->
    ((R, bytes), (R, T)); every element is scaled on its own, so stacking changes no byte."""
    dtype, fmax = compress.FP8_FORMATS[fmt]
    scales = compress.scale_from_amax(amax, fmax)
    ranks = scales.shape[:-1]                                       # () or (R,)
    codes = [(t.float().reshape(*ranks, -1) * s[..., None]).clamp(-fmax, fmax).to(dtype)
             .view(torch.uint8) for t, s in zip(tensors, scales.unbind(-1))]
    return torch.cat(codes, dim=-1), scales


def fp8_sum_decode(codes, tensors, scales, fmt, world=1):
    """codes / (s W) per tensor, shaped like `tensors` (W = 1: a rank's own round trip); or
    fp8_sum_encode's stacked form: codes (R, bytes), tensors (R, ...), scales (R, T)."""
    dtype = compress.FP8_FORMATS[fmt][0]
    per_rank = math.prod(scales.shape[:-1])
    values = codes.view(dtype).float().split([t.numel() // per_rank for t in tensors], dim=-1)
    return [(v / (s * world)[..., None]).view(t.shape)
            for v, s, t in zip(values, scales.unbind(-1), tensors)]


def saturated_fraction(summed, tensors, fmt):
    """(T,) each tensor's fraction of summed codes at +-max: the published fragility score."""
    dtype, fmax = compress.FP8_FORMATS[fmt]
    magnitudes = summed.view(dtype).float().abs_().split([t.numel() for t in tensors])
    return torch.stack([(m >= fmax).float().mean() for m in magnitudes])


def all_reduce_fp8_sum(tensors, fmt="e5m2", group=None, order="ring", local_scales=False,
                       score=True):
    """The paper's collective: returns (means, bytes_sent, local, saturated).

    local: this rank's own round trip (its codes decoded with its scale), for error feedback.
    saturated: (T,) fraction of each tensor's summed codes at +-max (the fragility profile);
    None with score=False, for the steps that do not profile (the score reads every code again).
    local_scales=True reproduces the published defect: every rank encodes with and decodes by
    its OWN amax (no MAX all-reduce), so the ranks decode the same sum into different means."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    amax = torch.stack([t.detach().abs().amax().float() for t in tensors])     # (T,)
    if world > 1 and not local_scales:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    codes, scales = fp8_sum_encode(tensors, fmt, amax)
    dtype = compress.FP8_FORMATS[fmt][0]
    local = fp8_sum_decode(codes, tensors, scales, fmt)
    if world == 1:
        summed = codes
    elif codes.is_cuda:   # NCCL's native float8 sum (fp16 adds, saturating), in its own order
        summed = codes.view(dtype)
        try:
            dist.all_reduce(summed, group=group)
        except RuntimeError as e:
            raise RuntimeError("this torch/NCCL cannot all_reduce float8 tensors (needs NCCL >= "
                               "2.24 and a GPU of compute capability >= 9.0); use the two-stage "
                               f"collective (--collective=two-stage) instead: {e}") from None
        summed = summed.view(torch.uint8)
    else:                 # gloo has no float8 sum: gather every rank's codes, add them as NCCL would
        gathered = codes.new_empty(world * codes.numel())
        compress.all_gather_flat(gathered, codes, group=group)
        summed = fp8_sum(gathered.view(world, -1), dtype, order)
    means = fp8_sum_decode(summed, tensors, scales, fmt, world)
    sent = wire_bytes(codes.numel(), len(tensors), world, local_scales)
    return means, sent, local, saturated_fraction(summed, tensors, fmt) if score else None


def wire_bytes(numel, num_tensors, world, local_scales=False):
    """Bytes one rank sends: the codes' all_reduce and, unless every rank keeps its own scales,
    the amax MAX all-reduce before it (one fp32 per tensor). Ring estimates."""
    scales = 0 if local_scales else ring_allreduce_bytes(num_tensors, 4, world)
    return ring_allreduce_bytes(numel, 1, world) + scales


def simulate_fp8_sum(worker_tensors, fmt="e5m2", order="ring", local_scales=False, score=True):
    """The numerics of all_reduce_fp8_sum for W workers in one process - exactly those of its
    gloo emulation (NCCL adds in its own chunk order and algorithm). Returns (means
    as worker 0 decodes them, bytes per rank, per-worker local round trips, saturated)."""
    world = len(worker_tensors)
    stacked = [torch.stack(ts) for ts in zip(*worker_tensors)]         # (W, ...) per tensor
    amaxes = torch.stack([t.reshape(world, -1).abs().amax(1).float() for t in stacked], 1)
    shared = amaxes.amax(0)                                            # (T,), as the MAX gives
    codes, scales = fp8_sum_encode(stacked, fmt, amaxes if local_scales else
                                   shared.expand(world, -1))           # (W, bytes), (W, T)
    dtype = compress.FP8_FORMATS[fmt][0]
    summed = fp8_sum(codes, dtype, order)
    means = fp8_sum_decode(summed, worker_tensors[0], scales[0], fmt, world)
    local = [list(ts) for ts in zip(*fp8_sum_decode(codes, stacked, scales, fmt))]
    sent = wire_bytes(codes.shape[1], len(worker_tensors[0]), world, local_scales)
    saturated = saturated_fraction(summed, worker_tensors[0], fmt) if score else None
    return means, sent, local, saturated
