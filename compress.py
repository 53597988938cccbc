"""
GeoFP8: geometry-aware FP8 gradient communication, in one readable file.

The problem
-----------
Data-parallel training averages the W ranks' gradients every step. Sending them in FP8 instead
of bf16 halves the bytes. FP8 is floating point with 3 (e4m3) or 2 (e5m2) mantissa bits, so every
element keeps ~6 % (e4m3) precision *of its own magnitude*, and a block of elements shares one
fp32 scale that maps the block's largest magnitude onto the format's largest value.

LLM weight gradients are strongly anisotropic: a few left/right singular directions carry most of
the energy. In the original ("Euclidean") coordinates every element is the sum of a large
dominant part and a small bulk part, so every element's rounding error is ~6 % of the *dominant*
part, spread over all m*n elements and all directions - it swamps the small directions.

The idea
--------
Send the gradient G (m x n) in coordinates aligned with its dominant subspaces:

    encode:  H = P^T G Q        P (m x m), Q (n x n) orthogonal, shared by all ranks
    reduce:  the usual FP8 collective on H
    decode:  G_mean = P H_mean Q^T

P's first r columns span the top-r left singular subspace of recent *averaged* gradients, Q's
the right one. The dominant energy of G lands in the r x r top-left corner of H, and, because we
rotate the bases so that this corner is (nearly) diagonal for the latest mean gradient, each of
the first r rows of H has one large entry. That entry is the amax of its scaling block - and the
block amax is encoded *exactly* (it maps onto the format's max value by the fp32 scale). So the
dominant energy travels almost without error, and everything else (the bulk, now in the rest of
H) keeps FP8's relative precision of its *own* size. Because P and Q are orthogonal, the
quantization error is not amplified on the way back: ||P E Q^T|| = ||E||. Because they are
identical on every rank and the map is linear, reducing in coordinates and decoding once equals
decoding each and reducing.

P and Q are never formed: r Householder reflectors complete the r dominant vectors U to an
orthogonal matrix, P = H_1 ... H_r = I - Y T Y^T (compact WY form, Y m x r, T r x r), so applying
P or P^T costs ~4 m n r flops and O(m r) memory. Unlike a random or Hadamard rotation, the
Householder completion leaves the complement close to the original axes, so axis-aligned
structure (an outlier column) stays local where block scales handle it.

Where the bases come from: every rank holds the same decoded mean gradient after each step. A
warm-started subspace iteration on it (optionally an EMA of its covariance), followed by a
Rayleigh-Ritz rotation, refreshes U and V every `refresh` steps. The local gradient of a rank is
never used, so every rank computes the same bases (verified by a checksum). Under FSDP a rank
holds only a block of rows of the mean; the same iteration runs with its partial products
summed over ranks (RowBlocks), and the decode needs one small r x n sum (decode_geo_rows).

Not every matrix gains: 1-D tensors, small tensors and the vocabulary dimension of the embedding
and output head stay Euclidean, and each remaining matrix switches to geometry-aware coordinates
only when its measured codec error is lower there (with hysteresis).

The collective (same for Euclidean FP8 and GeoFP8)
--------------------------------------------------
    quantize this rank's tensors, cut into W shards  -> all_to_all (uint8, scales inline)
    each rank decodes the W copies of its shard, sums them in fp32, divides by W
    re-quantizes its averaged shard                  -> all_gather
    every rank decodes the same bytes                -> bit-identical results everywhere
Wire bytes per rank ~ 2 (W-1)/W N (1 + 4/block) versus 2 (W-1)/W N 2 for a bf16 ring all-reduce:
~0.516x at block 128. `simulate_mean` runs exactly the same numerics in one process.

Reading order: codecs (quantize/dequantize), the collective, the transform, geometry estimation,
and the communicator that train.py calls once per step. Functions marked @hot_path run through
torch.compile after compile_hot_path() (train.py --compile); the numbers are the same.
"""

import contextlib
import functools
import math
import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# =============================================================================
# 1. Codecs: FP8 (e4m3, e5m2) and NVFP4, with tensor / row / block scaling
# =============================================================================

FP8_FORMATS = {  # name -> (torch dtype, largest finite value)
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}
FP8_MAX_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}  # largest finite magnitude
FORMATS = ("e4m3", "e5m2", "nvfp4")
NVFP4_BLOCK = 16        # NVFP4 always scales blocks of 16 values; `block` does not apply to it
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the 8 magnitudes of a 4-bit e2m1 value
FP32_MAX = torch.finfo(torch.float32).max


@dataclass
class Quantized:
    """A quantized tensor: `buffer` is the uint8 wire buffer (scales first, then the payload)."""
    buffer: torch.Tensor    # (nbytes,) uint8
    shape: torch.Size
    fmt: str
    block: object           # int, "row" or "tensor"

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


class hot_path:
    """A function of the codec / transform hot path: run eagerly, or - after compile_hot_path(),
    which train.py --compile calls - through torch.compile(dynamic=False). The codec is a chain
    of small elementwise kernels (abs, amax, divide, clamp, cast) that inductor fuses. Fixed
    shapes: each distinct shape compiles once, on first use; a training run sees a fixed set of
    shapes (its buckets' pieces), all in its first steps."""
    enabled = False

    def __init__(self, fn):
        self.fn, self.compiled = fn, None
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        if not hot_path.enabled:
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=False)
        return self.compiled(*args)


def compile_hot_path(enabled=True):
    """Switch the codec and transform kernels between torch.compile (True) and eager (False)."""
    hot_path.enabled = enabled
    if enabled:  # one compile per distinct shape: allow for the dozens of a real model's pieces
        import torch._dynamo
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


@functools.lru_cache(maxsize=None)
def on_device(constant, device):
    """A constant tensor (or tuple of tensors, or tuple of numbers) on `device`, made once: built
    or copied from host memory at every call instead, each copy would make a GPU stream wait."""
    if isinstance(constant, tuple) and isinstance(constant[0], torch.Tensor):
        return tuple(t.to(device) for t in constant)
    return torch.tensor(constant, device=device)


def check_codec(fmt, block):
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt != "nvfp4" and not (block in ("row", "tensor") or (isinstance(block, int) and block > 0)):
        raise ValueError(f"block must be a positive int, 'row' or 'tensor', got {block!r}")


def scale_groups(x, block):
    """View x as (groups, group_len) fp32: one scale per group. Integer blocks pad the flattened
    tensor with zeros to a whole number of blocks (the padding is never sent)."""
    flat = x.reshape(-1).float()
    if block == "tensor":
        return flat.view(1, -1)
    if block == "row":
        return flat.view(x.shape[0] if x.dim() >= 2 else 1, -1)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def num_groups(shape, block):
    numel = math.prod(shape)
    if block == "tensor":
        return 1
    if block == "row":
        return shape[0] if len(shape) >= 2 else 1
    return -(-numel // block)


def wire_nbytes(shape, fmt, block):
    """Exact size of quantize(x of this shape).buffer."""
    numel = math.prod(shape)
    if numel == 0:
        return 0
    if fmt == "nvfp4":  # fp32 tensor scale + one e4m3 scale per 16 values + two values per byte
        return 4 + num_groups(shape, NVFP4_BLOCK) + (numel + 1) // 2
    return 4 * num_groups(shape, block) + numel  # fp32 scale per group + one byte per value


def round_to_fp8(y, dtype, stochastic=False, generator=None):
    """Cast y (already within the format's range) to an fp8 dtype. Round-to-nearest-even by
    default; stochastically, each value rounds to one of its two fp8 neighbours with probability
    proportional to closeness, so the rounding is unbiased: E[decode] = y."""
    nearest = y.to(dtype)
    if not stochastic:
        return nearest
    # the other neighbour of y: one step away from `nearest` on the far side of y, found by
    # stepping the 7-bit magnitude code (fp8 magnitudes are ordered like their codes)
    max_code = FP8_MAX_CODE[dtype]
    near_val = nearest.float()
    mag = (nearest.view(torch.uint8) & 0x7F).int()
    overshoot = near_val.abs() > y.abs()
    other_mag = torch.where(overshoot, mag - 1, (mag + 1).clamp(max=max_code)).clamp(min=0)
    sign = torch.where(y < 0, 0x80, 0)
    other = (other_mag | sign).to(torch.uint8).view(dtype)
    gap = (other.float() - near_val).abs()
    p_other = torch.where(gap > 0, (y - near_val).abs() / gap, torch.zeros_like(y))
    draw = torch.rand(y.shape, generator=generator, device=y.device)
    return torch.where(draw < p_other, other, nearest.view(torch.uint8).view(dtype))


def round_to_e2m1(y, stochastic=False, generator=None):
    """4-bit codes (sign << 3 | magnitude index into E2M1_GRID) of y, |y| <= 6."""
    grid = on_device(E2M1_GRID, y.device)
    a = y.abs()
    if stochastic:
        low = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 6)   # grid[low] <= a
        lo, hi = grid[low], grid[low + 1]
        p_up = ((a - lo) / (hi - lo)).clamp(0, 1)
        draw = torch.rand(a.shape, generator=generator, device=y.device)
        idx = low + (draw < p_up).long()
    else:
        # nearest, ties to the even code: ties at 0.25, 1.25, 2.5, 5 round down, at 0.75, 1.75,
        # 3.5 round up (the even codes are 0, 1, 2, 4)
        ties_down = on_device((0.25, 1.25, 2.5, 5.0), y.device)
        ties_up = on_device((0.75, 1.75, 3.5), y.device)
        idx = (a[..., None] > ties_down).sum(-1) + (a[..., None] >= ties_up).sum(-1)
    return (idx | torch.where(y < 0, 8, 0)).to(torch.uint8)


def quantize(x, fmt="e4m3", block=128, stochastic=False, generator=None) -> Quantized:
    """Quantize x into one uint8 wire buffer.

    e4m3 / e5m2: each group (block of `block` flattened elements, a row, or the whole tensor)
    gets scale s = fmax / amax; values are cast as torch casts x * s, saturated at +-fmax.
    Wire: [s per group, fp32][one fp8 byte per element].
    nvfp4: blocks of 16, e2m1 values, e4m3 block scales, one fp32 tensor scale.
    Wire: [tensor scale, fp32][block scale per 16 values, e4m3][two e2m1 values per byte].
    """
    check_codec(fmt, block)
    if fmt == "nvfp4":
        block = NVFP4_BLOCK
    numel = x.numel()
    if numel == 0:
        return Quantized(torch.empty(0, dtype=torch.uint8, device=x.device), x.shape, fmt, block)
    groups = scale_groups(x, block)                                    # (G, L) fp32
    if fmt != "nvfp4":
        dtype, fmax = FP8_FORMATS[fmt]
        if stochastic:
            scale, y = fp8_scale(groups, fmax)
            codes = round_to_fp8(y, dtype, True, generator).view(torch.uint8)
        else:
            scale, codes = fp8_encode(groups, fmax, dtype)
        buffer = torch.cat([scale.view(torch.uint8), codes.reshape(-1)[:numel]])
        return Quantized(buffer, x.shape, fmt, block)
    amax = groups.abs().amax(dim=1)                                    # (G,)
    # nvfp4: the fp32 tensor scale brings the largest block scale to the top of e4m3's range
    tensor_amax = amax.max()
    tensor_scale = torch.where(tensor_amax > 0, tensor_amax / (E2M1_MAX * 448.0),
                               torch.ones_like(tensor_amax)).reshape(1)
    block_scale = (amax / (E2M1_MAX * tensor_scale)).clamp(max=448.0).to(torch.float8_e4m3fn)
    step = block_scale.float() * tensor_scale                          # (G,) decoded block scale
    y = torch.where(step[:, None] > 0, groups / step[:, None], torch.zeros_like(groups))
    codes = round_to_e2m1(y.clamp(-E2M1_MAX, E2M1_MAX), stochastic, generator).reshape(-1)
    codes = codes[:numel]
    if numel % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = codes[0::2] | (codes[1::2] << 4)                           # low nibble first
    buffer = torch.cat([tensor_scale.float().view(torch.uint8),
                        block_scale.view(torch.uint8), packed])
    return Quantized(buffer, x.shape, fmt, block)


def fp8_scale(groups, fmax):
    """Per-group scale s = fmax / amax (1 for all-zero groups) and the scaled, saturated values."""
    amax = groups.abs().amax(dim=1)                                    # (G,)
    scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax)).clamp(max=FP32_MAX)
    return scale, (groups * scale[:, None]).clamp(-fmax, fmax)


@hot_path
def fp8_encode(groups, fmax, dtype):
    """(G, L) fp32 -> scales (G,) fp32 and codes (G, L) uint8, round to nearest even."""
    scale, y = fp8_scale(groups, fmax)
    return scale, y.to(dtype).view(torch.uint8)


@hot_path
def fp8_decode(codes, scale, group_len, dtype):
    """codes (numel,) uint8 and scales (G,) -> (numel,) fp32. The last group may be partial:
    pad it, divide (G, L) by (G, 1), drop the padding. (The same as dividing by the scales
    repeated per element, which torch 2.13's inductor miscompiles on CPU for a partial group.)"""
    values = codes.view(dtype).float()
    groups = torch.nn.functional.pad(values, (0, (-values.numel()) % group_len)).view(-1, group_len)
    return (groups / scale[:, None]).reshape(-1)[: values.numel()]


def as_float32(raw):
    """uint8 bytes -> float32 values. A slice of a wire buffer may start at any byte offset,
    and a tensor view needs 4-byte alignment, so copy when it is not aligned (scales only)."""
    return (raw if raw.storage_offset() % 4 == 0 else raw.clone()).view(torch.float32)


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 tensor of q's shape."""
    numel = math.prod(q.shape)
    if numel == 0:
        return torch.zeros(q.shape, device=q.buffer.device)
    n_groups = num_groups(q.shape, NVFP4_BLOCK if q.fmt == "nvfp4" else q.block)
    if q.fmt != "nvfp4":
        dtype, _ = FP8_FORMATS[q.fmt]
        scale = as_float32(q.buffer[: 4 * n_groups])
        group_len = numel // n_groups if q.block in ("row", "tensor") else q.block
        return fp8_decode(q.buffer[4 * n_groups:], scale, group_len, dtype).view(q.shape)
    tensor_scale = as_float32(q.buffer[:4])
    block_scale = q.buffer[4: 4 + n_groups].view(torch.float8_e4m3fn).float()
    packed = q.buffer[4 + n_groups:]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel].long()
    grid = on_device(E2M1_GRID, packed.device)
    values = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    step = (block_scale * tensor_scale).repeat_interleave(NVFP4_BLOCK)[:numel]
    return (values * step).view(q.shape)


# =============================================================================
# 2. The collective: quantize -> all_to_all -> fp32 reduce -> re-quantize -> all_gather
# =============================================================================

@dataclass
class Piece:
    """The part of one tensor that one rank owns in the reduce-scatter: a contiguous range of
    whole scale groups, so that cutting into shards never changes what is quantized together."""
    tensor: int     # index into the bucket
    start: int      # flat element range [start, end)
    end: int
    shape: tuple    # how the piece is quantized (rows x row_len for row scaling, else flat)
    block: object
    nbytes: int


class ShardLayout:
    """How a bucket of tensors is cut into W shards. Rank j owns, of every tensor, the j-th
    contiguous range of its scale groups (blocks or rows). With "tensor" scaling each tensor is
    cut into W equal ranges, each with one scale (a single scale per tensor would force one rank
    to own the whole tensor and unbalance the all_gather). Tensors with fewer groups than ranks
    are spread by rotating which rank gets the remainder. The layout depends only on the shapes,
    so every rank computes the same one."""

    def __init__(self, shapes, fmt, block, world_size):
        check_codec(fmt, block)
        block = NVFP4_BLOCK if fmt == "nvfp4" else block
        self.shapes, self.fmt, self.world_size = [tuple(s) for s in shapes], fmt, world_size
        self.pieces = [[] for _ in range(world_size)]
        for t, shape in enumerate(self.shapes):
            numel = math.prod(shape)
            if isinstance(block, int):                      # blocks of `block` elements
                group_len, piece_block = block, block
            elif block == "row" and len(shape) >= 2:        # whole rows
                group_len, piece_block = (numel // shape[0] if shape[0] else 0), "row"
            else:  # "tensor" (or "row" of a 1-D tensor): one scale per tensor per shard
                group_len, piece_block = -(-numel // world_size), "tensor"
            n_groups = -(-numel // group_len) if group_len else 0
            base, extra = divmod(n_groups, world_size)
            first = 0
            for j in range(world_size):
                count = base + ((j - t) % world_size < extra)
                start, end = first * group_len, min(numel, (first + count) * group_len)
                first += count
                if end <= start:
                    continue
                piece_shape = (count, group_len) if piece_block == "row" else (end - start,)
                self.pieces[j].append(Piece(t, start, end, piece_shape, piece_block,
                                            wire_nbytes(piece_shape, fmt, piece_block)))
        self.nbytes = [sum(p.nbytes for p in pieces) for pieces in self.pieces]


@functools.lru_cache(maxsize=64)
def shard_layout(shapes, fmt, block, world_size):
    """The ShardLayout of a bucket, built once per (shapes, format, world size): it depends on
    nothing else, and the collective asks for the same one every step."""
    return ShardLayout(shapes, fmt, block, world_size)


def encode_shards(tensors, layout, stochastic=False, generator=None):
    """Stage 1: quantize this rank's tensors. Returns one uint8 buffer per destination rank."""
    flats = [t.reshape(-1) for t in tensors]
    buffers = []
    for pieces in layout.pieces:
        parts = [quantize(flats[p.tensor][p.start:p.end].view(p.shape), layout.fmt, p.block,
                          stochastic, generator).buffer for p in pieces]
        buffers.append(torch.cat(parts) if parts else flats[0].new_empty(0, dtype=torch.uint8))
    return buffers


def decode_pieces(buffer, pieces, fmt):
    """The fp32 values of each piece packed in one buffer, in order."""
    out, offset = [], 0
    for p in pieces:
        out.append(dequantize(Quantized(buffer[offset: offset + p.nbytes], p.shape, fmt, p.block)))
        offset += p.nbytes
    return out


def sum_pieces(received, pieces, fmt):
    """Decode the W received copies of the same pieces (one buffer per source rank, in rank
    order) and sum them in fp32. The fixed order makes the simulator and every rank sum
    identically. Returns one fp32 tensor per piece."""
    total = None
    for buffer in received:
        values = decode_pieces(buffer, pieces, fmt)
        total = values if total is None else [a + b for a, b in zip(total, values)]
    return total


def reduce_shard(received, layout, shard, stochastic=False, generator=None):
    """Stage 2, on the rank that owns `shard`: decode the W copies (one per source rank, in rank
    order), sum in fp32, divide by W, re-quantize. Returns the shard's uint8 buffer."""
    pieces = layout.pieces[shard]
    total = sum_pieces(received, pieces, layout.fmt)
    parts = [quantize(v / layout.world_size, layout.fmt, p.block, stochastic, generator).buffer
             for v, p in zip(total, pieces)]
    return torch.cat(parts) if parts else received[0].new_empty(0)


def decode_shards(shard_buffers, layout, device=None):
    """Stage 3: assemble full fp32 tensors from the W shard buffers (identical on all ranks)."""
    device = device or shard_buffers[0].device
    flats = [torch.zeros(math.prod(s), device=device) for s in layout.shapes]
    for buffer, pieces in zip(shard_buffers, layout.pieces):
        for p, values in zip(pieces, decode_pieces(buffer, pieces, layout.fmt)):
            flats[p.tensor][p.start:p.end] = values.reshape(-1)
    return [f.view(s) for f, s in zip(flats, layout.shapes)]


@functools.lru_cache(maxsize=64)
def wire_buffers(layout, rank, device):
    """The collective's uint8 wire buffers for one bucket layout, allocated once and reused
    every step: what this rank sends in the all_to_all, what it receives, and the all_gather's
    W slots (each padded to the largest shard). Reuse is safe because every use is ordered:
    synchronous on CPU, and on GPU all uses of a bucket run on one stream, in order."""
    send = torch.empty(sum(layout.nbytes), dtype=torch.uint8, device=device)
    recv = torch.empty(layout.world_size * layout.nbytes[rank], dtype=torch.uint8, device=device)
    gathered = torch.zeros(layout.world_size, max(layout.nbytes), dtype=torch.uint8, device=device)
    return send, recv, gathered


def rng(seed, rank, stage, device):
    """The stochastic-rounding stream of one rank and stage; the simulator uses the same ones."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + rank * 101 + stage) % (2 ** 63))
    return generator


def collective_bytes(layout, rank):
    """Bytes `rank` sends: its shards for the others in the all_to_all, then its averaged shard
    (padded to the largest shard, as all_gather needs equal sizes) to the W - 1 others."""
    stage1 = sum(wire_nbytes(p.shape, layout.fmt, p.block)
                 for j, pieces in enumerate(layout.pieces) if j != rank for p in pieces)
    return stage1 + (layout.world_size - 1) * max(layout.nbytes)


class StageTimer:
    """Wall time per stage, for benchmarks: timer.stage("name") is a context manager. The
    default (no timer) costs nothing; with one, the device is synchronized at each boundary."""

    def __init__(self):
        self.seconds = {}

    def stage(self, name):
        timer = self

        class _Stage:
            def __enter__(self):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t0
        return _Stage()


NO_TIMER = type("NoTimer", (), {"stage": staticmethod(lambda name: contextlib.nullcontext())})()


def all_reduce_mean(tensors, fmt="e4m3", block=128, group=None, stochastic=False, seed=None,
                    return_local=False, timer=NO_TIMER):
    """The mean of `tensors` over the process group, through the two-stage FP8 collective.

    Returns (means, bytes_sent) - or (means, bytes_sent, local) with return_local, where local
    is this rank's own stage-1 reconstruction (for error feedback). Bit-identical on all ranks.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    me = dist.get_rank(group) if dist.is_initialized() else 0
    device = tensors[0].device
    layout = shard_layout(tuple(tuple(t.shape) for t in tensors), fmt, block, world)
    seed = seed if stochastic else None
    with timer.stage("quantize"):
        send = encode_shards(tensors, layout, stochastic, rng(seed, me, 1, device))
    local = decode_shards(send, layout) if return_local else None
    if world == 1:
        shard = reduce_shard(send, layout, 0, stochastic, rng(seed, me, 2, device))
        means, sent = decode_shards([shard], layout), 0
    else:
        own = layout.nbytes[me]
        flat_send, recv, gathered = wire_buffers(layout, me, device)
        torch.cat(send, out=flat_send)
        with timer.stage("all_to_all"):
            dist.all_to_all_single(recv, flat_send, [own] * world,
                                   [b.numel() for b in send], group=group)
        with timer.stage("reduce"):
            shard = reduce_shard(list(recv.split(own)), layout, me, stochastic,
                                 rng(seed, me, 2, device))
        slots = list(gathered.unbind())           # slot j receives rank j's averaged shard
        slots[me][:own] = shard
        with timer.stage("all_gather"):
            dist.all_gather(slots, slots[me], group=group)
        with timer.stage("decode"):
            means = decode_shards([g[:n] for g, n in zip(slots, layout.nbytes)], layout)
        sent = collective_bytes(layout, me)
    return (means, sent, local) if return_local else (means, sent)


def simulate_mean(worker_tensors, fmt="e4m3", block=128, stochastic=False, seed=None,
                  return_local=False):
    """Exactly the numerics of all_reduce_mean, in one process: worker_tensors[i] is rank i's
    list of tensors. Returns (means, bytes sent per rank on average[, per-worker local])."""
    world = len(worker_tensors)
    device = worker_tensors[0][0].device
    layout = shard_layout(tuple(tuple(t.shape) for t in worker_tensors[0]), fmt, block, world)
    seed = seed if stochastic else None
    sends = [encode_shards(ts, layout, stochastic, rng(seed, i, 1, device))
             for i, ts in enumerate(worker_tensors)]
    shards = [reduce_shard([sends[i][j] for i in range(world)], layout, j, stochastic,
                           rng(seed, j, 2, device)) for j in range(world)]
    means = decode_shards(shards, layout)
    sent = 0 if world == 1 else sum(collective_bytes(layout, i) for i in range(world)) / world
    if return_local:
        return means, sent, [decode_shards(s, layout) for s in sends]
    return means, sent


# =============================================================================
# 3. The transform: orthogonal bases completed from r vectors by Householder reflectors
# =============================================================================

@dataclass
class HouseholderBasis:
    """P = H_1 H_2 ... H_r = I - Y T Y^T, an m x m orthogonal matrix whose first r columns are
    +-U (the r orthonormal columns it was built from). Y (m x r) holds the reflector vectors
    (unit lower trapezoidal), T (r x r) is upper triangular: the compact WY form. Applying P or
    P^T to an m x n matrix costs ~4 m n r flops; P itself (m x m) is never formed."""
    Y: torch.Tensor
    T: torch.Tensor

    @classmethod
    def complete(cls, U):
        a, tau = torch.geqrf(U)              # U = (H_1 ... H_r) R, reflectors stored below diag
        m, r = U.shape
        Y = torch.tril(a, -1) + torch.eye(m, r, device=U.device, dtype=U.dtype)
        if bool((tau != 0).all()):
            # the "UT transform": T^-1 = diag(1/tau) + strictly-upper(Y^T Y), one small solve
            T_inv = torch.diag(1 / tau) + torch.triu(Y.T @ Y, diagonal=1)
            eye = torch.eye(r, device=U.device, dtype=U.dtype)
            return cls(Y, torch.linalg.solve_triangular(T_inv, eye, upper=True))
        T = torch.zeros(r, r, device=U.device, dtype=U.dtype)
        for i in range(r):  # a reflector is the identity (tau = 0): LAPACK's larft recurrence
            T[i, i] = tau[i]
            if i:
                T[:i, i] = -tau[i] * (T[:i, :i] @ (Y[:, :i].T @ Y[:, i]))
        return cls(Y, T)

    def apply_t(self, X):
        """P^T X for X (m, n)."""
        return reflect(X, self.Y, self.T.T)

    def apply(self, X):
        """P X for X (m, n)."""
        return reflect(X, self.Y, self.T)

    def columns(self):
        """The r vectors the basis was completed from (up to sign): P's first r columns."""
        m, r = self.Y.shape
        return self.apply(torch.eye(m, r, device=self.Y.device, dtype=self.Y.dtype))


@hot_path
def reflect(X, Y, T):
    """(I - Y T Y^T) X: three thin matrix products, never the m x m matrix."""
    return X - Y @ (T @ (Y.T @ X))


def encode_geo(G, left, right):
    """H = P^T G Q. `left`/`right` are HouseholderBasis, dense orthogonal matrices (full mode and
    ablations), or None (that side stays in original coordinates)."""
    H = G
    if isinstance(left, HouseholderBasis):
        H = left.apply_t(H)
    elif left is not None:
        H = left.T @ H
    if isinstance(right, HouseholderBasis):
        H = right.apply_t(H.T).T             # G Q = (Q^T G^T)^T
    elif right is not None:
        H = H @ right
    return H


def decode_geo(H, left, right):
    """G = P H Q^T, the inverse of encode_geo."""
    G = H
    if isinstance(right, HouseholderBasis):
        G = right.apply(G.T).T               # H Q^T = (Q H^T)^T
    elif right is not None:
        G = G @ right.T
    if isinstance(left, HouseholderBasis):
        G = left.apply(G)
    elif left is not None:
        G = left @ G
    return G


def decode_geo_rows(matrices):
    """decode_geo when each rank holds only a block of rows of H (FSDP; see RowBlocks), for
    Householder bases. `matrices` is a list of (H_rows, left, right, rows), typically all of one
    FSDP module's rotated matrices. The right side acts on each row alone: K = H Q^T row by row.
    The left side mixes rows only through r directions: (P K)_j = K_j - Y_j T (Y^T K), and
    Y^T K (r x n) is the sum over ranks of Y_j^T K_j: r n numbers against the m n / W of the
    block, summed for all the matrices in one all-reduce. Returns each matrix's rows of G."""
    Ks = [right.apply(H.T).T if right is not None else H for H, _, right, _ in matrices]
    lefts = [(k, rows.mine(left.Y), left.T) for k, (_, left, _, rows) in enumerate(matrices)
             if left is not None]                                  # Y_j: (rows here, r)
    if lefts:
        rows = matrices[0][3]
        totals = rows.sum_all([Y.T @ Ks[k] for k, Y, _ in lefts])  # Y^T K of each, (r, n)
        for (k, Y, T), YtK in zip(lefts, totals):
            Ks[k] = Ks[k] - Y @ (T @ YtK)
    return Ks


def core_swaps(shape, r, block):
    """Flat index pairs (a, b) whose exchange gives every entry of the r x r core of H its own
    scaling block. The block amax is the one value FP8 encodes exactly (it maps onto the format's
    max), so a dominant coordinate alone in its block travels without error. The diagonal entry
    of a core row keeps its place; the other core entries are exchanged with the first element
    of blocks, from the end of H, that hold no core entry. A permutation is orthogonal, so it
    is part of the change of coordinates; it is its own inverse. Empty with tensor scaling."""
    m, n = shape
    if block == "tensor":
        return None
    group_len = n if block == "row" else block
    n_groups = -(-m * n // group_len)
    by_group = {}
    for i in range(min(r, m)):
        for j in range(min(r, n)):
            by_group.setdefault((i * n + j) // group_len, []).append((i != j, i * n + j))
    move = [flat for entries in by_group.values() for _, flat in sorted(entries)[1:]]
    free = [g * group_len for g in reversed(range(n_groups)) if g not in by_group][: len(move)]
    if not free:
        return None
    return (torch.tensor(move[: len(free)], dtype=torch.long), torch.tensor(free, dtype=torch.long))


def swap_entries(H, swaps):
    """Exchange the flat entries swaps[0][k] <-> swaps[1][k] of H (a copy)."""
    if swaps is None:
        return H
    a, b = on_device(swaps, H.device)
    flat = H.reshape(-1).clone()
    flat[a], flat[b] = flat[b], flat[a].clone()
    return flat.view(H.shape)


def swap_entries_rows(matrices):
    """swap_entries on this rank's block of rows of H (FSDP; see RowBlocks), for a list of
    (H_rows, swaps, rows). A pair may join two blocks (core entries sit in the first rows,
    their partners in the last), so every rank contributes the values at the swapped positions
    it holds, one all-reduce (2 s numbers per matrix, all matrices at once) shares them, and
    every rank writes each of its positions' partner value."""
    out, writes, contributions, group_rows = [], [], [], None
    for H_rows, swaps, rows in matrices:
        if swaps is None or not rows.sharded:
            out.append(swap_entries(H_rows, swaps))
            continue
        first = rows.start * H_rows.shape[1]                # flat index of this block's start
        positions = torch.cat(on_device(swaps, H_rows.device))  # (2 s,): all a's, then all b's
        held = (positions >= first) & (positions < first + H_rows.numel())
        local = positions[held] - first                     # the swapped positions held here
        flat = H_rows.reshape(-1).clone()
        values = flat.new_zeros(positions.numel())
        values[held] = flat[local]
        out.append(flat.view(H_rows.shape))
        writes.append((flat, held, local))
        contributions.append(values)
        group_rows = rows
    if writes:
        for (flat, held, local), values in zip(writes, group_rows.sum_all(contributions)):
            partner = values.roll(values.numel() // 2)      # a_k <-> b_k
            flat[local] = partner[held]
    return out


# =============================================================================
# 4. Geometry estimation from decoded mean gradients
# =============================================================================

def orthonormal(A):
    return torch.linalg.qr(A).Q


class RowBlocks:
    """Where the rows of a gradient G (m x n) live while its geometry is estimated.

    By default (DDP, train.py) every rank holds all of G and every method below is the identity.
    Under FSDP each rank holds only a block of rows: rank j has rows [j c, (j + 1) c) of G, with
    c = ceil(m / W) (FSDP's dim-0 sharding). The subspace iteration is then the same algebra with
    two collectives: `sum` adds the rank's partial products (G^T U = sum_j G_j^T U_j is an n x r
    all-reduce) and `gather` assembles an m x r matrix from its row blocks. Bases (U, V) are
    always held whole, so every rank completes the same Householder basis from them."""

    def __init__(self, m=None, group=None):
        self.sharded = m is not None and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = group
        if self.sharded:
            world, me = dist.get_world_size(group), dist.get_rank(group)
            self.m, self.per_rank = m, -(-m // world)
            self.start, self.end = min(m, me * self.per_rank), min(m, (me + 1) * self.per_rank)

    def mine(self, X):
        """This rank's rows of a whole m x k matrix."""
        return X[self.start: self.end] if self.sharded else X

    def sum(self, x):
        """The sum over ranks of a partial product (all ranks get the same result)."""
        return self.sum_all([x])[0]

    def sum_all(self, parts):
        """sum() of several partial products (any shapes) with one all-reduce."""
        if not self.sharded:
            return parts
        flat = torch.cat([p.reshape(-1) for p in parts])
        dist.all_reduce(flat, group=self.group)
        return [f.view(p.shape) for f, p in zip(flat.split([p.numel() for p in parts]), parts)]

    def gather(self, X_rows):
        """The whole m x k matrix from every rank's block of rows."""
        if not self.sharded:
            return X_rows
        padded = X_rows.new_zeros(self.per_rank, X_rows.shape[1])
        padded[: X_rows.shape[0]] = X_rows
        blocks = [torch.empty_like(padded) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(blocks, padded, group=self.group)
        return torch.cat(blocks)[: self.m]


ALL_ROWS = RowBlocks()


def update_subspaces(G, U, V, left_energy, right_energy, decay=0.0, iters=1, rows=ALL_ROWS):
    """One refresh of the dominant subspaces of G (m x n), warm-started from U (m x r), V (n x r).

    With decay = 0 this is subspace iteration on G G^T and G^T G. With decay > 0 it iterates on
    an exponential moving average of the covariances, C = decay * U diag(e) U^T + (1-decay) G G^T,
    represented by the previous bases and their energies e (r numbers per side): memory stays
    O(r (m + n)). A Rayleigh-Ritz step then rotates U and V so that U^T G V is diagonal, with
    the largest entry first: in coordinates every dominant row of H has one large entry.
    G may be this rank's block of rows only (see RowBlocks); U and V are always whole.
    Returns (U, V, left_energy, right_energy)."""
    for _ in range(iters):
        A = (1 - decay) * (G @ rows.sum(G.T @ rows.mine(U)))          # rows of G G^T U
        B = (1 - decay) * rows.sum(G.T @ (G @ V))                     # G^T G V
        if decay > 0:
            A = A + decay * rows.mine(U) * left_energy
            B = B + decay * V * right_energy
        U_new, V_new = orthonormal(rows.gather(A)), orthonormal(B)
        # Rayleigh quotients of the (EMA) covariance in the new bases: the new energies
        left_energy = ((1 - decay) * rows.sum(G.T @ rows.mine(U_new)).pow(2).sum(0)
                       + decay * ((U.T @ U_new).pow(2) * left_energy[:, None]).sum(0))
        right_energy = ((1 - decay) * rows.sum((G @ V_new).pow(2).sum(0))
                        + decay * ((V.T @ V_new).pow(2) * right_energy[:, None]).sum(0))
        U, V = U_new, V_new
    a, _, bh = torch.linalg.svd(rows.sum(rows.mine(U).T @ G @ V))    # r x r: negligible cost
    U, V = U @ a, V @ bh.T
    left_energy = ((1 - decay) * rows.sum(G.T @ rows.mine(U)).pow(2).sum(0)
                   + decay * left_energy.sort(descending=True).values)
    right_energy = ((1 - decay) * rows.sum((G @ V).pow(2).sum(0))
                    + decay * right_energy.sort(descending=True).values)
    return U, V, left_energy, right_energy


def initial_subspaces(G, r, seed, iters=4, rows=ALL_ROWS):
    """Cold start: a randomized range finder (seeded identically on every rank) refined by a
    few subspace iterations."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    omega = torch.randn(G.shape[1], r, generator=generator).to(G)
    U = orthonormal(rows.gather(G @ omega))
    V = orthonormal(rows.sum(G.T @ rows.mine(U)))
    zeros = torch.zeros(r, device=G.device, dtype=G.dtype)
    return update_subspaces(G, U, V, zeros, zeros, decay=0.0, iters=iters, rows=rows)


def exact_bases(G):
    """Full mode: the complete singular bases of G, dense. A reference for tests and ablations."""
    U, _, Vh = torch.linalg.svd(G)
    return U, Vh.T


def random_orthogonal(n, seed, device, dtype=torch.float32):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return orthonormal(torch.randn(n, n, generator=generator, dtype=torch.float64)).to(device, dtype)


# =============================================================================
# 5. The communicator: which tensors go geometry-aware, their state, one call per step
# =============================================================================

@dataclass
class GeoOptions:
    fmt: str = "e4m3"
    block: object = 128             # int, "row" or "tensor" (nvfp4 always uses 16)
    geo: bool = True                # False: Euclidean FP8 (same collective, no transform)
    rank: int = 16                  # r, per side, capped at min(m, n) // 2
    refresh: int = 4                # re-estimate the bases every N steps
    warmup: int = 0                 # steps sent in Euclidean coordinates before GeoFP8 starts
    decay: float = 0.0              # EMA of the covariance; 0 = bases from the latest mean only
    iters: int = 1                  # subspace iterations per refresh
    full: bool = False              # exact dense eigenbases (reference / ablation)
    sides: str = "both"             # "both", "left", "right" (ablation)
    basis: str = "householder"      # "householder" or "random" (dense random rotation, ablation)
    scatter_core: bool = True       # give each core coordinate its own scaling block
    min_numel: int = 4096           # smaller matrices are not worth a transform
    enter_gain: float = 1.10        # switch a layer to geo when Euclid error / geo error >= this
    exit_gain: float = 1.00         # ... and back to Euclidean when it falls below this
    error_feedback: bool = False    # keep each rank's stage-1 quantization error, add it back
    stochastic: bool = False        # stochastic rounding
    seed: int = 0
    vocab_size: int = 0             # matrices with a dimension of this size stay Euclidean

    def __post_init__(self):
        check_codec(self.fmt, self.block)
        if self.sides not in ("both", "left", "right"):
            raise ValueError("sides must be 'both', 'left' or 'right'")
        if self.basis not in ("householder", "random"):
            raise ValueError("basis must be 'householder' or 'random'")
        if self.rank < 1 or self.refresh < 1:
            raise ValueError("rank and refresh must be >= 1")


VOCAB_NAME_HINTS = ("embed", "lm_head", "wte", "tok_emb", "output.weight")


def exemption(name, shape, opts):
    """Why a tensor stays Euclidean (a short reason), or None if it is a GeoFP8 candidate."""
    if len(shape) != 2:
        return "not 2-D"
    if (opts.vocab_size and opts.vocab_size in shape) or any(h in name for h in VOCAB_NAME_HINTS):
        return "vocabulary"
    if math.prod(shape) < opts.min_numel:
        return "small"
    return None


@dataclass
class LayerGeometry:
    """Geometry state of one matrix: r (m + n) + 2 r^2 + 2 r numbers. The dominant subspaces
    are kept only in Householder form (U = P[:, :r] up to signs), not a second time as U, V."""
    shape: tuple
    rank: int
    seed: int
    left_basis: HouseholderBasis = None   # P, completed from the (m, r) dominant left subspace
    right_basis: HouseholderBasis = None  # Q, from the (n, r) dominant right subspace
    left_energy: torch.Tensor = None    # (r,)
    right_energy: torch.Tensor = None   # (r,)
    use_geo: bool = False
    gain: float = float("nan")          # last measured Euclidean error / geo error
    energy: float = float("nan")        # fraction of the mean's energy in the r x r core
    transform: tuple = field(default=(None, None), repr=False)  # (left, right), derived
    swaps: tuple = field(default=None, repr=False)              # core_swaps, fixed by shape


class GeoFP8Communicator:
    """Gradient averaging with FP8 (Euclidean or GeoFP8) for a fixed list of named tensors.

    `reduce(grads)` averages across the process group in place (train.py, the DDP hook);
    `reduce_workers(per_worker_grads)` runs the identical numerics for W simulated workers in one
    process (the fidelity tool, tests). Both return the bytes one rank sends."""

    def __init__(self, named_shapes, options=None, group=None, timer=NO_TIMER):
        self.opts = options or GeoOptions()
        self.group = group
        self.timer = timer          # a StageTimer to see where the time goes (benchmarks)
        self.names = [n for n, _ in named_shapes]
        self.shapes = {n: tuple(s) for n, s in named_shapes}
        self.reasons = {}
        self.layers = {}
        for n, shape in named_shapes:
            reason = exemption(n, shape, self.opts) if self.opts.geo else "euclidean mode"
            if reason:
                self.reasons[n] = reason
                continue
            r = min(shape) if self.opts.full else min(self.opts.rank, min(shape) // 2)
            layer = LayerGeometry(tuple(shape), r, seed=zlib.crc32(n.encode()))
            if self.opts.scatter_core and not self.opts.full and self.opts.basis == "householder":
                block = NVFP4_BLOCK if self.opts.fmt == "nvfp4" else self.opts.block
                layer.swaps = core_swaps(shape, r, block)
            self.layers[n] = layer
        self.step = 0
        self.residuals = {}     # worker index -> {name: fp32 residual}, with error feedback

    # -- coordinates ---------------------------------------------------------------------------

    def is_geo(self, name):
        layer = self.layers.get(name)
        return (layer is not None and layer.use_geo and layer.transform[0] is not None
                and self.step > self.opts.warmup)

    def coords(self, name):
        return "geo" if self.is_geo(name) else "euclidean"

    def to_coords(self, name, g):
        if not self.is_geo(name):
            return g
        layer = self.layers[name]
        return swap_entries(encode_geo(g, *layer.transform), layer.swaps)

    def from_coords(self, name, h):
        if not self.is_geo(name):
            return h
        layer = self.layers[name]
        return decode_geo(swap_entries(h, layer.swaps), *layer.transform)

    # -- one step --------------------------------------------------------------------------------

    def _prepare(self, grads, worker):
        """(gradients as sent, in original coordinates; the same in the coordinates in use)."""
        residual = self.residuals.get(worker, {})
        sent = [g.float() + residual[n] if self.opts.error_feedback and n in residual else g.float()
                for n, g in zip(self.names, grads)]
        return sent, [self.to_coords(n, g) for n, g in zip(self.names, sent)]

    def _keep_residual(self, worker, coords, local):
        """Error feedback: the part of this worker's gradient that stage 1 lost, in original
        coordinates (the rotation is orthogonal, so this is exact)."""
        self.residuals[worker] = {n: self.from_coords(n, c - l)
                                  for n, c, l in zip(self.names, coords, local)}

    def _finish(self, mean_coords, worker_grads, all_reduce=None):
        """Decode the averaged coordinates; on refresh steps update the geometry."""
        with self.timer.stage("rotate"):
            means = [self.from_coords(n, h) for n, h in zip(self.names, mean_coords)]
        self.advance(dict(zip(self.names, means)), worker_grads, all_reduce)
        return means

    def advance(self, means, worker_grads, all_reduce=None, rows=None):
        """Count a finished step; on refresh steps update the geometry. `means` maps names to
        decoded mean gradients - under FSDP only this rank's block of rows, described by
        rows[name] (a RowBlocks; whole tensors otherwise)."""
        self.step += 1
        if self.layers and (self.step % self.opts.refresh == 0
                            or any(l.left_basis is None for l in self.layers.values())):
            with self.timer.stage("geometry"):
                self._refresh(means, worker_grads, all_reduce, rows or {})
            if all_reduce is not None and self.step % self.opts.refresh == 0:
                self._verify_bases()

    def reduce(self, grads):
        """Average grads (a list matching the names) across the group, in place. Returns bytes sent."""
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        with self.timer.stage("rotate"):
            sent_grads, coords = self._prepare(grads, rank)
        mean_coords, sent, local = all_reduce_mean(
            coords, self.opts.fmt, self.opts.block, self.group, self.opts.stochastic,
            self.opts.seed * 7919 + self.step, return_local=True, timer=self.timer)
        if self.opts.error_feedback:
            self._keep_residual(rank, coords, local)
        summed = ((lambda t: dist.all_reduce(t, group=self.group)) if dist.is_initialized()
                  else None)
        for g, m in zip(grads, self._finish(mean_coords, [sent_grads], summed)):
            g.copy_(m)
        return sent

    def reduce_workers(self, worker_grads):
        """The same numerics for W simulated workers. Returns (means, bytes sent per rank)."""
        prepared = [self._prepare(g, i) for i, g in enumerate(worker_grads)]
        coords = [c for _, c in prepared]
        mean_coords, sent, local = simulate_mean(coords, self.opts.fmt, self.opts.block,
                                                 self.opts.stochastic,
                                                 self.opts.seed * 7919 + self.step,
                                                 return_local=True)
        if self.opts.error_feedback:
            for i in range(len(coords)):
                self._keep_residual(i, coords[i], local[i])
        return self._finish(mean_coords, [g for g, _ in prepared]), sent

    # -- geometry ----------------------------------------------------------------------------------

    def _codec_error(self, x):
        return (dequantize(quantize(x, self.opts.fmt, self.opts.block)) - x).pow(2).sum().item()

    def _transform(self, layer, mean):
        opts = self.opts
        if opts.basis == "random":
            device = layer.left_basis.Y.device
            left = random_orthogonal(layer.shape[0], layer.seed, device)
            right = random_orthogonal(layer.shape[1], layer.seed + 1, device)
        elif opts.full:
            left, right = exact_bases(mean)
        else:
            left, right = layer.left_basis, layer.right_basis
        return (left if opts.sides in ("both", "left") else None,
                right if opts.sides in ("both", "right") else None)

    def _update_bases(self, layer, mean, rows=ALL_ROWS):
        if layer.left_basis is None:
            U, V, layer.left_energy, layer.right_energy = initial_subspaces(
                mean, layer.rank, layer.seed, rows=rows)
        else:
            U, V, layer.left_energy, layer.right_energy = update_subspaces(
                mean, layer.left_basis.columns(), layer.right_basis.columns(),
                layer.left_energy, layer.right_energy, self.opts.decay, self.opts.iters, rows)
        layer.left_basis, layer.right_basis = HouseholderBasis.complete(U), HouseholderBasis.complete(V)
        layer.transform = self._transform(layer, mean)
        total = rows.sum(mean.pow(2).sum()).item()
        core = rows.sum((rows.mine(U).T @ mean @ V).pow(2).sum()).item()
        layer.energy = core / total if total else 0.0

    def _refresh(self, means, worker_grads, all_reduce=None, rows=None):
        """Update the bases from the decoded mean (identical on every rank) and decide each
        layer's coordinates by measured gain.

        The evidence: the codec's error on the gradients actually being sent, in both coordinate
        systems, with the bases in use - estimated from earlier steps, exactly the situation of
        the next step (out of sample). The decoded mean cannot serve here: it already lies on the
        FP8 grid of the coordinates it was sent in, so it would always favour those. Every rank
        measures its own gradient, one all-reduce sums the errors, and every rank takes the same
        decision. Local gradients are used only for this measurement, never for the bases."""
        opts = self.opts
        names = list(self.layers)
        fresh = [n for n in names if self.layers[n].left_basis is None]
        rows = rows or {}
        for n in fresh:  # a layer's first bases: nothing earlier to judge by, so judge these
            self._update_bases(self.layers[n], means[n], rows.get(n, ALL_ROWS))
        errors = torch.zeros(2, len(names), dtype=torch.float64)
        for k, n in enumerate(names):
            transform = self.layers[n].transform
            for grads in worker_grads:
                g = grads[self.names.index(n)]
                errors[0, k] += self._codec_error(g)
                errors[1, k] += self._codec_error(
                    swap_entries(encode_geo(g, *transform), self.layers[n].swaps))
        if all_reduce is not None:
            device = means[names[0]].device
            errors = errors.to(device)
            all_reduce(errors)
            errors = errors.cpu()
        for k, n in enumerate(names):
            layer = self.layers[n]
            euclid, geo = errors[0, k].item(), errors[1, k].item()
            layer.gain = math.sqrt(euclid / geo) if geo > 0 else (float("inf") if euclid > 0 else 1.0)
            threshold = opts.exit_gain if layer.use_geo else opts.enter_gain
            layer.use_geo = layer.gain >= threshold
            if self.step % opts.refresh == 0 and n not in fresh:
                self._update_bases(layer, means[n], rows.get(n, ALL_ROWS))

    def _checksum(self):
        total = torch.zeros((), dtype=torch.float64)
        for i, layer in enumerate(self.layers.values()):
            if layer.left_basis is not None:
                total += (layer.left_basis.Y.double().sum() * (i + 1)
                          + layer.right_basis.Y.double().sum() * (i + 2)
                          + layer.left_basis.T.double().sum() + layer.right_basis.T.double().sum()
                          + layer.use_geo * 0.5).cpu()
        return total

    def _verify_bases(self):
        """Every rank computed its bases from the same bytes, so they must agree bit for bit.
        One tiny all-reduce checks it; on a mismatch (nondeterministic kernels, say) rank 0's
        state is broadcast and a warning printed."""
        mine = self._checksum()
        device = next(iter(self.layers.values())).left_basis.Y.device
        both = torch.stack([mine, -mine]).to(device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if both[0].item() == mine.item() and -both[1].item() == mine.item():
            return
        print(f"compress.py: warning: GeoFP8 bases differ across ranks at step {self.step}; "
              "using rank 0's", flush=True)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for layer in self.layers.values():
            flags = torch.tensor([float(layer.use_geo)], device=device)
            for t in (layer.left_basis.Y, layer.left_basis.T, layer.right_basis.Y,
                      layer.right_basis.T, layer.left_energy, layer.right_energy, flags):
                dist.broadcast(t, src=src, group=self.group)
            layer.use_geo = bool(flags.item())
            layer.transform = self._transform(layer, None) if not self.opts.full else layer.transform

    # -- reporting and checkpoints -------------------------------------------------------------

    def state_bytes(self):
        """Memory held for geometry (reflectors, energies; dense bases in ablations), in bytes."""
        total = 0
        for layer in self.layers.values():
            tensors = [layer.left_energy, layer.right_energy]
            for basis in (layer.left_basis, layer.right_basis):
                tensors += [basis.Y, basis.T] if basis is not None else []
            tensors += [t for t in layer.transform if isinstance(t, torch.Tensor)]
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return total

    def table(self):
        """Per-layer table: shape, rank, coordinates in use, last measured gain, core energy."""
        lines = [f"{'tensor':40s} {'shape':>12s} {'rank':>4s} {'coords':>10s} {'gain':>6s} {'energy':>6s}"]
        for n in self.names:
            shape = "x".join(map(str, self.shapes[n]))
            if n in self.layers:
                l = self.layers[n]
                lines.append(f"{n:40s} {shape:>12s} {l.rank:4d} {self.coords(n):>10s} "
                             f"{l.gain:6.2f} {l.energy:6.2f}")
            else:
                lines.append(f"{n:40s} {shape:>12s} {'-':>4s} {'euclidean':>10s} "
                             f"{'(' + self.reasons[n] + ')':>13s}")
        return "\n".join(lines)

    def state_dict(self):
        layers = {n: {"left_Y": l.left_basis.Y, "left_T": l.left_basis.T,
                      "right_Y": l.right_basis.Y, "right_T": l.right_basis.T,
                      "left_energy": l.left_energy,
                      "right_energy": l.right_energy, "use_geo": l.use_geo, "gain": l.gain,
                      "energy": l.energy}
                  for n, l in self.layers.items() if l.left_basis is not None}
        residuals = {w: dict(r) for w, r in self.residuals.items()}
        return {"step": self.step, "layers": layers, "residuals": residuals}

    def load_state_dict(self, state):
        self.step = state["step"]
        self.residuals = {w: dict(r) for w, r in state.get("residuals", {}).items()}
        for n, s in state["layers"].items():
            layer = self.layers[n]
            layer.left_basis = HouseholderBasis(s["left_Y"], s["left_T"])
            layer.right_basis = HouseholderBasis(s["right_Y"], s["right_T"])
            layer.left_energy, layer.right_energy = s["left_energy"], s["right_energy"]
            layer.use_geo, layer.gain, layer.energy = s["use_geo"], s["gain"], s["energy"]
            layer.transform = self._transform(layer, None)
