"""
GeoFP8: geometry-aware FP8 gradient communication, in one readable file.

Two geometries live here side by side, behind one communicator:

  * the published GeoFP8 (arXiv 2607.07494; section 3b): each linear layer's gradient is sent
    in the whitened coordinates of its K-FAC input factor, W~ = W_g F^-T with F F^T = A + damping,
    A = E[a a^T] of the layer's inputs (low-rank + diagonal), and mapped back, W = W~ F^T;
  * this project's variant, the two-sided subspace rotation (section 3), described first below;

with a geometry-agnostic control beside them, the randomized Hadamard transform (section 3c:
random signs, then Walsh-Hadamard blocks along each row; no statistics at all), and two
collectives: this project's two-stage FP8 collective (section 2) and the paper's one
all_reduce SUM of FP8 codes with one scale per tensor (nanogeo/wire/fp8sum.py).

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

The subspace rotation
---------------------
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
Rayleigh-Ritz rotation, refreshes U and V every `geo_refresh` steps. The local gradient of a rank is
never used, so every rank computes the same bases (production checks it). Under FSDP a rank
holds only a block of rows of the mean; the same iteration runs with its partial products
summed over ranks, and the decode needs one small r x n sum (nanogeo/parallel/fsdp.py).

Not every matrix gains (for either geometry): only nn.Linear weights are candidates (found by
module type; embedding tables, tied heads, norms and biases stay Euclidean, an untied head by its
configured vocabulary size), small ones excepted, and each candidate switches to geometry-aware
coordinates only while its codec error *as its optimizer sees it* (section 4b: AdamW's
elementwise update, Muon's Newton-Schulz map) is measurably lower there, with hysteresis. Do no
harm from the first step: a new geometry is measured on the next step's gradients (which did not
build it) before it replaces the coordinates in use (section 5, "candidates").
select="list" (and production's "fragile", the paper's profiled rule) choose which may
switch; the same check still guards them, unless both gains are 0 (the paper's fixed choice;
select="all" likewise).
The subspace rotation also tries the column side alone (sides="auto"): rotating rows spreads
error onto rows whose AdamW second moments may be tiny.

The two-stage collective (this project's default, for every geometry)
---------------------------------------------------------------------
    quantize this rank's tensors, cut into W shards  -> all_to_all (uint8, scales inline)
    each rank decodes the W copies of its shard, sums them in fp32, divides by W
    re-quantizes its averaged shard                  -> all_gather
    every rank decodes the same bytes                -> bit-identical results everywhere
Wire bytes per rank ~ 2 (W-1)/W N (1 + 4/block) versus 2 (W-1)/W N 2 for a bf16 ring all-reduce:
~0.516x at block 128. `simulate_mean` runs exactly the same numerics in one process.

Reading order: the codec (quantize/dequantize), the two-stage collective, the rotation, the
whitening, the Hadamard control, geometry estimation, the optimizer's view of an error, and the
communicator that train.py calls once per step. This file is the reference and imports nothing
from nanogeo/; nanogeo/ builds on it, passing its own forms in where training at scale needs them:

    nanogeo/wire/collective.py    the codec and collective as training runs them, through
                                  ShardLayouts that override the stages: packed (one codec call
                                  per bucket and stage) and stochastic rounding (wire/packing.py;
                                  compiled: wire/kernels.py), NVFP4 (wire/nvfp4.py)
    nanogeo/wire/fp8sum.py        the paper's collective: one FP8 all_reduce SUM
    nanogeo/parallel/communicator.py  ProductionCommunicator(Communicator): the paper's collective
                                  and profiled selection, K-FAC statistics averaged over ranks,
                                  finiteness and rank agreement, dense ablations, checkpoints
    nanogeo/parallel/layers.py        the layers' state for rank checks and checkpoints; dense factors
                                  and bases (ablations)
    nanogeo/parallel/hooks.py         the K-FAC statistics (forward hooks), the optimizers' views
    nanogeo/parallel/update_error.py  the error AdamW and Muon see (section 4b)
    nanogeo/parallel/ddp.py, fsdp.py  the DDP comm hook and FSDP2's reduce-scatter (row blocks)
"""

import contextlib
import copy
import functools
import math
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
FORMATS = ("e4m3", "e5m2", "nvfp4")   # nvfp4: 4-bit values (a production codec, see above)
NVFP4_BLOCK = 16        # NVFP4 always scales blocks of 16 values; `block` does not apply to it
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


def check_fp8(fmt, block):
    """This file's codec is FP8 (NVFP4 is a production codec)."""
    check_codec(fmt, block)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"compress.py codes e4m3 and e5m2; {fmt} is nanogeo.wire's codec "
                         "(nanogeo.wire.collective.quantize and .all_reduce_mean)")


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
    return 4 * num_groups(shape, block) + numel  # fp32 scale per group + one byte per value


def quantize(x, fmt="e4m3", block=128, encode_groups=None) -> Quantized:
    """Quantize x into one uint8 wire buffer.

    Each group (block of `block` flattened elements, a row, or the whole tensor) gets scale
    s = fmax / amax; values are cast as torch casts x * s, saturated at +-fmax. Wire: [s per
    group, fp32][one fp8 byte per element]. `encode_groups`: fp8_encode unless production passes
    its stochastic rounding in (nanogeo/wire/packing.py).
    """
    check_fp8(fmt, block)
    numel = x.numel()
    if numel == 0:
        return Quantized(torch.empty(0, dtype=torch.uint8, device=x.device), x.shape, fmt, block)
    dtype, fmax = FP8_FORMATS[fmt]
    scale, codes = (encode_groups or fp8_encode)(scale_groups(x, block), fmax, dtype)
    buffer = torch.cat([scale.view(torch.uint8), codes.reshape(-1)[:numel]])
    return Quantized(buffer, x.shape, fmt, block)


def scale_from_amax(amax, fmax):
    """s = fmax / amax, elementwise (1 where amax is 0; at most fp32's max)."""
    return torch.where(amax > 0, fmax / amax, torch.ones_like(amax)).clamp(max=FP32_MAX)


def fp8_scale(groups, fmax):
    """Per-group scale s = fmax / amax and the scaled, saturated values."""
    scale = scale_from_amax(groups.abs().amax(dim=1), fmax)            # (G,)
    return scale, (groups * scale[:, None]).clamp(-fmax, fmax)


def fp8_encode(groups, fmax, dtype):      # hot path (compiled in production)
    """(G, L) fp32 -> scales (G,) fp32 and codes (G, L) uint8, round to nearest even."""
    scale, y = fp8_scale(groups, fmax)
    return scale, y.to(dtype).view(torch.uint8)


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
    n_groups = num_groups(q.shape, q.block)
    dtype, _ = FP8_FORMATS[q.fmt]
    scale = as_float32(q.buffer[: 4 * n_groups])
    group_len = numel // n_groups if q.block in ("row", "tensor") else q.block
    return fp8_decode(q.buffer[4 * n_groups:], scale, group_len, dtype).view(q.shape)


# =============================================================================
# 2. The collective: quantize -> all_to_all -> fp32 reduce -> re-quantize -> all_gather
# =============================================================================

# one output tensor for the W inputs (torch 2.13 renamed all_gather_into_tensor)
all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class Piece:
    """The part of one tensor that one rank owns in the reduce-scatter: a contiguous range of
    whole scale groups, so that cutting into shards never changes what is quantized together."""
    tensor: int     # index into the bucket
    start: int      # flat element range [start, end)
    end: int
    shape: tuple    # how the piece is quantized (rows x row_len for row scaling, else flat)
    block: object


class ShardLayout:
    """How a bucket of tensors is cut into W shards, and the three stages on it. Rank j owns, of
    every tensor, the j-th contiguous range of its scale groups (blocks or rows). With "tensor"
    scaling each tensor is cut into W equal ranges, each with one scale (a single scale per
    tensor would force one rank to own the whole tensor and unbalance the all_gather). A tensor's
    groups left over after W equal counts (all of them, if it has fewer groups than ranks) go to
    the ranks whose shards are lightest so far: the all_gather pads every shard to the largest,
    so a small model at large W would otherwise pay for one rank's pile of remainders. The
    layout depends only on the shapes and the wire's size of a piece (piece_nbytes: a packed
    layout may cut differently, never inside a scale group), so every rank computes the same.

    The stages run piece by piece, through this file's FP8 codec, rounding to nearest.
    Production's layouts (nanogeo/wire) subclass it: each stage on the whole bucket in one codec
    call (packed: the same bytes as piece by piece, bit for bit), NVFP4, stochastic rounding
    (the simulator drawing exactly what the ranks draw)."""
    codec_check = staticmethod(check_fp8)   # its codec: FP8 (an NVFP4 layout checks its own)

    def __init__(self, shapes, fmt, block, world_size, pieces=None):
        self.codec_check(fmt, block)
        self.shapes, self.fmt, self.world_size = [tuple(s) for s in shapes], fmt, world_size
        self.block = block
        self.pieces = self._cut(self.block) if pieces is None else pieces
        self.nbytes = [sum(map(self.piece_nbytes, pieces)) for pieces in self.pieces]

    def _cut(self, block):
        pieces = [[] for _ in range(self.world_size)]
        load = [0] * self.world_size        # bytes each rank's shard holds so far
        for t, shape in enumerate(self.shapes):
            numel = math.prod(shape)
            if isinstance(block, int):                      # blocks of `block` elements
                group_len, piece_block = block, block
            elif block == "row" and len(shape) >= 2:        # whole rows
                group_len, piece_block = (numel // shape[0] if shape[0] else 0), "row"
            else:  # "tensor" (or "row" of a 1-D tensor): one scale per tensor per shard
                group_len, piece_block = -(-numel // self.world_size), "tensor"
            n_groups = -(-numel // group_len) if group_len else 0
            base, extra = divmod(n_groups, self.world_size)
            # the `extra` groups left over go to the ranks that carry the fewest bytes so far (a
            # tie to the lower rank): the all_gather pads every shard to the largest
            lightest = set(sorted(range(self.world_size), key=lambda j: (load[j], j))[:extra])
            first = 0
            for j in range(self.world_size):
                count = base + (j in lightest)
                start, end = first * group_len, min(numel, (first + count) * group_len)
                first += count
                if end <= start:
                    continue
                piece_shape = (count, group_len) if piece_block == "row" else (end - start,)
                pieces[j].append(Piece(t, start, end, piece_shape, piece_block))
                load[j] += self.piece_nbytes(pieces[j][-1])
        return pieces

    # -- one piece through the codec -------------------------------------------------------------

    def piece_nbytes(self, p):
        """Wire bytes of one piece. (_cut calls it from __init__: it may use fmt, block and the
        piece only.)"""
        return wire_nbytes(p.shape, self.fmt, p.block)

    def rounding(self, whose):
        """How rank whose[0] rounds in stage whose[1], a token for quantize_piece: here to
        nearest (None). A stochastic layout returns that rank's and stage's random stream, new
        at each stage call."""
        return None

    def quantize_piece(self, values, p, rounding):
        """One piece through the codec, rounding as self.rounding() said for this stage."""
        return quantize(values.view(p.shape), self.fmt, p.block)

    def dequantize_piece(self, buffer, p):
        return dequantize(Quantized(buffer, p.shape, self.fmt, p.block))

    def decode_pieces(self, buffer, pieces):
        """The fp32 values of each piece packed in one buffer, in order (one call per piece)."""
        out, offset = [], 0
        for p in pieces:
            nbytes = self.piece_nbytes(p)
            out.append(self.dequantize_piece(buffer[offset: offset + nbytes], p))
            offset += nbytes
        return out

    # -- the three stages ------------------------------------------------------------------------
    # (a stochastic layout rounds stage 1 from its rank's stream, stage 2 from the stream of the
    # shard's owner: rank j owns shard j)

    def encode(self, flats, rank=0):
        """Stage 1 on `rank`: its flat fp32 tensors -> one uint8 buffer, the W destination
        ranks' shards back to back (shard j is nbytes[j] bytes)."""
        rounding = self.rounding((rank, 1))
        return torch.cat([self.quantize_piece(flats[p.tensor][p.start:p.end], p, rounding).buffer
                          for pieces in self.pieces for p in pieces])

    def sum_copies(self, received, shard):
        """Decode the W received copies of one shard (back to back in `received`, in source-rank
        order) and sum them in fp32, always in the same order: the simulator and every rank sum
        identically. Returns one flat fp32 tensor per piece of the shard."""
        total = None
        for one_copy in received.split(self.nbytes[shard]):
            values = [v.reshape(-1) for v in self.decode_pieces(one_copy, self.pieces[shard])]
            total = values if total is None else [a + b for a, b in zip(total, values)]
        return total

    def reduce(self, received, shard):
        """Stage 2, on the rank that owns `shard`: sum_copies, divide by W, re-quantize.
        Returns the shard's bytes."""
        rounding = self.rounding((shard, 2))
        parts = [self.quantize_piece(v / self.world_size, p, rounding).buffer
                 for v, p in zip(self.sum_copies(received, shard), self.pieces[shard])]
        return torch.cat(parts) if parts else received.new_empty(0)

    def decode(self, buffer, stride=None):
        """Stage 3: the W shards' bytes (shard j at j * stride, or back to back as stage 1
        wrote them if stride=None) -> the bucket's values, flat fp32 in tensor order."""
        starts = [0]
        for shape in self.shapes:
            starts.append(starts[-1] + math.prod(shape))
        flat, offset = torch.zeros(starts[-1], device=buffer.device), 0
        for j, pieces in enumerate(self.pieces):
            offset = j * stride if stride is not None else offset
            shard = buffer[offset: offset + self.nbytes[j]]
            for p, values in zip(pieces, self.decode_pieces(shard, pieces)):
                flat[starts[p.tensor] + p.start: starts[p.tensor] + p.end] = values.reshape(-1)
            offset += self.nbytes[j]
        return flat

    # the simulator's stage 1 for all W ranks, and their own round trips (a packed layout:
    # one codec call for all of them)
    def encode_ranks(self, rank_flats):
        """(W, bytes): row i = encode(rank_flats[i], i)."""
        return torch.stack([self.encode(flats, i) for i, flats in enumerate(rank_flats)])

    def decode_ranks(self, sends):
        """(W, values): row i = decode(sends[i])."""
        return torch.stack([self.decode(send) for send in sends])


@functools.lru_cache(maxsize=64)
def shard_layout(shapes, fmt, block, world_size):
    """The ShardLayout of a bucket, built once per (shapes, format, world size): it depends on
    nothing else, and the collective asks for the same one every step. (Production's layouts
    have their own cache: nanogeo.wire.collective.shard_layout.)"""
    return ShardLayout(shapes, fmt, block, world_size)


def encode_shards(tensors, layout, rank=0):
    """Stage 1 of `rank`: its tensors -> one uint8 buffer, the W shards back to back."""
    flats = [t.reshape(-1).float() for t in tensors]
    if not sum(layout.nbytes):           # only empty tensors: nothing to send
        return flats[0].new_empty(0, dtype=torch.uint8)
    return layout.encode(flats, rank)


def split_tensors(flat, layout):
    """The bucket's flat fp32 values -> one tensor per shape (views)."""
    sizes = [math.prod(s) for s in layout.shapes]
    return [t.view(s) for t, s in zip(flat.split(sizes), layout.shapes)]


def decode_shards(buffer, layout, stride=None):
    """Stage 3: full fp32 tensors from the W shards' bytes in `buffer` (identical on all ranks):
    shard j at j * stride, or back to back (stage 1's send buffer) if stride=None."""
    if not sum(layout.nbytes):
        return [torch.zeros(s, device=buffer.device) for s in layout.shapes]
    return split_tensors(layout.decode(buffer, stride), layout)


def collective_bytes(layout, rank):
    """Bytes `rank` sends: its shards for the others in the all_to_all, then its averaged shard
    (padded to the largest shard, as all_gather needs equal sizes) to the W - 1 others."""
    stage1 = sum(n for j, n in enumerate(layout.nbytes) if j != rank)
    return stage1 + (layout.world_size - 1) * max(layout.nbytes)


def ring_allreduce_bytes(numel, bytes_per_element, world_size):
    """Bytes each rank sends in a ring all-reduce: reduce-scatter + all-gather, each moving
    (W - 1) / W of the buffer: the bf16 baseline (2 bytes an element) that the two-stage
    collective's bytes are compared with, and the paper's FP8-sum collective (1 byte; plus its
    scales' MAX all-reduce)."""
    return int(2 * (world_size - 1) * numel * bytes_per_element // world_size)


class NoTimer:
    """Times nothing: the default stage timer (a benchmark passes one that measures each stage;
    a plain class, so states pickle)."""
    @staticmethod
    def stage(name):
        return contextlib.nullcontext()


NO_TIMER = NoTimer()


def world_size(group=None):
    """Ranks in the group (1 without torch.distributed)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce_mean(tensors, fmt="e4m3", block=128, group=None, return_local=False,
                    layout=None, timer=NO_TIMER):
    """The mean of `tensors` over the process group, through the two-stage FP8 collective.

    Returns (means, nbytes) - or (means, nbytes, local) with return_local, where local is this
    rank's own stage-1 reconstruction (for error feedback). Bit-identical on all ranks.
    Production passes its forms in: `layout` (packed stages, NVFP4, stochastic rounding) and
    `timer` (bench's stages).
    """
    world, me = world_size(group), (dist.get_rank(group) if dist.is_initialized() else 0)
    layout = layout or shard_layout(tuple(tuple(t.shape) for t in tensors), fmt, block, world)
    with timer.stage("quantize"):
        send = encode_shards(tensors, layout, me)
    local = decode_shards(send, layout) if return_local else None
    if world == 1:
        means, nbytes = decode_shards(layout.reduce(send, 0), layout), 0
    else:
        own = layout.nbytes[me]
        recv = send.new_empty(world * own)                  # the W copies of this rank's shard
        own_mean = send.new_zeros(max(layout.nbytes))       # its average, padded: all_gather
        gathered = send.new_empty(world, max(layout.nbytes))    # needs equal sizes
        with timer.stage("all_to_all"):
            dist.all_to_all_single(recv, send, [own] * world, layout.nbytes, group=group)
        with timer.stage("reduce"):
            own_mean[:own] = layout.reduce(recv, me)
        with timer.stage("all_gather"):         # row j of `gathered`: rank j's averaged shard
            all_gather_flat(gathered.view(-1), own_mean, group=group)
        with timer.stage("decode"):
            means = decode_shards(gathered.view(-1), layout, stride=gathered.shape[1])
        nbytes = collective_bytes(layout, me)
    return (means, nbytes, local) if return_local else (means, nbytes)


def simulate_mean(worker_tensors, fmt="e4m3", block=128, return_local=False, layout=None):
    """Exactly the numerics of all_reduce_mean, in one process: worker_tensors[i] is rank i's
    list of tensors. Returns (means, bytes sent per rank on average[, per-worker local])."""
    world = len(worker_tensors)
    shapes = tuple(tuple(t.shape) for t in worker_tensors[0])
    layout = layout or shard_layout(shapes, fmt, block, world)
    flats = [[t.reshape(-1).float() for t in ts] for ts in worker_tensors]
    if not sum(layout.nbytes):          # only empty tensors
        sends = flats[0][0].new_empty(world, 0, dtype=torch.uint8)
    else:
        sends = layout.encode_ranks(flats)                  # row i: rank i's bytes
    received = sends.split(layout.nbytes, dim=1)    # [j]: the W copies of shard j, (W, bytes)
    shards = [layout.reduce(received[j].reshape(-1), j) for j in range(world)]
    means = decode_shards(torch.cat(shards), layout)
    nbytes = 0 if world == 1 else sum(collective_bytes(layout, i) for i in range(world)) / world
    if not return_local:
        return means, nbytes
    if not sum(layout.nbytes):
        return means, nbytes, [decode_shards(send, layout) for send in sends]
    return means, nbytes, [split_tensors(values, layout) for values in layout.decode_ranks(sends)]


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
        # T by LAPACK's larft recurrence, column by column: r small products on the device, no
        # host sync, and right when a reflector is the identity (tau = 0)
        YtY = Y.T @ Y
        T = torch.diag(tau)
        for i in range(1, r):
            T[:i, i] = -tau[i] * (T[:i, :i] @ YtY[:i, i])
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


def reflect(X, Y, T):
    """(I - Y T Y^T) X: three thin matrix products, never the m x m matrix."""
    return X - Y @ (T @ (Y.T @ X))


def encode_geo(G, left, right):
    """H = P^T G Q. `left`/`right`: HouseholderBasis (or any basis with its apply_t / apply: the
    dense ablation bases), or None: that side stays as it is."""
    H = left.apply_t(G) if left is not None else G
    return right.apply_t(H.T).T if right is not None else H        # G Q = (Q^T G^T)^T


def decode_geo(H, left, right):
    """G = P H Q^T, the inverse of encode_geo."""
    G = right.apply(H.T).T if right is not None else H              # H Q^T = (Q H^T)^T
    return left.apply(G) if left is not None else G


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


# =============================================================================
# 3b. The published transform: whitening by the K-FAC factors of a linear layer
# =============================================================================
#
# GeoFP8 as published takes its geometry from K-FAC. For a linear layer y = W a (W: d_out x d_in)
# the Fisher is approximated by A (x) G, with A = E[a a^T] the layer's input second moment
# (d_in x d_in, uncentred, per token) and G = E[delta delta^T] on the output side. With a factor
# F, F F^T = A + damping I, the gradient is sent in whitened coordinates and mapped back:
#
#     encode:  W~ = W_g F^-T       each row of W_g mixes along d_in (rows stay independent)
#     decode:  W  = W~ F^T
#
# (output side: W~ = F_G^-1 W_g, W = F_G W~). Unlike the subspace rotation this map is not
# orthogonal: an error E made in W~ returns as E F^T, so it is small along input directions of
# small variance and large along those of large variance. The published deployment whitens only
# the input side, with A low-rank + diagonal: A^ = U L U^T + D (top-r eigenpairs, D the rest of
# A's diagonal, floored), and applies F by a dense triangular solve. A factor of A^ can instead
# be applied in O(d_in r) per row: with K = D^-1/2 U L^1/2 = Q S (thin SVD, Q d_in x r),
#
#     F    = D^1/2 (I + Q ((1 + S^2)^1/2 - 1) Q^T)        (F F^T = D + U L U^T = A^)
#     F^-1 = (I + Q ((1 + S^2)^-1/2 - 1) Q^T) D^-1/2
#
# Any two factors of A^ differ by an orthogonal matrix (F = L O), so the metric - and the norm
# of every whitened row - is the same as with the Cholesky factor L; the quantization grid is not.

WHITEN_SIDES = ("input", "output", "both")


@dataclass
class Whitening:
    """One side's low-rank factor F (F F^T = A^ + damping I) in the form it is applied in:
    sqrt_d (d,) = D^1/2, Q (d, r) and the r multipliers up = (1 + S^2)^1/2 - 1,
    down = (1 + S^2)^-1/2 - 1 of the formula above. (Dense factors, for ablations and the
    published artifact's dense Cholesky form: production.)"""
    kind: str
    size: int                   # d
    sqrt_d: torch.Tensor = None
    Q: torch.Tensor = None
    up: torch.Tensor = None
    down: torch.Tensor = None

    def whiten(self, X):
        """X F^-T for X (m, d): every row of X to whitened coordinates. F^-T = D^-1/2 M^-1,
        M = I + Q diag(up) Q^T symmetric."""
        Y = X / self.sqrt_d
        return Y + ((Y @ self.Q) * self.down) @ self.Q.T

    def unwhiten(self, X):
        """X F^T for X (m, d): back to the original coordinates. F^T = M D^1/2: two thin
        products, then a scaling."""
        return (X + ((X @ self.Q) * self.up) @ self.Q.T) * self.sqrt_d

    def dense(self):
        """F as a dense (d, d) matrix: the reference the tests compare the applied form with."""
        eye = torch.eye(self.size, dtype=self.sqrt_d.dtype, device=self.sqrt_d.device)
        return torch.diag(self.sqrt_d) @ (eye + (self.Q * self.up) @ self.Q.T)

    def tensors(self):
        return {"sqrt_d": self.sqrt_d, "Q": self.Q, "up": self.up, "down": self.down}


def top_eigenpairs(A, rank, floor):
    """A^ = U diag(lam) U^T + diag(rest): the top-`rank` eigenpairs of A (d x d, symmetric;
    eigenvalues clipped at 0) and the floored diagonal residual."""
    values, vectors = torch.linalg.eigh(A)                             # ascending
    U, lam = vectors[:, -rank:], values[-rank:].clamp(min=0)           # (d, r), (r,)
    rest = (A.diagonal() - (U.pow(2) * lam).sum(1)).clamp(min=floor)   # (d,) diagonal residual
    return U, lam, rest


def whitening_factor(A, rank=32, damping=1e-3, floor=1e-3):
    """The factor of a second moment A (d x d) that GeoFP8 whitens with, F F^T = A^ + damping I:
    A^ = U L U^T + diag(max(diag(A - U L U^T), floor)) with the top-`rank` eigenpairs, applied
    in O(d r) per row. Computed in float64 (the eigen-decomposition of a nearly singular A needs
    it), returned in A's dtype. (Dense kinds - full, diag, block, and this A^ with a Cholesky
    factor as the published artifact applies it: production.)"""
    dtype = A.dtype
    A = (A.double() + A.double().T) / 2
    U, lam, rest = top_eigenpairs(A, min(rank, A.shape[0]), floor)
    D = rest + damping
    K = U * lam.sqrt() / D.sqrt()[:, None]                             # D^-1/2 U L^1/2
    Q, S, _ = torch.linalg.svd(K, full_matrices=False)
    return Whitening("lowrank", A.shape[0], sqrt_d=D.sqrt().to(dtype), Q=Q.to(dtype),
                     up=((1 + S.pow(2)).sqrt() - 1).to(dtype),
                     down=((1 + S.pow(2)).rsqrt() - 1).to(dtype))


def linear_layers(model, names=None):
    """{weight name: the nn.Linear owning it}, found by module type (never by name or shape).
    Restricted to `names` if given. A weight shared with a non-linear module (a tied embedding)
    is left out: its gradient is not W_g = sum delta a^T of one layer."""
    owners = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    found = {}
    for name, param in model.named_parameters():
        modules = owners.get(id(param), [])
        if (len(modules) == 1 and isinstance(modules[0], torch.nn.Linear)
                and param is modules[0].weight and (names is None or name in names)):
            found[name] = modules[0]
    return found


# =============================================================================
# 3c. A geometry-agnostic control: the randomized Hadamard transform
# =============================================================================
#
# Is a layer's geometry worth its statistics? The control that answers it rotates without any:
# the randomized Hadamard transform, the incoherence step of SDP4Bit's 4-bit gradient
# all-reduce and of QuaRot-style quantisation. Each row of G (m x n) is multiplied by random
# signs, S = diag(s) with s in {-1, +1}^n, then cut into blocks of b entries (b a power of two,
# hadamard_block = 128), and each block is multiplied by the orthonormal Walsh-Hadamard matrix
# H_b / sqrt(b) (Sylvester's construction: H_2k = [[H_k, H_k], [H_k, -H_k]], entries +-1):
#
#     encode:  H = G S B           B = diag(H_b, ..., H_b) / sqrt(b), block diagonal
#     decode:  G = H B S           B is symmetric and orthogonal (B B = I), and S S = I
#
# Every output entry of a block is a sum of all b inputs with equal weights and random signs, so
# one large entry - an outlier column of G, an outlier element - is spread evenly over its
# block, 1/sqrt(b) of its size in each of b places, and the block's scale follows the block's
# energy instead of its one largest entry ("incoherence"). That is what integer and 4-bit grids
# need; FP8 already gives every small entry a relative precision of its own, and after the
# transform each entry carries a share of the outlier's rounding error - on a synthetic outlier
# column the e4m3 round trip gets worse, so here too the gain check decides, layer by layer.
# What it cannot do is concentrate: the dominant directions of G are smeared like everything
# else, where the subspace rotation (section 3) puts them on a few coordinates that travel
# exactly.
#
# Why it is the control: no statistics, no refresh and no agreement between ranks beyond a
# seed - the signs are drawn once per matrix on the CPU from the name's CRC and the run's seed,
# so every rank draws the same ones. B S is orthogonal, so an error comes back with its norm
# unchanged. Along the columns (hadamard_sides="right", the default) each row is transformed
# alone: the coordinates are row-local, and under FSDP a rank decodes its own rows of the mean
# with the same decode; hadamard_sides="both" also transforms every column (G^T the same way).
#
# A batched matmul (m n / b, b) @ (b, b) applies B: 2 b flops per entry and side, one GEMM on a
# GPU, and on a CPU 3-4x faster than the log2(b) passes of the fast Walsh-Hadamard butterfly.
# (A GPU that allows TF32 matmuls - train.py does - rounds the GEMM's inputs to 10 mantissa
# bits, a relative 2^-11: the round trip is then exact to ~5e-4, some 50x below e4m3's rounding.)
#
# A dimension that is not a multiple of b: whole blocks of b first, then the remainder in
# decreasing powers of two (2736 = 21 x 128 + 32 + 16, the paper's 300M down-projection). Every
# coordinate is rotated and most of them in full blocks; the largest power of two dividing n
# would give that matrix blocks of 16 throughout, and an unrotated tail would keep its outliers.

HADAMARD_SIDES = ("right", "both")


@functools.lru_cache(maxsize=None)
def walsh_hadamard(size, device, dtype=torch.float32):
    """The orthonormal Walsh-Hadamard matrix of a power-of-two size, H_size / sqrt(size):
    symmetric and orthogonal, so its own inverse. Made once per size, device and dtype."""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < size:                    # Sylvester: entries stay exactly +-1
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)])
    return (H / math.sqrt(size)).to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=None)
def hadamard_cuts(n, block):
    """How a row of n entries is cut into Walsh-Hadamard blocks: ((width, b), ...), each width
    a multiple of its block size b. Whole blocks of `block` first, then the remainder in
    decreasing powers of two: 2736, 128 -> ((2688, 128), (32, 32), (16, 16))."""
    whole, rest = n - n % block, n % block
    cuts = [(whole, block)] if whole else []
    while rest:
        b = 1 << (rest.bit_length() - 1)        # the largest power of two <= rest
        cuts.append((b, b))
        rest -= b
    return tuple(cuts)


def block_hadamard(X, block):
    """X B for X (m, n): every block of each row times the orthonormal Walsh-Hadamard matrix of
    its size (hadamard_cuts), one batched matmul (m, width / b, b) @ (b, b) per block size."""
    m, n = X.shape
    cuts = hadamard_cuts(n, block)
    parts = X.split([width for width, _ in cuts], dim=1)
    out = [(part.reshape(m, width // b, b) @ walsh_hadamard(b, X.device, X.dtype)).reshape(m, width)
           for part, (width, b) in zip(parts, cuts)]
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def randomized_hadamard(X, signs, block):
    """X S B: each row of X (m, n) times the random signs (n,), then block_hadamard."""
    return block_hadamard(X * signs, block)


def randomized_hadamard_inverse(Y, signs, block):
    """Y B S, the inverse of randomized_hadamard (B B = I, S S = I)."""
    return block_hadamard(Y, block) * signs


def random_signs(n, generator):
    """(n,) fp32 of +-1, each sign a fair coin from `generator`."""
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


# =============================================================================
# 4. Geometry estimation from decoded mean gradients
# =============================================================================

def orthonormal(A):
    return torch.linalg.qr(A).Q


class AllRows:
    """Where the rows of a gradient G (m x n) live while its geometry is estimated: here all of
    them on every rank (DDP, train.py), so every method is the identity. Under FSDP each rank
    holds a block of rows; the FSDP form passed in has the same methods, with the collectives
    that sum partial products (G^T U = sum_j G_j^T U_j) and gather row blocks."""
    sharded = False

    def local(self, X):
        """This rank's rows of a whole m x k matrix."""
        return X

    def sum(self, x):
        """The sum over ranks of a partial product."""
        return x

    def sum_all(self, parts):
        """sum() of several partial products."""
        return parts

    def gather(self, X_rows):
        """The whole m x k matrix from every rank's block of rows."""
        return X_rows


ALL_ROWS = AllRows()


def update_subspaces(G, U, V, left_energy, right_energy, decay=0.0, iters=1, rows=ALL_ROWS):
    """One refresh of the dominant subspaces of G (m x n), warm-started from U (m x r), V (n x r).

    With decay = 0 this is subspace iteration on G G^T and G^T G. With decay > 0 it iterates on
    an exponential moving average of the covariances, C = decay * U diag(e) U^T + (1-decay) G G^T,
    represented by the previous bases and their energies e (r numbers per side): memory stays
    O(r (m + n)). A Rayleigh-Ritz step then rotates U and V so that U^T G V is diagonal, with
    the largest entry first: in coordinates every dominant row of H has one large entry.
    G may be this rank's block of rows only (FSDP); U and V are always whole.
    Returns (U, V, left_energy, right_energy)."""
    for _ in range(iters):
        A = (1 - decay) * (G @ rows.sum(G.T @ rows.local(U)))          # rows of G G^T U
        B = (1 - decay) * rows.sum(G.T @ (G @ V))                     # G^T G V
        if decay > 0:
            A = A + decay * rows.local(U) * left_energy
            B = B + decay * V * right_energy
        U_new, V_new = orthonormal(rows.gather(A)), orthonormal(B)
        # Rayleigh quotients of the (EMA) covariance in the new bases: the new energies
        left_energy = ((1 - decay) * rows.sum(G.T @ rows.local(U_new)).pow(2).sum(0)
                       + decay * ((U.T @ U_new).pow(2) * left_energy[:, None]).sum(0))
        right_energy = ((1 - decay) * rows.sum((G @ V_new).pow(2).sum(0))
                        + decay * ((V.T @ V_new).pow(2) * right_energy[:, None]).sum(0))
        U, V = U_new, V_new
    a, _, bh = torch.linalg.svd(rows.sum(rows.local(U).T @ G @ V))    # r x r: negligible cost
    U, V = U @ a, V @ bh.T
    left_energy = ((1 - decay) * rows.sum(G.T @ rows.local(U)).pow(2).sum(0)
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
    V = orthonormal(rows.sum(G.T @ rows.local(U)))
    zeros = torch.zeros(r, device=G.device, dtype=G.dtype)
    return update_subspaces(G, U, V, zeros, zeros, decay=0.0, iters=iters, rows=rows)


# =============================================================================
# 4b. The error the optimizer sees: what a gradient error does to the next update
# =============================================================================
# The relative L2 error of the averaged gradient is not what training feels. AdamW divides every
# element by the root of its second moment, so an error on an element whose gradients are
# usually tiny is magnified; a rotation spreads the quantisation error of a few large
# coordinates over every element, including those. Muon orthogonalises the update, so what
# matters is how an error moves the orthogonalised matrix. The per-layer decision (section 5)
# therefore measures each codec's error through the optimizer that owns the layer, from the
# optimizer's own state (identical on every rank under DDP): AdamW's elementwise update, exactly
# (early on, and on quiet elements, an error as large as the gradient flips the update's sign:
# a derivative cannot see that), and Muon's Newton-Schulz map to first order (the optimizer's
# view of a layer is passed in by watch()).

def error_measure(view, mean, rows=None, workers=1):
    """delta -> the squared size of a gradient error delta (m, n) as the next update sees it:
    through the optimizer's `view` of the layer (its .error(): at the decoded mean `mean`, one
    worker's error scaled to its share of the mean of `workers`), or in plain L2 without one
    (geo_judge="l2", or no watch()). Under FSDP (rows) only this rank's rows are measured; the
    caller sums over the ranks."""
    if view is not None:
        return view.error(mean, rows, workers)
    local = (ALL_ROWS if rows is None else rows).local
    return lambda delta: local(delta).pow(2).sum()


# =============================================================================
# 5. The communicator: which tensors go geometry-aware, their state, one call per step
# =============================================================================
#
# Coordinates, one interface: each candidate matrix has a layer object - SubspaceLayer (the
# rotation, section 3),
# WhitenedLayer (the published whitening, section 3b) or HadamardLayer (the geometry-agnostic
# control, section 3c) - with
#     encode(g) -> h, decode(h) -> g      the change of coordinates and its inverse
#     refresh(statistics)                 new geometry from statistics identical on every rank
#                                         (the decoded mean / the averaged K-FAC moments; the
#                                         Hadamard control draws its signs once, from a seed)
#     ready, use_geo, gain                built yet? in use? last measured gain
#     row_local                           decode acts on each row alone (FSDP decodes a rank's
#                                         rows of the mean with it)
# Euclidean coordinates are the identity: a tensor without a layer object, or whose layer is not
# in use, is sent as it is.

GEOMETRIES = ("geofp8", "subspace", "hadamard", "euclidean")
SELECTIONS = ("gain", "all", "list")
JUDGES = ("optimizer", "l2")


@dataclass
class GeoOptions:
    """The method's settings (production's Options adds its own: the
    paper's collective, the profiled selection, stochastic rounding, dense ablations)."""
    # geometry: "geofp8" - the published whitening by K-FAC factors (section 3b); "subspace" -
    # this project's two-sided rotation toward dominant subspaces (section 3); "hadamard" - the
    # randomized Hadamard transform, the geometry-agnostic control (section 3c); "euclidean" -
    # plain FP8
    geometry: str = "geofp8"
    fmt: str = "e4m3"
    block: object = 128             # int, "row" or "tensor" (nvfp4 always uses 16)
    geo_refresh: int = 0            # re-estimate the geometry every N steps (0: 50 geofp8, 4 the
                                    # others; the Hadamard control is only re-judged)
    geo_warmup: int = 0             # steps sent in Euclidean coordinates before GeoFP8 starts
    # which matrices use it: "gain" (measured: the codec error must drop by geo_enter_gain), "all",
    # "list" (the names in geo_layers, e.g. from the profiling tool)
    select: str = "gain"
    geo_layers: tuple = ()
    geo_judge: str = "optimizer"    # gains in the error the layer's optimizer sees (section 4b;
                                    # needs watch()) or in plain "l2" (ablation)
    judge_every: int = 4            # geofp8: also re-measure the gains every N steps between
                                    # refreshes (the subspace rotation measures at each refresh)
    geo_enter_gain: float = 1.10    # switch a layer to geo when Euclid error / geo error >= this
    geo_exit_gain: float = 1.00     # ... and back to Euclidean when it falls below this
    min_numel: int = 4096           # smaller matrices are not worth a transform
    vocab_size: int = 0             # matrices with a dimension of this size stay Euclidean
    # whitening (published GeoFP8)
    whiten_rank: int = 32           # r of the low-rank factor
    whiten_sides: str = "input"     # "input" (published), "output", "both"
    damping: float = 1e-3
    moment_decay: float = 0.95      # EMA of the second moments across refreshes
    # subspace rotation
    geo_rank: int = 16              # r, per side, capped at min(m, n) // 2
    decay: float = 0.0              # EMA of the covariance; 0 = bases from the latest mean only
    iters: int = 1                  # subspace iterations per refresh
    sides: str = "auto"             # per matrix both sides or the right (column) side only -
                                    # which keeps every row's scale - whichever the gain check
                                    # measures better; or fixed "both", "left", "right" (ablation)
    scatter_core: bool = True       # give each core coordinate its own scaling block
    # randomized Hadamard (the control)
    hadamard_block: int = 128       # entries per Walsh-Hadamard block, a power of two
    hadamard_sides: str = "right"   # "right": along each row (row-local), "both": columns too
    # error feedback
    error_feedback: bool = False    # keep each rank's stage-1 quantization error, add it back
    feedback_geo_only: bool = False # ... only on the geometry-aware matrices (as published)
    seed: int = 0

    def choices(self):
        """{field: allowed values} of the string fields (a subclass adds its own)."""
        return {"geometry": GEOMETRIES, "select": SELECTIONS, "geo_judge": JUDGES,
                "sides": ("both", "left", "right", "auto"), "whiten_sides": WHITEN_SIDES,
                "hadamard_sides": HADAMARD_SIDES}

    def __post_init__(self):
        check_codec(self.fmt, self.block)
        for key, allowed in self.choices().items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        if self.geo_refresh == 0:
            self.geo_refresh = 50 if self.geometry == "geofp8" else 4
        if min(self.geo_rank, self.geo_refresh, self.whiten_rank, self.judge_every) < 1:
            raise ValueError("geo_rank, whiten_rank, geo_refresh and judge_every must be >= 1")
        if self.hadamard_block < 2 or self.hadamard_block & (self.hadamard_block - 1):
            raise ValueError(f"hadamard_block must be a power of two >= 2 (e.g. 128), got "
                             f"{self.hadamard_block}")
        self.geo_layers = tuple(self.geo_layers)


def exemption(name, shape, opts, linear=None):
    """Why a tensor stays Euclidean (a short reason), or None if it is a GeoFP8 candidate.
    `linear`: the names of the model's nn.Linear weights (linear_layers; module types, never
    names or shapes) - embedding tables, tied heads and other parameters are not layer
    gradients and stay Euclidean. None: the caller knows no roles, every matrix is a candidate."""
    if opts.geometry == "euclidean":
        return "euclidean mode"
    if len(shape) != 2:
        return "not 2-D"
    if opts.select == "list" and name not in opts.geo_layers:
        return "not selected"
    if opts.select == "list":       # an explicit list (it still passes the gain check)
        return None
    if linear is not None and name not in linear:
        return "not a linear layer"
    if opts.vocab_size and opts.vocab_size in shape:   # an untied output head
        return "vocabulary"
    if math.prod(shape) < opts.min_numel:
        return "small"
    return None


def goes_geometry_aware(layer, opts, listed):
    """The selection, for a candidate matrix whose gain (Euclidean error / geometry-aware error,
    as its optimizer sees them) was just measured. select="all": always. Otherwise with
    hysteresis: a Euclidean layer enters when its gain reaches geo_enter_gain, a geometry-aware
    one stays while it keeps geo_exit_gain; with a list (select="list", production's "fragile")
    only the `listed` layers may (both gains 0: the paper's fixed choice, even unmeasured)."""
    if opts.select == "all":
        return True
    threshold = opts.geo_exit_gain if layer.use_geo else opts.geo_enter_gain
    measured_better = layer.gain >= threshold or (math.isnan(layer.gain) and threshold <= 0)
    return (opts.select == "gain" or listed) and measured_better


@dataclass
class SubspaceLayer:
    """Subspace-rotation coordinates of one matrix: r (m + n) + 2 r^2 + 2 r numbers. The dominant
    subspaces are kept only in Householder form (U = P[:, :r] up to signs), not a second time.
    encode / decode map a gradient to coordinates and back; refresh updates the bases from a
    decoded mean gradient (identical on every rank); state_dict / load_state_dict for resume."""
    shape: tuple
    r: int                              # dominant directions kept per side (geo_rank, capped)
    seed: int
    opts: object = field(repr=False)    # the GeoOptions (decay, iters)
    left_basis: HouseholderBasis = None   # P, completed from the (m, r) dominant left subspace
    right_basis: HouseholderBasis = None  # Q, from the (n, r) dominant right subspace
    left_energy: torch.Tensor = None    # (r,)
    right_energy: torch.Tensor = None   # (r,)
    use_geo: bool = False
    gain: float = float("nan")          # last measured Euclidean error / geo error
    energy: object = float("nan")       # fraction of the mean's energy in the r x r core (a
                                        # device scalar once measured: no host sync)
    transform: tuple = field(default=(None, None), repr=False)  # (left, right), derived
    swaps: tuple = field(default=None, repr=False)              # core_swaps, fixed by shape
    sides: str = "both"                 # the sides rotated now (sides="auto": chosen by gain)
    from_moments = False                # refreshed from the decoded mean, not K-FAC moments

    @classmethod
    def create(cls, name, shape, opts):
        """The layer of weight `name`: r = geo_rank, at most half the smaller side."""
        r = min(opts.geo_rank, min(shape) // 2)
        layer = cls(shape, r, seed=zlib.crc32(name.encode()), opts=opts,
                    sides="both" if opts.sides == "auto" else opts.sides)
        if opts.scatter_core:
            layer.swaps = core_swaps(shape, r, NVFP4_BLOCK if opts.fmt == "nvfp4" else opts.block)
        return layer

    @property
    def ready(self):
        return self.left_basis is not None

    @property
    def row_local(self):
        """Only the column side rotates: decode acts on each row alone."""
        return self.transform[0] is None

    def encode(self, g, transform=None):
        transform = transform or self.transform
        return swap_entries(encode_geo(g, *transform), self.swaps_for(transform))

    def decode(self, h, transform=None):
        transform = transform or self.transform
        return decode_geo(swap_entries(h, self.swaps_for(transform)), *transform)

    def swaps_for(self, transform):
        """Core scattering applies when both sides rotate: only then do the r x r dominant
        coordinates gather in H's corner. (With one side, moving entries between rows would put
        a large value into a quiet row's scaling block.)"""
        return self.swaps if transform[0] is not None and transform[1] is not None else None

    def bases(self):
        """(P, Q), whole (ablations replace them by dense bases)."""
        return self.left_basis, self.right_basis

    def rotation(self, sides=None):
        """(left, right) of the rotation of `sides` (default: the layer's own); None: a side
        that is not rotated."""
        sides = sides or self.sides
        left, right = self.bases()
        return (left if sides in ("both", "left") else None,
                right if sides in ("both", "right") else None)

    def rotate_sides(self, sides):
        self.sides, self.transform = sides, self.rotation(sides)

    def refresh(self, mean, rows=ALL_ROWS):
        """New bases from the decoded mean (this rank's rows of it under FSDP)."""
        if self.left_basis is None:
            U, V, self.left_energy, self.right_energy = initial_subspaces(
                mean, self.r, self.seed, rows=rows)
        else:
            U, V, self.left_energy, self.right_energy = update_subspaces(
                mean, self.left_basis.columns(), self.right_basis.columns(),
                self.left_energy, self.right_energy, self.opts.decay, self.opts.iters, rows)
        self.left_basis = HouseholderBasis.complete(U)
        self.right_basis = HouseholderBasis.complete(V)
        self.transform = self.rotation()
        total = rows.sum(mean.pow(2).sum())
        core = rows.sum(rows.local(U).T @ mean @ V).pow(2).sum()   # sum over ranks, then square
        self.energy = core / total.clamp(min=1e-30)               # stays on the device


@dataclass
class WhitenedLayer:
    """Published-GeoFP8 coordinates of one linear layer's weight: the EMA second moments and the
    factors of each whitened side ("input": A, d_in x d_in; "output": G, d_out x d_out). The
    same interface as SubspaceLayer; refresh takes the layer's K-FAC statistics."""
    shape: tuple
    opts: object = field(repr=False)    # the GeoOptions (whiten_rank, moment_decay, damping)
    moments: dict = field(default_factory=dict)     # side -> EMA of A or G
    factors: dict = field(default_factory=dict)     # side -> Whitening
    use_geo: bool = False
    gain: float = float("nan")
    energy: float = float("nan")                    # (subspace only)
    sides = "both"                                  # (subspace only: no side is chosen here)
    transform = ()                                  # (subspace only: no rotation)
    from_moments = True     # refreshed from the K-FAC moments, and re-judged between refreshes

    @classmethod
    def create(cls, name, shape, opts):
        """The layer of weight `name` (its factors come with the first statistics)."""
        return cls(shape, opts)

    @property
    def ready(self):
        return bool(self.factors)

    @property
    def r(self):
        """r of its low-rank approximation: the factor's eigenpairs (whiten_rank)."""
        return self.opts.whiten_rank

    @property
    def row_local(self):
        """Only the input side is whitened (W~ = W_g F^-T): decode acts on each row alone."""
        return "output" not in self.factors

    def encode(self, g):
        """W~ = F_G^-1 W_g F_A^-T for the sides that have a factor."""
        h = self.factors["input"].whiten(g) if "input" in self.factors else g
        return self.factors["output"].whiten(h.T).T if "output" in self.factors else h

    def decode(self, h):
        """W = F_G W~ F_A^T."""
        g = self.factors["output"].unwhiten(h.T).T if "output" in self.factors else h
        return self.factors["input"].unwhiten(g) if "input" in self.factors else g

    def refresh(self, moments, rows=ALL_ROWS):
        """New factors from this step's second moments ({side: A or G}, identical on every
        rank), smoothed by the EMA of the moments. (`rows`: the interface's; K-FAC moments
        are whole on every rank.)"""
        opts = self.opts
        # new dicts: a candidate (a copy of this layer) must not change the layer in use
        self.moments, self.factors = dict(self.moments), dict(self.factors)
        for side, moment in moments.items():
            old = self.moments.get(side)
            self.moments[side] = (moment.float() if old is None
                                  else opts.moment_decay * old + (1 - opts.moment_decay) * moment)
            self.factors[side] = self.factor_of(side, self.moments[side])

    def factor_of(self, side, moment):
        """The factor of one side's smoothed moment (production adds the dense kinds)."""
        return whitening_factor(moment, self.opts.whiten_rank, self.opts.damping)


@dataclass
class HadamardLayer:
    """Randomized-Hadamard coordinates of one matrix (section 3c), the geometry-agnostic
    control: n random signs for the columns (and m for the rows with hadamard_sides="both"),
    drawn from the layer's seed - no statistics. The same interface as SubspaceLayer: refresh()
    draws the signs the first time and never changes them, so a refresh step only re-judges the
    layer (the communicator proposes it again and the next step measures it)."""
    shape: tuple
    seed: int                           # zlib.crc32(name) + GeoOptions.seed
    opts: object = field(repr=False)    # the GeoOptions (hadamard_block, hadamard_sides)
    column_signs: torch.Tensor = None   # (n,) +-1: S of H = G S B
    row_signs: torch.Tensor = None      # (m,) +-1, with hadamard_sides="both"
    use_geo: bool = False
    gain: float = float("nan")
    energy: float = float("nan")        # (subspace only)
    transform = ()                      # (subspace only: no Householder rotation)
    swaps = None                        # (subspace only: no core scattering)
    from_moments = False                # refresh() only draws the signs, once

    @classmethod
    def create(cls, name, shape, opts):
        """Its signs' seed: the name's and the run's, the same on every rank."""
        return cls(shape, zlib.crc32(name.encode()) + opts.seed, opts)

    @property
    def ready(self):
        return self.column_signs is not None

    @property
    def sides(self):
        return self.opts.hadamard_sides

    @property
    def r(self):
        """The Walsh-Hadamard block size along each row (hadamard_block, or less for a narrow
        matrix): what the layer table shows in its r column."""
        return hadamard_cuts(self.shape[1], self.opts.hadamard_block)[0][1]

    @property
    def row_local(self):
        return self.row_signs is None

    def encode(self, g):
        """H = G S B, then with row signs the same along the columns (on H^T)."""
        h = randomized_hadamard(g, self.column_signs, self.opts.hadamard_block)
        if self.row_signs is not None:
            h = randomized_hadamard(h.T, self.row_signs, self.opts.hadamard_block).T
        return h

    def decode(self, h):
        """G = H B S, after undoing the columns' transform if there is one."""
        if self.row_signs is not None:
            h = randomized_hadamard_inverse(h.T, self.row_signs, self.opts.hadamard_block).T
        return randomized_hadamard_inverse(h, self.column_signs, self.opts.hadamard_block)

    def refresh(self, mean, rows=ALL_ROWS):
        """Draw the signs, the first time (after that there is nothing to refresh): from a CPU
        generator seeded with the layer's seed, so every rank draws the same. `mean` (the
        decoded mean, as the other geometries are refreshed from) gives only the device."""
        if self.ready:
            return
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        m, n = self.shape
        self.column_signs = random_signs(n, generator).to(mean.device)
        if self.opts.hadamard_sides == "both":
            self.row_signs = random_signs(m, generator).to(mean.device)


class Communicator:
    """Gradient averaging through the two-stage collective for a fixed list of named tensors,
    each matrix in Euclidean or geometry-aware coordinates, chosen by its measured gain.

    `reduce(grads, moments)` averages across the process group in place (train.py, the DDP
    hook); `reduce_workers(per_worker_grads, moments)` runs the identical numerics for W
    simulated workers in one process (the fidelity tool, tests). Both return the bytes one rank
    sends. `moments` are the whitened layers' K-FAC statistics (forward hooks) on the
    steps where `wants_moments()` is true, already averaged over the ranks; the subspace
    rotation and the Hadamard control need none. ProductionCommunicator (see above) adds what
    training at scale needs around it."""
    LAYERS = {"geofp8": WhitenedLayer, "subspace": SubspaceLayer, "hadamard": HadamardLayer}

    def __init__(self, named_shapes, options=None, group=None, linear=None, timer=NO_TIMER):
        self.opts = options or GeoOptions()
        self.group = group
        self.timer = timer          # a benchmark's stage timer: where the time goes
        self.names = [n for n, _ in named_shapes]
        self.shapes = {n: tuple(s) for n, s in named_shapes}
        self.index = {n: i for i, n in enumerate(self.names)}
        self.reasons = {}
        self.kind = self.LAYERS.get(self.opts.geometry)     # the layer class (None: Euclidean)
        self.layers = {}        # name -> the coordinates in use (measured, or Euclidean)
        self.candidates = {}    # name -> a new geometry, not yet measured: not used (see _propose)
        for n, shape in named_shapes:
            reason = exemption(n, shape, self.opts, linear)
            if reason:
                self.reasons[n] = reason
            else:
                self.layers[n] = self._new_layer(n)
        unknown = set(self.opts.geo_layers) - set(self.names) if self.opts.select == "list" else ()
        if unknown:
            raise ValueError(f"geo_layers names {len(unknown)} tensors this model does not have, "
                             f"e.g. {sorted(unknown)[0]!r}: profile this model (nanogeo.tools.profile)")
        # the whitening: layers refreshed from K-FAC moments, which the hooks must then collect
        self.uses_moments = bool(self.layers) and self.kind.from_moments
        self.views = {}         # name -> the optimizer's view of it (watch()); none: plain L2
        self.chosen = set(self.opts.geo_layers) if self.opts.select == "list" else set()
        self.step = 0
        self.residuals = {}     # worker index -> {name: fp32 residual}, with error feedback
        self.across_ranks = False   # the latest step ran over the process group (set by
        self.rows = {}              # reduce / reduce_workers / advance), and its FSDP row blocks

    def _new_layer(self, name):
        return self.kind.create(name, self.shapes[name], self.opts)

    # -- coordinates ---------------------------------------------------------------------------

    def is_geo(self, name):
        layer = self.layers.get(name)
        return (layer is not None and layer.use_geo and layer.ready
                and self.step > self.opts.geo_warmup)

    def coords(self, name):
        return "geo" if self.is_geo(name) else "euclidean"

    def to_coords(self, name, g):
        return self.layers[name].encode(g) if self.is_geo(name) else g

    def from_coords(self, name, h):
        return self.layers[name].decode(h) if self.is_geo(name) else h

    def wants_moments(self):
        """True on the steps whose K-FAC statistics the next reduce() refreshes the factors from
        (the published method collects them on refresh steps only)."""
        return self.uses_moments and self.step % self.opts.geo_refresh == 0

    def moment_layers(self):
        """Names of the weights whose layers' statistics the whitening needs."""
        return list(self.layers) if self.uses_moments else []

    def whitened_sides(self):
        sides = self.opts.whiten_sides
        return ("input", "output") if sides == "both" else (sides,)

    def watch(self, views):
        """Judge each layer by the error its optimizer sees: views =
        {name: the optimizer's view of it} (section 4b). Without them a
        layer's coordinates are chosen by plain L2 error."""
        self.views = dict(views)
        return self

    # -- one step --------------------------------------------------------------------------------

    def reduce(self, grads, moments=None):
        """Average grads (a list matching the names) across the group, in place. Returns the
        bytes this rank sent."""
        self.across_ranks = dist.is_initialized()
        rank = dist.get_rank(self.group) if self.across_ranks else 0
        means, nbytes = self._step({rank: grads}, self._exchange, moments)
        for g, m in zip(grads, means):
            g.copy_(m)
        return nbytes

    def reduce_workers(self, worker_grads, moments=None):
        """The same numerics for W simulated workers. Returns (means, bytes sent per rank)."""
        self.across_ranks = False
        return self._step(dict(enumerate(worker_grads)), self._simulate, moments)

    def _step(self, worker_grads, collective, moments):
        """One step for the workers this process holds ({index: gradients}: its rank, or every
        simulated worker): into coordinates, through the collective, error feedback, back to
        original coordinates, and on refresh steps the geometry. Returns (means, bytes sent)."""
        with self.timer.stage("rotate"):
            prepared = {w: self._prepare(g, w) for w, g in worker_grads.items()}
        coords = {w: c for w, (_, c) in prepared.items()}
        mean_coords, nbytes, local = collective(list(coords.values()))
        if self.opts.error_feedback:
            self._keep_residuals(coords, local, mean_coords)
        with self.timer.stage("rotate"):
            means = [self.from_coords(n, h) for n, h in zip(self.names, mean_coords)]
        moments = self._average_moments(moments, mean_coords[0].device)
        self.advance(dict(zip(self.names, means)), [g for g, _ in prepared.values()],
                     self.across_ranks, moments=moments)
        return means, nbytes

    def _has_feedback(self, name):
        return self.opts.error_feedback and (not self.opts.feedback_geo_only or self.is_geo(name))

    def _prepare(self, grads, worker):
        """(gradients as sent, in original coordinates; the same in the coordinates in use)."""
        residual = self.residuals.get(worker, {})
        outgoing, coords = [], []
        for n, g in zip(self.names, grads):
            g = g.float()
            if self._has_feedback(n) and n in residual:
                g = g + residual[n]         # the residual, in original coordinates
            outgoing.append(g)
            coords.append(self.to_coords(n, g))
        return outgoing, coords

    def _keep_residuals(self, coords, local, mean_coords):
        """Error feedback: the part of each worker's gradient that the codec lost (coords: {worker:
        its tensors in coordinates}, local: their own round trips), mapped back to original
        coordinates - so a refresh of the geometry re-expresses it in the new ones at the next
        encode (the published method keeps it in the old coordinates: defect c)."""
        for (worker, in_coords), returned in zip(coords.items(), local):
            self.residuals[worker] = {n: self._residual(n, c - back)
                                      for n, c, back in zip(self.names, in_coords, returned)
                                      if self._has_feedback(n)}

    def _residual(self, name, lost):
        """What error feedback keeps of the codec's loss `lost` (in coordinates): the same in
        original coordinates."""
        return self.from_coords(name, lost)

    def _average_moments(self, moments, device):
        """The K-FAC statistics the geometry is refreshed from must be the same on every rank:
        across ranks, their mean over the group (equal weights: every rank runs the same number
        of tokens; ProductionCommunicator weights by token counts)."""
        if not self.across_ranks or moments is None:
            return moments
        world = world_size(self.group)          # (every rank collects every whitened layer)
        return {side: {n: self._sum_over_ranks(moments[side][n].clone()) / world
                       for n in self.moment_layers()} for side in self.whitened_sides()}

    def _exchange(self, coords):
        """The collective over the process group, for this rank's tensors (coords: [them]).
        Returns (means in coordinates, bytes sent, [its local round trip] or None)."""
        (tensors,), opts = coords, self.opts
        means, nbytes, *local = all_reduce_mean(tensors, opts.fmt, opts.block, self.group,
                                                return_local=opts.error_feedback, timer=self.timer)
        return means, nbytes, local or None     # no extra decode without error feedback

    def _simulate(self, coords):
        """The collective's simulator for every worker's tensors (coords[i]: worker i's).
        Returns (means in coordinates, bytes per rank, each worker's local round trip or None)."""
        opts = self.opts
        means, nbytes, *local = simulate_mean(coords, opts.fmt, opts.block,
                                              return_local=opts.error_feedback)
        return means, nbytes, local[0] if local else None

    def _sum_over_ranks(self, t):
        """In place: the sum of t over the process group when the step in progress ran across
        it; a step of one process (or of simulated workers, summed already) leaves t as it is."""
        if self.across_ranks:
            dist.all_reduce(t, group=self.group)
        return t

    # -- the geometry, on refresh steps ----------------------------------------------------------

    def advance(self, means, worker_grads, across_ranks=False, rows=None, moments=None):
        """Count a finished step; on refresh steps update the geometry. `means` maps names to
        decoded mean gradients - under FSDP only this rank's block of rows, described by
        rows[name] (FSDP's row blocks; whole tensors otherwise). `worker_grads`: the
        gradients this process sent (one list per simulated worker). across_ranks: the step
        ran over the process group (so the gain measurements are summed over it)."""
        whiten_now = self.step % self.opts.geo_refresh == 0 and moments is not None  # of this step
        self.across_ranks, self.rows = across_ranks, rows or {}
        self.step += 1
        if self.layers and self._geometry_due(whiten_now):
            self._update_geometry(means, worker_grads, moments, whiten_now)

    def _geometry_due(self, whiten_now):
        """Does this step touch the geometry (candidates to measure, a refresh, a re-judging)?
        An opted-in layer's new geometry (in use unmeasured) is measured at the next step too."""
        unmeasured = any(layer.ready and math.isnan(layer.gain) for layer in self.layers.values())
        if self.candidates or unmeasured:
            return True
        if self.uses_moments:
            return whiten_now or self.step % self.opts.judge_every == 0
        return (self.step % self.opts.geo_refresh == 0
                or any(not layer.ready for layer in self.layers.values()))

    def _update_geometry(self, means, worker_grads, moments, whiten_now):
        """Measure the candidates (and, for the whitening, re-judge the factors in use), then
        propose new geometry where it is due. Returns True if new geometry was proposed."""
        judged = [n for n, layer in self.layers.items() if n in self.candidates
                  or (layer.ready and (self.uses_moments or math.isnan(layer.gain)))]
        if judged:
            self._judge(judged, worker_grads, means)
        if self.uses_moments:                   # statistics: the layer's K-FAC moments
            statistics = ({n: self._statistics(n, moments) for n in self.layers}
                          if whiten_now else {})
            statistics = {n: stats for n, stats in statistics.items() if stats}
        else:                                   # ... or its decoded mean gradient
            statistics = {n: means[n] for n, layer in self.layers.items()
                          if self.step % self.opts.geo_refresh == 0 or not layer.ready}
        for n, stats in statistics.items():
            self._propose(n, stats)
        return bool(statistics)

    def _statistics(self, name, moments):
        """{side: A or G} of a whitened layer from this step's averaged moments."""
        return {side: moments[side][name] for side in self.whitened_sides()
                if name in moments.get(side, {})}

    # -- do no harm: new geometry is a candidate until measured ---------------------------------
    #
    # A geometry built from step t's statistics (the decoded mean, the K-FAC moments) has seen
    # step t: judged on step t's gradients it looks better than it will be (in sample). So a new
    # geometry is a *candidate*, kept beside the coordinates in use; the next step's gradients,
    # which did not build it, measure it against Euclidean in the error the layer's optimizer
    # sees, and only then does it replace the layer in use - geometry-aware if it measured
    # better by geo_enter_gain, Euclidean otherwise. Until then the layer keeps coordinates that
    # were measured (or Euclidean ones): from the first step and after every refresh.

    def _propose(self, name, statistics):
        """A candidate for `name`: the layer's geometry refreshed from this step's statistics (a
        copy: refresh() assigns new tensors, never changes the old ones; it keeps use_geo, so
        the hysteresis applies when it is measured). The explicit opt-ins take it at once: no
        measurement could change their choice."""
        candidate = copy.copy(self.layers[name])
        candidate.gain = float("nan")          # not measured yet
        candidate.refresh(statistics, self.rows.get(name, ALL_ROWS))
        if self._opted_in(name):
            candidate.use_geo = True
            self.layers[name] = candidate
        else:
            self.candidates[name] = candidate

    def _opted_in(self, name):
        """Geometry-aware whatever a measurement says: select="all", or a listed layer with
        geo_enter_gain = geo_exit_gain = 0 (the paper's fixed choice)."""
        opts = self.opts
        return opts.select == "all" or (name in self.chosen and opts.select != "gain"
                                        and opts.geo_enter_gain <= 0 and opts.geo_exit_gain <= 0)

    def _judge(self, names, worker_grads, means):
        """Measure each layer's candidate (or, without one, the geometry in use) on this step's
        gradients, decide its coordinates, and put the candidates in use."""
        layers = {n: self.candidates.get(n, self.layers[n]) for n in names}
        self._decide(layers, self._measure_gains(layers, worker_grads, means))
        for n in names:
            self.layers[n] = layers[n]
            self.candidates.pop(n, None)

    def _round_trip(self, x):
        return dequantize(quantize(x, self.opts.fmt, self.opts.block))

    def _measure_gains(self, layers, worker_grads, means):
        """(euclidean, geometry-aware) error of the gradients actually sent, with each layer's
        geometry ({name: layer}), as the layer's optimizer sees it (error_measure) - measured on
        each rank's own gradients, summed by one all-reduce, so every rank takes the same
        decision."""
        errors = []
        variants = self._variants()
        world = world_size(self.group) if self.across_ranks else 1
        for n, layer in layers.items():
            view = self.views.get(n) if self.opts.geo_judge == "optimizer" else None
            seen = error_measure(view, means[n], self.rows.get(n), world * len(worker_grads))
            for grads in worker_grads:
                g = grads[self.index[n]].float()
                errors.append(seen(self._round_trip(g) - g))
                errors += [seen(self._through_codec(layer, g, sides) - g) for sides in variants]
        errors = torch.stack(errors).double().view(len(layers), len(worker_grads), -1).sum(1)
        self._sum_over_ranks(errors)
        return errors.cpu()                                 # one transfer per measurement

    def _variants(self):
        """The geometry-aware codecs the gain check compares with Euclidean: the layer's own, or
        with sides="auto" both rotations - both sides, and the column side alone, which keeps
        every row's scale (an error spread over rows lands on rows AdamW divides by their own,
        possibly tiny, second moments: BENCHMARKS.md section 12)."""
        auto = (self.opts.sides == "auto" and self.kind is not None
                and issubclass(self.kind, SubspaceLayer))
        return ("both", "right") if auto else (None,)

    def _through_codec(self, layer, g, sides=None):
        """g through the codec in the layer's coordinates (sides=None) or in those of a
        rotation of `sides`, back in original coordinates."""
        if sides is None:
            return layer.decode(self._round_trip(layer.encode(g)))
        rotation = layer.rotation(sides)
        return layer.decode(self._round_trip(layer.encode(g, rotation)), rotation)

    def _decide(self, layers, errors):
        """Hysteresis on the measured gain: enter geo at geo_enter_gain, leave below
        geo_exit_gain. With a list of layers only the chosen may enter, and they leave too when
        their geometry-aware error exceeds Euclidean's (both gains 0: never). With sides="auto"
        each layer takes the better of its measured rotations."""
        variants = self._variants()
        for (n, layer), (euclid, *geos) in zip(layers.items(), errors.tolist()):
            best = min(range(len(geos)), key=lambda k: geos[k])
            geo = geos[best]
            if variants[best] is not None and variants[best] != layer.sides:
                layer.rotate_sides(variants[best])
            layer.gain = (math.sqrt(euclid / geo) if geo > 0
                          else (float("inf") if euclid > 0 else 1.0))
            self._choose(n, layer)

    def _choose(self, name, layer):
        layer.use_geo = goes_geometry_aware(layer, self.opts, listed=name in self.chosen)
