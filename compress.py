"""
Geometry-aware FP8 gradient communication, in one file to read top to bottom.

Data-parallel training averages W ranks' gradients every step; FP8 (a byte an element) instead
of bf16 halves the bytes. FP8 is floating point: a block of values shares one fp32 scale that
maps its largest magnitude onto the format's largest value, and each value keeps a precision of
its own size (~6 % for e4m3). LLM weight gradients are anisotropic - a few directions carry most
of the energy - so in their own coordinates every element's rounding error is set by the
dominant part, and the small directions drown in it.

The idea (from the GeoFP8 paper, arXiv 2607.07494): send each matrix in coordinates where its
geometry is round, quantize there, average with the usual collective, and map back. The map is
linear and the same on every rank, so averaging in coordinates and decoding once is exact. Two
coordinate systems share one interface (encode, decode, refresh): GeoFP8, the paper's whitening
(section 3), G~ = G F^-T with F F^T ~ A, the layer's K-FAC input second moment; and this
project's subspace rotation (section 4), H = P^T G Q toward the dominant singular directions of
earlier averaged gradients. A matrix uses its coordinates only while they measurably lower the
error as its optimizer sees it (section 5); one function decides, Communicator.decide (section
6); new geometry is measured on later gradients before it is used (do no harm).

What to run (the studies' answer, with its intervals and limits: docs/study/README.md): under
Muon, the subspace rotation on the two-stage collective of section 2.

`python compress.py` (section 7) shows it work; `train.py --impl=reference` trains with this
file's Communicator. This file is the specification and imports nothing from nanogeo/, which
computes the same bits faster (packed codecs, buckets, stacked rotations) and adds what a run
at scale needs (stochastic rounding, K-FAC hooks, DDP and FSDP2, checkpoints); tests hold the
two equal method by method (docs/method.md has the map). Error feedback, a stage-2 format of its
own (the README's 4-bit and mixed wires) and the paper's FP8-sum collective are in section 2.
"""

import copy
import functools
import itertools
import math
import warnings
import zlib
from collections import namedtuple
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist


# ==== 1. The codecs: FP8 (e4m3, e5m2) with an fp32 scale per group; NVFP4 =========================

FP8_FORMATS = {  # name -> (torch dtype, largest finite value)
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}
FP32_MAX = torch.finfo(torch.float32).max


class Quantized(namedtuple("Quantized", "buffer shape fmt block")):
    """A quantized tensor: buffer, its uint8 wire bytes (their layout: quantize), and the shape, fmt
    and block (elements per scale group: an int, "row" or "tensor") it was quantized with."""
    __slots__ = ()
    nbytes = property(lambda self: self.buffer.numel())     # exactly the bytes it puts on the wire


def check_codec(fmt, block):
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt != "nvfp4" and not (block in ("row", "tensor") or isinstance(block, int) and block > 0):
        raise ValueError(f"block must be a positive int, 'row' or 'tensor', got {block!r}")


def num_groups(shape, block):
    """How many scale groups (each with its own scale) a tensor of this shape has."""
    if block == "tensor":
        return 1
    if block == "row":
        return shape[0] if len(shape) >= 2 else 1
    return -(-math.prod(shape) // block)


def scale_groups(x, block):
    """View x as (groups, group_len) fp32: one scale per group. Integer blocks pad the flattened
    tensor with zeros to a whole number of groups (a copy only where padding is needed)."""
    flat, groups = x.reshape(-1).float(), num_groups(x.shape, block)
    if isinstance(block, int):                          # (an empty x: (0, block))
        padding = groups * block - flat.numel()
        return (torch.nn.functional.pad(flat, (0, padding)) if padding else flat).view(-1, block)
    return flat.view(groups, -1)


def wire_nbytes(shape, fmt, block):
    """Exact size of quantize(x of this shape).buffer."""
    numel = math.prod(shape)
    if not numel:
        return 0
    if fmt == "nvfp4":
        return 4 + num_groups(shape, NVFP4_BLOCK) + (numel + 1) // 2
    groups = num_groups(shape, block)
    return groups * (4 + (block if isinstance(block, int) else numel // groups))


def scale_from_amax(amax, fmax):
    """s = fmax / amax, elementwise (1 where amax is 0; at most fp32's max)."""
    return torch.where(amax > 0, fmax / amax, 1.0).clamp(max=FP32_MAX)


def fp8_encode(groups, fmax, dtype):
    """(n, L) fp32 -> scales (n,) fp32 and codes (n, L) uint8, rounded to nearest even."""
    scale = scale_from_amax(groups.abs().amax(dim=1), fmax)            # (n,)
    y = (groups * scale[:, None]).clamp(-fmax, fmax)                   # saturated at +-fmax
    return scale, y.to(dtype).view(torch.uint8)


def fp8_decode(codes, scale, dtype):
    """codes (n, L) uint8 and their scales (n,) -> (n, L) fp32."""
    return codes.view(dtype).float() / scale[:, None]


def fp8_pack(scale, codes):
    """scales (n,) and codes (n, L) -> the wire: per group [fp32 scale | L codes]."""
    return torch.cat([scale.view(torch.uint8).view(-1, 4), codes], dim=1).view(-1)


# The formats that send each scale group as [fp32 scale | a byte a value], by name: (encode,
# decode), encode (n, L) fp32 -> scales (n,) fp32 and codes (n, L) uint8, decode its inverse.
# quantize, dequantize and wire_nbytes serve each one alike; FORMATS (train.py's --fmt choices)
# lists them. A new one-byte format is a pair of functions and one line here (docs/ablate.md).
BYTE_CODECS = {fmt: (functools.partial(fp8_encode, fmax=fmax, dtype=dtype),
                     functools.partial(fp8_decode, dtype=dtype))
               for fmt, (dtype, fmax) in FP8_FORMATS.items()}
FORMATS = (*BYTE_CODECS, "nvfp4")       # every format quantize knows


# NVFP4 (the 4-bit format of NVIDIA's Blackwell GPUs): blocks of 16 values, each an e2m1 number
# (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), each block scaled by an e4m3 number, and one fp32
# scale per tensor that brings the largest block scale to the top of e4m3's range. Two values a
# byte: ~0.56 bytes a value, against ~1.03 for e4m3 with groups of 128. NVFP4's scales multiply to
# decode, as NVIDIA defines the format - the opposite of FP8's s above, which multiplies to encode.
NVFP4_BLOCK = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)    # a 4-bit code: sign << 3 | index


def e2m1_codes(y):
    """4-bit codes of y (|y| <= 6), to nearest: the index counts the midpoints between grid values
    that |y| has passed; ties to the even code (0.25, 1.25, 2.5, 5 down; 0.75, 1.75, 3.5 up)."""
    a, idx = y.abs(), torch.zeros_like(y, dtype=torch.uint8)
    for tie in (0.25, 1.25, 2.5, 5.0):
        idx += a > tie
    for tie in (0.75, 1.75, 3.5):
        idx += a >= tie
    return idx | (y < 0).to(torch.uint8) << 3


def nvfp4_tensor_scale(amax):
    """The fp32 scale that brings the largest block scale to e4m3's max - 1 where amax
    is 0, at least fp32's smallest normal (a subnormal quotient would round to 0, and 0 / 0 =
    NaN). The divisor is a tensor, as in count_divisor."""
    divisor = torch.full_like(amax, E2M1_MAX * E4M3_MAX)
    scale = (amax / divisor).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(amax > 0, scale, 1.0)


def nvfp4_encode(blocks, amax, scale):
    """blocks (n, 16) fp32, their amax (n,) and tensor scale ((n,) or (1,)) -> block scales (n,)
    as e4m3 bytes and codes (n, 8) uint8, two a byte, low nibble first: each block's amax maps
    to the top of the e2m1 grid (6)."""
    block_scale = (amax / (E2M1_MAX * scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block_scale.float() * scale                                 # (n,) decoded block scale
    y = torch.where(step[:, None] > 0, blocks / step[:, None], torch.zeros_like(blocks))
    codes = e2m1_codes(y.clamp(-E2M1_MAX, E2M1_MAX))                    # (n, 16)
    return block_scale.view(torch.uint8), codes[:, 0::2] | (codes[:, 1::2] << 4)


@functools.lru_cache(maxsize=None)
def e2m1_grid(device):
    """The value of each 4-bit code (8: -0.0) on `device`, made once (not copied every call)."""
    return torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), device=device)


def nvfp4_decode(block_scale, nibbles, scale):
    """Inverse of nvfp4_encode: e4m3 bytes (n,), codes (n, 8) and tensor scale -> (n, 16) fp32."""
    codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=2).view(-1).long()   # low first
    values = e2m1_grid(nibbles.device).index_select(0, codes).view(-1, NVFP4_BLOCK)
    return values * (block_scale.view(torch.float8_e4m3fn).float() * scale)[:, None]


def count_divisor(count, like):
    """`count` (W ranks) as a 0-dim fp32 tensor on `like`'s device, to divide a sum of W copies
    by: CUDA divides by a Python number as a product with its reciprocal, another last bit."""
    return torch.full((), count, dtype=torch.float32, device=like.device)


def quantize(x, fmt="e4m3", block=128) -> Quantized:
    """x -> its wire bytes. A one-byte format (BYTE_CODECS): each group is sent as [fp32 scale |
    its codes] - FP8's scale s = fmax / amax, values cast as torch casts x * s, saturated at
    +-fmax (a finite input never decodes to NaN or inf); the last group of an integer block
    is zero-padded and sent whole, so a bucket's groups stack into one (groups, 4 + block) byte
    matrix. NVFP4 (`block` ignored): [fp32 tensor scale | e4m3 block scales | codes, the last
    block's padding cut]."""
    check_codec(fmt, block)
    if x.numel() == 0:
        buffer = torch.empty(0, dtype=torch.uint8, device=x.device)
    elif fmt == "nvfp4":
        buffer = nvfp4_wire(x)
    else:
        encode, _ = BYTE_CODECS[fmt]
        buffer = fp8_pack(*encode(scale_groups(x, block)))
    return Quantized(buffer, x.shape, fmt, block)


def nvfp4_wire(x):
    """x (not empty) -> NVFP4 wire bytes: [tensor scale | block scales | codes, padding cut]."""
    blocks = scale_groups(x, NVFP4_BLOCK)                              # (n, 16)
    amax = blocks.abs().amax(dim=1)
    scale = nvfp4_tensor_scale(amax.max()).reshape(1)
    block_scale, nibbles = nvfp4_encode(blocks, amax, scale)
    codes = nibbles.view(-1)[: (x.numel() + 1) // 2]
    return torch.cat([scale.view(torch.uint8), block_scale, codes])


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 tensor of q's shape."""
    numel = math.prod(q.shape)
    if numel == 0:
        return torch.zeros(q.shape, device=q.buffer.device)
    if q.fmt != "nvfp4":    # per group [fp32 scale | codes]
        rows = q.buffer.view(num_groups(q.shape, q.block), -1)
        # scales copied out: a float32 view needs 4-byte alignment, and a piece starts anywhere
        scale = rows[:, :4].reshape(-1).clone().view(torch.float32)
        _, decode = BYTE_CODECS[q.fmt]
        values = decode(rows[:, 4:], scale)
    else:       # [tensor scale | a scale per block | codes], the last block's unsent codes 0
        n_blocks = num_groups(q.shape, NVFP4_BLOCK)
        tensor_scale = q.buffer[:4].clone().view(torch.float32)
        unsent = 8 * n_blocks - (numel + 1) // 2          # the last block's padding codes
        nibbles = torch.nn.functional.pad(q.buffer[4 + n_blocks:], (0, unsent))
        values = nvfp4_decode(q.buffer[4: 4 + n_blocks], nibbles.view(n_blocks, 8), tensor_scale)
    return values.reshape(-1)[:numel].view(q.shape)


# ==== 2. The two-stage collective: quantize -> all_to_all -> fp32 mean -> re-quantize -> all_gather ====
#
# Rank j owns the j-th share of every tensor, its shard. Stage 1 (a reduce-scatter): each rank
# quantizes its gradients and sends every rank its shard (all_to_all); each rank decodes the W
# copies of its shard, adds them in fp32 in rank order and divides by W. Stage 2 (an all-gather):
# each rank quantizes its averaged shard again and all_gathers; every rank decodes the same
# bytes, so every rank ends with the same bits. Bytes a rank sends: ~2 (W - 1)/W N (1 + 4/block),
# 0.516x a bf16 ring all-reduce's at block 128 (NVFP4: ~0.28x). (The paper's collective, at the
# end of this section, adds FP8 codes hop by hop instead.)
#
# Stage 2 may send another format than stage 1 (stage2_fmt): an NVFP4 all_to_all and an e4m3
# all_gather is the README's mixed wire. Error feedback keeps what a quantization lost and adds it
# to the same place's next send, so that over steps the errors cancel instead of adding up:
# stage 1's residual is each rank's (its gradient minus its own round trip, Communicator
# .keep_send_losses), stage 2's each owner's (its shard's mean minus what it gathered,
# ShardLayout.average_shard).

# one output tensor for the W inputs (torch 2.13 renamed all_gather_into_tensor)
all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


# The part of one tensor that one rank owns: a contiguous range of whole scale groups, so that
# cutting into shards never changes what is quantized together. index: the tensor's place in the
# bucket; [start, end): the flat element range; shape: how it is quantized ((rows, row_len) for
# row scaling, else (end - start,)); block: its scale groups.
Piece = namedtuple("Piece", "index start end shape block")


class ShardLayout:
    """How a bucket of tensors is cut into W shards (alike on every rank, from the shapes), and
    the two stages' codec steps. Stage 2 may send another format (stage2_fmt, e.g. e4m3 after an
    NVFP4 all_to_all): both stages quantize the same pieces, cut in the groups of the FP8 one of
    the two (an integer block, a multiple of 16, holds NVFP4's blocks of 16 whole), each scaling
    them in its own groups from the piece's start."""

    def __init__(self, shapes, fmt, block, world_size, stage2_fmt=""):
        check_codec(fmt, block)
        check_codec(stage2_fmt or fmt, block)
        self.fmt, self.stage2_fmt = fmt, stage2_fmt or fmt
        self.cut_fmt = self.stage2_fmt if fmt == "nvfp4" else fmt       # the pieces' groups
        block = NVFP4_BLOCK if self.cut_fmt == "nvfp4" else block
        self.shapes, self.block = [tuple(s) for s in shapes], block
        self.world_size = world_size
        self.pieces = self.cut()                                # pieces[j]: rank j's shard
        self.piece_nbytes = self.piece_sizes(fmt)                     # stage 1's wire bytes
        self.stage2_piece_nbytes = self.piece_sizes(self.stage2_fmt)    # stage 2's
        self.nbytes = [sum(s) for s in self.piece_nbytes]       # each shard's, stage 1
        self.stage2_nbytes = [sum(s) for s in self.stage2_piece_nbytes]

    def groups_of(self, shape):
        """(elements per scale group, the pieces' block) of one tensor ("tensor" scaling: W
        equal ranges with a scale each; one scale would make one rank own the whole tensor)."""
        numel = math.prod(shape)
        if isinstance(self.block, int):
            return self.block, self.block
        if self.block == "row" and len(shape) >= 2:
            return (numel // shape[0] if shape[0] else 0), "row"
        return -(-numel // self.world_size), "tensor"      # (also "row" of a 1-D tensor)

    def cut(self):
        """Each tensor's scale groups in W equal counts, rank j the j-th range; the groups
        left over go to the shards with the fewest bytes so far (ties: the lower rank), as the
        all_gather pads every shard to the largest (else one rank piles up the remainders)."""
        W = self.world_size
        pieces, load = [[] for _ in range(W)], [0] * W
        for t, shape in enumerate(self.shapes):
            numel, (group_len, block) = math.prod(shape), self.groups_of(shape)
            base, extra = divmod(-(-numel // group_len) if group_len else 0, W)
            lightest, first = set(sorted(range(W), key=lambda j: (load[j], j))[:extra]), 0
            for j in range(W):
                count = base + (j in lightest)
                start, end = first * group_len, min(numel, (first + count) * group_len)
                first += count
                if end > start:     # (an empty range is no piece)
                    shape = (count, group_len) if block == "row" else (end - start,)
                    pieces[j].append(Piece(t, start, end, shape, block))
                    load[j] += wire_nbytes(shape, self.cut_fmt, block)
        return pieces

    def piece_sizes(self, fmt):
        """[[wire bytes of each piece] of each shard] in format `fmt`."""
        return [[wire_nbytes(p.shape, fmt, p.block) for p in shard] for shard in self.pieces]

    def quantize_piece(self, values, piece):
        """One piece through the codec, its wire bytes."""
        return quantize(values.view(piece.shape), self.fmt, piece.block).buffer

    def quantize_shards(self, flats):
        """Stage 1, a rank's flat fp32 tensors -> one uint8 buffer, the W shards back to
        back (shard j: nbytes[j] bytes)."""
        return torch.cat([self.quantize_piece(flats[p.index][p.start:p.end], p)
                          for shard in self.pieces for p in shard])

    def decode_shard(self, buffer, shard, stage=1):
        """One shard's bytes, as stage 1 or stage 2 sent them -> the flat fp32 values of each
        of its pieces."""
        fmt = self.fmt if stage == 1 else self.stage2_fmt
        sizes = (self.piece_nbytes if stage == 1 else self.stage2_piece_nbytes)[shard]
        return [dequantize(Quantized(b, p.shape, fmt, p.block)).reshape(-1)
                for b, p in zip(buffer[: sum(sizes)].split(sizes), self.pieces[shard])]

    def sum_copies(self, received, shard):
        """The W copies of a shard (back to back, in source-rank order), decoded and added
        in fp32 in rank order (every rank and the simulator add alike): a tensor per piece."""
        copies = [self.decode_shard(c, shard) for c in received.split(self.nbytes[shard])]
        return [functools.reduce(torch.add, copies_of_piece)      # (c0 + c1) + ...
                for copies_of_piece in zip(*copies)]

    def average_shard(self, received, shard, feedback=None):
        """Between the stages, on the owner of `shard`: the mean of its W copies, quantized
        again in stage 2's format (the bytes stage 2 gathers). `feedback` (stage 2's error
        feedback: {shard: [a residual per piece]}, the owner's): the residual is added to the
        mean before it is quantized, and what that quantization loses is kept for the next step."""
        W = count_divisor(self.world_size, received)
        to_send = [v / W for v in self.sum_copies(received, shard)]
        if feedback is not None and shard in feedback:
            to_send = [m + r for m, r in zip(to_send, feedback[shard])]
        parts = [quantize(m.view(p.shape), self.stage2_fmt, p.block).buffer
                 for m, p in zip(to_send, self.pieces[shard])]
        out = torch.cat(parts) if parts else received.new_empty(0)
        if feedback is not None:
            arrives = self.decode_shard(out, shard, stage=2)
            feedback[shard] = [m - d for m, d in zip(to_send, arrives)]
        return out

    def dequantize_shards(self, buffer, stride=None, stage=2):
        """Stage 2's end, the W shards' bytes (shard j at j * stride, or back to back as
        stage 1 wrote them) -> the bucket's values, flat fp32 in tensor order (stage=1: bytes
        in stage 1's format, a rank's own send)."""
        starts = [0, *itertools.accumulate(math.prod(s) for s in self.shapes)]
        nbytes = self.nbytes if stage == 1 else self.stage2_nbytes
        at = itertools.accumulate(nbytes, initial=0) if stride is None else \
            range(0, stride * self.world_size, stride)                 # where shard j begins
        flat = torch.zeros(starts[-1], device=buffer.device)
        for j, (pieces, offset) in enumerate(zip(self.pieces, at)):
            for p, values in zip(pieces, self.decode_shard(buffer[offset:], j, stage)):
                flat[starts[p.index] + p.start: starts[p.index] + p.end] = values
        return flat

    def quantize_ranks(self, rank_tensors):
        """The simulator's stage 1 of all W ranks: (W, bytes), row i = quantize_bucket(rank i's
        tensors)."""
        return torch.stack([quantize_bucket(tensors, self) for tensors in rank_tensors])


def quantize_bucket(tensors, layout):
    """Stage 1 of a rank: its tensors -> one uint8 buffer, the W shards back to back."""
    flats = [t.reshape(-1).float() for t in tensors]
    if not sum(layout.nbytes):           # only empty tensors: nothing to send
        return flats[0].new_empty(0, dtype=torch.uint8)
    return layout.quantize_shards(flats)


def dequantize_bucket(buffer, layout, stride=None, stage=2):
    """Stage 2's end: full fp32 tensors from the W shards' bytes in `buffer` (alike on all
    ranks); stage=1: from a rank's own stage-1 send (its round trip, for error feedback)."""
    if not sum(layout.nbytes):
        return [torch.zeros(s, device=buffer.device) for s in layout.shapes]
    flat = layout.dequantize_shards(buffer, stride, stage)
    return [t.view(s) for t, s in zip(flat.split([math.prod(s) for s in layout.shapes]),
                                      layout.shapes)]


def collective_bytes(layout, rank):
    """Bytes `rank` sends: its shards for the others in the all_to_all, then its averaged shard
    (padded to the largest shard, as all_gather needs equal sizes) to the W - 1 others."""
    stage1 = sum(n for j, n in enumerate(layout.nbytes) if j != rank)
    return stage1 + (layout.world_size - 1) * max(layout.stage2_nbytes)


def check_world_size(layout, world):
    """A layout cut for another number of ranks: a one-line error that names the fix."""
    if layout.world_size != world:
        raise ValueError(f"the layout is cut for {layout.world_size} ranks, not {world}: "
                         "ShardLayout(shapes, fmt, block, world_size=W)")


def all_reduce_mean(tensors, layout, *, group=None, feedback=None):
    """(The mean of `tensors` over the process group, bytes this rank sent), bit-identical on
    every rank. `layout`: the ShardLayout of these tensors' shapes at the group's size (how
    they are cut and coded); `feedback`: stage 2's error feedback (ShardLayout.average_shard)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    me = dist.get_rank(group) if dist.is_initialized() else 0
    check_world_size(layout, world)
    send = quantize_bucket(tensors, layout)                                # stage 1
    if world == 1:
        return dequantize_bucket(layout.average_shard(send, 0, feedback), layout), 0
    own, largest = layout.nbytes[me], max(layout.stage2_nbytes)
    recv = send.new_empty(world * own)                      # the W copies of this rank's shard
    dist.all_to_all_single(recv, send, [own] * world, layout.nbytes, group=group)
    own_mean = send.new_zeros(largest)          # padded to the largest: all_gather's sizes
    own_mean[:layout.stage2_nbytes[me]] = layout.average_shard(recv, me, feedback)  # stage 2
    gathered = send.new_empty(world, largest)               # row j: rank j's averaged shard
    all_gather_flat(gathered.view(-1), own_mean, group=group)
    means = dequantize_bucket(gathered.view(-1), layout, stride=largest)
    return means, collective_bytes(layout, me)


def simulate_mean(worker_tensors, layout, *, feedback=None):
    """Exactly all_reduce_mean's numerics for W ranks in one process (worker_tensors[i]: rank
    i's tensors; `layout`: cut for W; `feedback`: every owner's stage-2 residuals): (means,
    bytes a rank sends on average)."""
    world = len(worker_tensors)
    check_world_size(layout, world)
    sends = layout.quantize_ranks(worker_tensors)               # row i: rank i's stage 1
    received = sends.split(layout.nbytes, dim=1)    # [j]: the W copies of shard j, (W, bytes)
    shards = [layout.average_shard(received[j].reshape(-1), j, feedback) for j in range(world)]
    nbytes = 0 if world == 1 else sum(collective_bytes(layout, i) for i in range(world)) / world
    return dequantize_bucket(torch.cat(shards), layout), nbytes


# The paper's collective (its baseline, and the studies' worst wire): ONE e5m2 scale per tensor,
# the same on every rank (s = fmax / the max over ranks of its amax: an all_reduce MAX), and the
# FP8 codes themselves summed by NCCL's float8 all_reduce, which widens two codes to fp16, adds
# and rounds back to FP8 (saturating) at every hop of its ring: W - 1 roundings of the partial
# sums, and a sum past the format's max is clipped. Decode: sum / (s W). Here every rank gathers
# all ranks' codes and adds them in a textbook ring's order (chunk c starts at rank c + 1): the
# numerics nanogeo's emulation runs on gloo and simulated ranks. On NCCL the fast path runs
# NCCL's own float8 all_reduce, whose chunks and order are NCCL's - not these bits. The bytes
# counted are the paper's, a ring all_reduce's (the gather here sends W / 2 times the codes).

def fp8_sum_codes(tensors, scales, fmt):
    """Each tensor's codes at its shared scale (scales: (T,)), one flat uint8 buffer."""
    dtype, fmax = FP8_FORMATS[fmt]
    return torch.cat([(t.float().reshape(-1) * s).clamp(-fmax, fmax).to(dtype).view(torch.uint8)
                      for t, s in zip(tensors, scales)])


def ring_sum(codes, fmt):
    """(W, N) FP8 codes summed as a ring all_reduce does: chunk c of W starts at rank c + 1 and
    travels once around, each rank adding its own codes in fp16, rounded back to FP8."""
    (W, n), (dtype, fmax) = codes.shape, FP8_FORMATS[fmt]
    total = torch.empty_like(codes[0])
    for c in range(W):
        start, end = -(-c * n // W), -(-(c + 1) * n // W)
        partial = codes[(c + 1) % W, start:end]
        for hop in range(2, W + 1):
            wide = partial.view(dtype).half()
            wide += codes[(c + hop) % W, start:end].view(dtype).half()
            partial = wide.float().clamp_(-fmax, fmax).to(dtype).view(torch.uint8)
        total[start:end] = partial
    return total


def fp8_sum_mean(worker_tensors, fmt, across_ranks, group=None):
    """The paper's collective: (the mean as every rank decodes it, bytes a rank sends), over
    the process group (worker_tensors: [this rank's tensors]) or among W simulated ranks."""
    amax = torch.stack([torch.stack([t.abs().amax().float() for t in ts])
                        for ts in worker_tensors]).amax(0)                  # (T,), shared
    if across_ranks:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scales = scale_from_amax(amax, FP8_FORMATS[fmt][1])               # (T,), alike on every rank
    codes = [fp8_sum_codes(ts, scales, fmt) for ts in worker_tensors]
    W = dist.get_world_size(group) if across_ranks else len(worker_tensors)
    if across_ranks:                                            # every rank's codes, in order
        every_rank = codes[0].new_empty(W, codes[0].numel())
        all_gather_flat(every_rank.view(-1), codes[0], group=group)
    else:
        every_rank = torch.stack(codes)
    summed = ring_sum(every_rank, fmt).view(FP8_FORMATS[fmt][0]).float()
    tensors = worker_tensors[0]
    values = summed.split([t.numel() for t in tensors])
    means = [(v / (s * W)).view(t.shape) for v, s, t in zip(values, scales, tensors)]
    ring = lambda n, size: int(2 * (W - 1) * n * size // W)    # a ring all_reduce's bytes
    return means, ring(summed.numel(), 1) + ring(len(tensors), 4)     # the codes, the MAX


# ==== 3. The published coordinates: whitening by the K-FAC input factor of each linear layer ======
#
# A linear layer y = M a (M: d_out x d_in) has the weight gradient G = sum over tokens of
# delta a^T; K-FAC approximates its Fisher by A (x) B, A = E[a a^T] (per token, uncentred) and
# B = E[delta delta^T]. With F F^T = A + damping I: encode G~ = G F^-T (each row mixes along
# d_in), decode G = G~ F^T. Not orthogonal: an error E in G~ returns as E F^T, small along input
# directions of small variance, large along those of large variance - the paper's metric. The
# published method whitens the input side with A^ = U diag(lam) U^T + D (top-r eigenpairs, D
# the rest of A's diagonal, floored) by a dense Cholesky factor. A factor of A^ applies in
# O(d_in r) a row instead: with K = D^-1/2 U diag(lam)^1/2 = Z diag(sigma) (thin SVD),
# F = D^1/2 (I + Z diag((1 + sigma^2)^1/2 - 1) Z^T), F^-1 = (I + Z diag((1 + sigma^2)^-1/2 - 1)
# Z^T) D^-1/2 - the same metric as Cholesky's (the factors differ by an orthogonal matrix), not
# the same grid. A comes from forward pre-hooks on refresh steps, averaged over the ranks
# (nanogeo/parallel/hooks.py), and an EMA smooths it across refreshes.

@dataclass
class Whitening:
    """One side's low-rank factor F (F F^T = A^ + damping I) in the form it is applied in:
    sqrt_d (d,) = D^1/2, directions (d, r) = Z and the multipliers up = (1 + sigma^2)^1/2 - 1,
    down = (1 + sigma^2)^-1/2 - 1 of the formula above."""
    kind: str
    size: int                   # d
    sqrt_d: torch.Tensor = None
    directions: torch.Tensor = None
    up: torch.Tensor = None
    down: torch.Tensor = None

    def whiten(self, X):
        """X F^-T for X (m, d): every row of X to whitened coordinates."""
        Y = X / self.sqrt_d
        return Y + ((Y @ self.directions) * self.down) @ self.directions.T

    def unwhiten(self, X):
        """X F^T for X (m, d): back to the original coordinates."""
        return (X + ((X @ self.directions) * self.up) @ self.directions.T) * self.sqrt_d


def top_eigenpairs(A, r, floor, Q=None):
    """A^ = U diag(lam) U^T + diag(rest): the top-r eigenpairs of A (d x d, symmetric;
    eigenvalues clipped at 0) and the floored diagonal residual. Q (d, k), orthonormal: the
    eigenpairs within its columns' span (a Rayleigh-Ritz step: the eigh of Q^T A Q, k x k)."""
    values, vectors = torch.linalg.eigh(A if Q is None else Q.T @ A @ Q)      # ascending
    U, lam = vectors[:, -r:], values[-r:].clamp(min=0)           # (d or k, r), (r,)
    U = U if Q is None else Q @ U                                       # (d, r)
    rest = (A.diagonal() - (U.pow(2) * lam).sum(1)).clamp(min=floor)   # (d,) diagonal residual
    return U, lam, rest


# The factor needs A's r largest eigenpairs only; eigh finds all d of them (~9 d^3 flops in
# float64, memory-bound). Subspace iteration finds the top k = r + 16 directions with a few fp32
# products A Q, each orthonormalised; a Rayleigh-Ritz step in float64 (a k x k eigh) gives their
# eigenpairs. The moments move slowly (their EMA), so a refresh starts from the
# directions of the factor in use: 4 products, 8 from a seeded random start. A direction is found
# to about (lambda_k+1 / lambda_r)^products: an approximation, so it is used where the gain check
# measures every factor before use (a poorer factor can cost the gain, never the error); a layer
# used unmeasured gets the exact eigh.

def whitening_factor(A, r=32, damping=1e-3, floor=1e-3, solver="eigh", old=None):
    """The factor GeoFP8 whitens with, F F^T = A^ + damping I, for a second moment A (d x d):
    computed in float64 (a nearly singular A needs it), returned in A's dtype. solver="subspace":
    A^'s eigenpairs by subspace iteration (its products in fp32), warm-started from `old` (the
    factor in use, or None)."""
    if solver not in ("eigh", "subspace"):
        raise ValueError(f"solver must be 'eigh' or 'subspace', got {solver!r}")
    A64 = (A.double() + A.double().T) / 2
    r = min(r, A.shape[0])
    if solver == "subspace":
        parts = subspace_eigenpairs(A64, r, floor, warm_start=eigen_directions(old))
    else:
        parts = top_eigenpairs(A64, r, floor)
    return factor_of_parts(*parts, damping, A.dtype)


def eigensolver_for(opts):
    """The rule above: the subspace iteration where the gain check measures every factor
    before use (select="gain"), else the exact eigh."""
    return "subspace" if opts.select == "gain" else "eigh"


EPS64, TINY64 = torch.finfo(torch.float64).eps, torch.finfo(torch.float64).tiny


def orthonormal(X):
    """An orthonormal basis of X's columns (X: (d, k), k <= d), in X's dtype, by Cholesky QR:
    with R^T R = X^T X + s I (the k x k Gram matrix's Cholesky factor, in float64), X R^-1 spans
    X's columns; two more passes remove what rounding left. Only matrix products, a Cholesky and
    a triangular solve (no QR), so a stack of matrices goes through in one call of each. The
    shift s (Fukaya et al., 2020; made generous, and in every pass) lets every Cholesky succeed
    whatever X's condition: any X comes out finite (an exactly zero column as 0). Its price:
    Q^T Q = I to about 11 (d k + k^2) k eps64, 1e-8 at d = 3776, k = 32 - float32's rounding."""
    Q, (d, k) = X.double(), X.shape
    eye = torch.eye(k, dtype=torch.float64, device=X.device)
    for _ in range(3):
        gram = Q.T @ Q                                                  # (k, k)
        shift = 11 * (d * k + k * (k + 1)) * EPS64 * gram.diagonal().sum() + TINY64
        # (cholesky_ex: no check, so no host sync - the shift makes every factor succeed; it
        # calls its factor L, and upper=True makes it the upper one, R)
        R = torch.linalg.cholesky_ex(gram + shift * eye, upper=True).L
        Q = torch.linalg.solve_triangular(R, Q, upper=True, left=False)  # Q R^-1
    return Q.to(X.dtype)


@functools.lru_cache(maxsize=None)
def random_start(d, k, device):
    """(d, k) fp32 random directions seeded by d, alike on every rank; made once per shape and
    device."""
    generator = torch.Generator(device="cpu").manual_seed(d)
    return torch.randn(d, k, generator=generator).to(device)


def subspace_eigenpairs(A, r, floor, warm_start=None, oversample=16):
    """top_eigenpairs(A, r, floor) by subspace iteration (float64 A (d, d); `warm_start`: (d, r)
    directions near the wanted ones, or None: a cold start, as is one of another shape). Where
    k = r + oversample is not well below d, the full eigendecomposition is as cheap: that one."""
    d, k = A.shape[0], r + oversample
    if 2 * k > d:
        return top_eigenpairs(A, r, floor)
    Q = random_start(d, k, A.device)                                    # (d, k) fp32
    warm = warm_start is not None and tuple(warm_start.shape) == (d, r)
    if warm:                        # a new tensor: random_start's is cached, for every call
        Q = torch.cat([warm_start.to(Q.dtype), Q[:, r:]], dim=1)
    A32, Q = A.float(), orthonormal(Q)
    for _ in range(4 if warm else 8):
        Q = orthonormal(A32 @ Q)
    return top_eigenpairs(A, r, floor, Q=orthonormal(Q.double()))


def eigen_directions(factor):
    """The eigen-directions a factor was built from, a warm start (None for no factor): its
    directions Z span D^-1/2 U, so D^1/2 Z spans U."""
    if factor is None or factor.directions is None:
        return None
    return orthonormal((factor.sqrt_d[:, None] * factor.directions).float())


def factor_of_parts(U, lam, rest, damping, dtype):
    """The Whitening of A^ = U diag(lam) U^T + diag(rest), by the formula above (float64 in,
    `dtype` out)."""
    D = rest + damping
    K = U * lam.sqrt() / D.sqrt()[:, None]                             # D^-1/2 U L^1/2
    Z, sigma, _ = torch.linalg.svd(K, full_matrices=False)
    return Whitening("lowrank", U.shape[0], sqrt_d=D.sqrt().to(dtype), directions=Z.to(dtype),
                     up=((1 + sigma.pow(2)).sqrt() - 1).to(dtype),
                     down=((1 + sigma.pow(2)).rsqrt() - 1).to(dtype))


@dataclass
class WhitenedLayer:
    """The whitened coordinates of one linear layer's weight: per whitened side (here "input":
    A) the EMA of its second moment and that moment's factor."""
    shape: tuple
    opts: object = field(repr=False)    # the GeoOptions (whiten_rank, moment_decay, damping)
    moments: dict = field(default_factory=dict)     # side -> EMA of its moment (A)
    factors: dict = field(default_factory=dict)     # side -> Whitening
    use_geo: bool = False
    gain: float = float("nan")          # last measured Euclidean error / whitened error
    from_moments = True     # refreshed from K-FAC moments, and re-measured between refreshes
    SIDES = ("input",)      # the coordinates the gain check compares: one

    def with_sides(self, sides):
        return self

    @classmethod
    def create(cls, name, shape, opts):
        return cls(shape, opts)

    @property
    def built(self):
        return bool(self.factors)

    def encode(self, g):
        """G~ = G F_A^-T."""
        return self.factors["input"].whiten(g)

    def decode(self, h):
        """G = G~ F_A^T."""
        return self.factors["input"].unwhiten(h)

    def refresh(self, moments):
        """New factors from this step's moments ({side: A}, alike on every rank) through
        their EMA."""
        self.smooth(moments)
        for side in moments:
            self.factors[side] = self.factor_of(side, self.moments[side])

    def smooth(self, moments):
        """The EMA of each side's moment; new dicts, so a proposal (a copy, section 6) does not
        change the layer in use."""
        self.moments, self.factors = dict(self.moments), dict(self.factors)
        for side, moment in moments.items():
            old = self.moments.get(side)
            self.moments[side] = (moment.float() if old is None else
                                  self.opts.moment_decay * old + (1 - self.opts.moment_decay) * moment)

    def factor_of(self, side, moment):
        """The factor of a smoothed moment, by eigensolver_for's choice (the subspace iteration
        starting from the factor in use)."""
        return whitening_factor(moment, self.opts.whiten_rank, self.opts.damping,
                                solver=eigensolver_for(self.opts), old=self.factors.get(side))


# ==== 4. This project's coordinates: a two-sided rotation toward the dominant subspaces ===========
#
#     encode:  H = P^T G Q        P (m x m), Q (n x n) orthogonal, the same on every rank
#     decode:  G = P H Q^T
#
# P's first r columns span the top-r left singular subspace of recent *averaged* gradients, Q's
# the right one, rotated so that H's r x r corner is nearly diagonal for the latest mean. The
# dominant energy lands on r entries, each the largest of its scale group - which the format
# encodes exactly - and the rest keeps FP8's precision of its *own* size. A rank's own gradient
# has a full r x r core, so every core entry gets a scale group of its own ("core scattering", a
# permutation). Orthogonal, so ||P E Q^T|| = ||E||: no error is amplified on the way back. P is
# never formed: r reflectors complete U to P = H_1 ... H_r = I - Y T Y^T (~4 m n r flops to
# apply), which leaves the complement near the original axes (an outlier column stays local, for
# the block scales). Every rank holds the same decoded mean, so a subspace iteration on it,
# warm-started from the current bases, gives every rank the same bases.

@dataclass
class HouseholderBasis:
    """P = I - Y T Y^T (m x m; its first r columns are +-U, the orthonormal columns it was
    completed from, up to U's own rounding): Y (m x r) the reflector vectors, T (r x r) upper
    triangular."""
    Y: torch.Tensor
    T: torch.Tensor

    @classmethod
    def complete(cls, U):
        """P for orthonormal U (m, r), from an LU instead of a QR (Ballard et al., 2015,
        "Reconstructing Householder vectors from tall-skinny QR"). Householder QR of U gives
        U = P E D (E: I's first r columns; D = diag(+-1), as U's columns are orthonormal), so

            U - E D = (P - I) E D = Y (-T Y_1^T D)          (Y_1: Y's top r x r block)

        is unit lower trapezoidal times upper triangular: the LU of U - E D, which is unique.
        lu_with_signs finds it for the top block, choosing each sign of D as QR does (which keeps
        every pivot at least 1 in size); Y's other rows follow by a triangular solve. With
        tau_i = 2 / |y_i|^2 each H_i = I - tau_i y_i y_i^T is a reflection, so P is orthogonal
        for any finite U; for orthonormal U it is geqrf's P up to rounding, except where a column
        is an axis already (geqrf skips that reflection, tau_i = 0; here it flips the axis, an
        exact sign)."""
        return cls.from_lu(U, lu_with_signs(U[:U.shape[1]]))

    @classmethod
    def from_lu(cls, U, LW):
        """complete's second half: P from U (m, r) and LW = lu_with_signs(U's top r x r block):
        L below the diagonal, the upper factor W on and above it."""
        r = U.shape[1]
        W, eye = torch.triu(LW), torch.eye(r, device=U.device, dtype=U.dtype)
        Y = torch.cat([torch.tril(LW, -1) + eye,   # U[r:] = Y[r:] W
                       torch.linalg.solve_triangular(W, U[r:], upper=True, left=False)])
        tau = 2 / (Y * Y).sum(0)
        # T by LAPACK's larft recurrence, T[:i, i] = -tau_i T[:i, :i] (Y^T Y)[:i, i], solved at
        # once: with S the strictly upper part of Y^T Y it reads T (I + S diag(tau)) = diag(tau),
        # and I + S diag(tau) is unit upper triangular: one triangular solve, not a loop
        S = torch.triu(Y.T @ Y, 1)
        T = torch.linalg.solve_triangular(eye + S * tau, torch.diag(tau), upper=True, left=False,
                                          unitriangular=True)
        return cls(Y, T.contiguous())   # row-major, as a stack of T's is (BLAS may round a
                                        # product by its operands' memory order)

    def apply_t(self, X):
        """P^T X = X - (Y T^T)(Y^T X) for X (m, n): thin products, never the m x m matrix; the
        subtraction is the last product's (addmm: X + alpha A B, one GEMM)."""
        return torch.addmm(X, self.Y @ self.T.T, self.Y.T @ X, alpha=-1)

    def apply(self, X):
        """P X = X - (Y T)(Y^T X), likewise."""
        return torch.addmm(X, self.Y @ self.T, self.Y.T @ X, alpha=-1)

    def columns(self):
        """The r vectors the basis was completed from (up to sign): P's first r columns,
        P E = E - (Y T)(Y^T E), where Y^T E needs no product: it is Y's top r x r block,
        transposed."""
        m, r = self.Y.shape
        E = torch.eye(m, r, device=self.Y.device, dtype=self.Y.dtype)
        return E - (self.Y @ self.T) @ self.Y[:r].T


def lu_with_signs(B):
    """The LU without pivoting of B - D (B: r x r, U's top block; L unit lower and W upper,
    packed in one matrix), each sign d_i chosen when its pivot is reached: the opposite of the
    pivot's, as Householder QR chooses, so that the pivot b_i - d_i = b_i + sign(b_i) is at
    least 1 in size and no row needs to move (b_i: the diagonal entry once i steps are done; a
    zero counts by its sign bit)."""
    B = B.clone()
    for i in range(B.shape[0]):
        B[i, i] = torch.copysign(B[i, i].abs() + 1, B[i, i])           # the pivot, b_i - d_i
        B[i + 1:, i].div_(B[i, i])                                      # L's column i
        B[i + 1:, i + 1:].sub_(torch.outer(B[i + 1:, i], B[i, i + 1:]))    # what is left
    return B


def encode_geo(G, left, right):
    """H = P^T G Q; `left` / `right` a basis (apply_t, apply), or None: that side stays."""
    H = left.apply_t(G) if left is not None else G
    return right.apply_t(H.T).T if right is not None else H        # G Q = (Q^T G^T)^T


def decode_geo(H, left, right):
    """G = P H Q^T, the inverse of encode_geo."""
    G = right.apply(H.T).T if right is not None else H              # H Q^T = (Q H^T)^T
    return left.apply(G) if left is not None else G


def core_swaps(shape, r, block):
    """Flat index pairs (a, b) whose exchange gives every entry of H's r x r core its own scale
    group (its amax, encoded exactly). A core row's diagonal entry keeps its place; the others
    trade places with the first element of groups, from the end of H, that hold no core entry.
    A permutation is orthogonal and its own inverse. None with tensor scaling."""
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
    a, b = swaps
    out = H.clone(memory_format=torch.contiguous_format).view(-1)
    out[a], out[b] = out[b], out[a]          # (both sides read before either is written)
    return out.view(H.shape)


def update_subspaces(G, U, V, iters=1):
    """One refresh of G's (m x n) dominant subspaces U (m x r), V (n x r): subspace iteration
    on G G^T and G^T G, then a Rayleigh-Ritz rotation making U^T G V diagonal, largest first."""
    for _ in range(iters):
        U, V = orthonormal(G @ (G.T @ U)), orthonormal(G.T @ (G @ V))  # G G^T U, G^T G V
    a, _, bh = torch.linalg.svd(U.T @ G @ V)                            # r x r: negligible
    return U @ a, V @ bh.T


def initial_subspaces(G, r, seed, iters=4):
    """Cold start: a randomized range finder (seeded alike on every rank), refined by a few
    subspace iterations."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    omega = torch.randn(G.shape[1], r, generator=generator).to(G.device, G.dtype)
    U = orthonormal(G @ omega)
    return update_subspaces(G, U, orthonormal(G.T @ U), iters)


@dataclass
class SubspaceLayer:
    """The rotation's coordinates of one matrix: r (m + n) + 2 r^2 numbers."""
    shape: tuple
    r: int                              # dominant directions per side
    seed: int
    opts: object = field(repr=False)    # the GeoOptions (iters, scatter_core)
    left_basis: HouseholderBasis = None     # P
    right_basis: HouseholderBasis = None    # Q
    use_geo: bool = False
    gain: float = float("nan")          # last measured Euclidean error / rotated error
    swaps: tuple = field(default=None, repr=False)              # core_swaps, fixed by shape
    sides: str = "both"                 # the rotation in use: both sides, or "right" (Q alone)
    from_moments = False                # refreshed from the decoded mean
    # The gain check measures both rotations and keeps the better: both sides (the dominant
    # energy on a few exact core entries), or the column side alone, which mixes along each row
    # only and so keeps every row's scale (an error spread over rows lands on rows AdamW may
    # divide by a tiny root). On equal errors, both.
    SIDES = ("both", "right")

    def with_sides(self, sides):
        """This geometry rotating `sides` (a copy sharing the bases)."""
        return replace(self, sides=sides)

    @classmethod
    def create(cls, name, shape, opts):
        """r = geo_rank, at most half the smaller side; the seed from the name, alike on
        every rank; the core's swaps for the scale groups."""
        r = min(opts.geo_rank, min(shape) // 2)
        return cls(shape, r, seed=zlib.crc32(name.encode()), opts=opts,
                   swaps=core_swaps(shape, r, opts.scale_block) if opts.scatter_core else None)

    @property
    def built(self):
        return self.left_basis is not None

    def encode(self, g):
        """H = P^T G Q, core scattered (the column side alone: H = G Q)."""
        if self.sides == "right":
            return encode_geo(g, None, self.right_basis)
        return swap_entries(encode_geo(g, self.left_basis, self.right_basis), self.swaps)

    def decode(self, h):
        """G = P H Q^T (or H Q^T)."""
        if self.sides == "right":
            return decode_geo(h, None, self.right_basis)
        return decode_geo(swap_entries(h, self.swaps), self.left_basis, self.right_basis)

    def dominant_subspaces(self, mean):
        """(U, V), the top-r singular subspaces of the decoded mean, warm-started from
        the bases in use."""
        if self.left_basis is None:
            return initial_subspaces(mean, self.r, self.seed)
        return update_subspaces(mean, self.left_basis.columns(), self.right_basis.columns(),
                                self.opts.iters)

    def refresh(self, mean):
        """New bases from the decoded mean (alike on every rank)."""
        U, V = self.dominant_subspaces(mean)
        self.left_basis, self.right_basis = HouseholderBasis.complete(U), HouseholderBasis.complete(V)


# ==== 5. The error the optimizer sees =============================================================
#
# Relative L2 error is not what training feels. AdamW divides each element by the root of its
# running mean of squares (v), so an error on a quiet element is magnified (and a rotation spreads
# the error of a few large coordinates over every element); Muon orthogonalises, so what matters
# is how an error moves the orthogonalised matrix. Each layer is judged by how much a codec error
# changes its optimizer's next update, from the optimizer's own state. AdamW's, exactly, is below
# (an error as large as a quiet element flips its sign: no derivative sees that); so is Muon's
# first update (no momentum yet), which the demo judges by; training's Muon error, from the
# momentum buffer and to first order, is nanogeo/geometry/update_error.py's.

def adamw_direction(g, state, betas, eps):
    """AdamW's next update from the gradient g, in float64, without learning rate and weight
    decay: m^ = (b1 m + (1 - b1) g) / c1, v^ = (b2 v + (1 - b2) g^2) / c2, u = m^ / (sqrt(v^) +
    eps); `state`: the optimizer's state of the parameter (empty before its first step)."""
    beta1, beta2 = betas
    c1, c2 = bias_corrections(state.get("step", 0), betas, g.device)
    m, v = (state[k].double() if k in state else torch.zeros_like(g, dtype=torch.float64)
            for k in ("exp_avg", "exp_avg_sq"))
    g = g.double()
    m_hat = (beta1 * m + (1 - beta1) * g) / c1
    v_hat = (beta2 * v + (1 - beta2) * g * g) / c2
    return m_hat / (v_hat.sqrt() + eps)


def bias_corrections(step, betas, device):
    """1 - beta^t at t = step + 1 for both betas, as 0-dim float64 tensors on `device`,
    computed where `step` lives (a fused AdamW keeps it on the device, a non-fused one on the
    host), so reading it never waits. Tensors, not Python numbers, as in count_divisor."""
    on_host = not isinstance(step, torch.Tensor) or step.device.type == "cpu"
    t = torch.as_tensor(step, dtype=torch.float64, device="cpu" if on_host else device) + 1
    corrections = [1 - beta ** t for beta in betas]
    if on_host and torch.device(device).type != "cpu":     # fill values: a copy from pageable
        corrections = [torch.full((), c, dtype=torch.float64, device=device)   # memory would
                       for c in corrections]                                     # stop the host
    return corrections


def adamw_error(state, betas, eps, mean, workers=1):
    """delta -> ||u(mean + s delta) - u(mean)||^2 / s^2, the squared change a gradient error makes
    to AdamW's next update (u: adamw_direction). The gain check measures each worker's own error,
    but the mean carries W of them averaged, s = 1 / sqrt(W) as large: AdamW is not linear, so
    the error goes through at that size (and is scaled back, comparable to L2)."""
    mean, spread = mean.double(), workers ** -0.5
    base = adamw_direction(mean, state, betas, eps)
    return lambda delta: ((adamw_direction(mean + spread * delta.double(), state, betas, eps)
                           - base) / spread).pow(2).sum().float()


MUON_NS = (3.4445, -4.7750, 2.0315)     # torch.optim.Muon's quintic Newton-Schulz coefficients


def newton_schulz(X, steps=5):
    """Muon's orthogonalisation of X (m, n): about U V^T of its SVD, by torch.optim.Muon's
    quintic iteration, on the wide orientation."""
    a, b, c = MUON_NS
    wide = X.T if X.shape[0] > X.shape[1] else X
    Y = wide / wide.norm().clamp(min=1e-7)
    for _ in range(steps):
        A = Y @ Y.T                                                     # (short, short)
        Y = a * Y + (b * A + c * A @ A) @ Y
    return Y.T if X.shape[0] > X.shape[1] else Y


class MuonFirstStep:
    """An optimizer view (section 6's watch()) of Muon's first update, NS(mean): an error's size
    is how far it moves that update, the error at the mean's size (s = 1 / sqrt(W)) and scaled
    back, as adamw_error does. Small singular directions of the mean weigh as much as large ones
    after orthogonalisation, so an error there costs more than its L2 size says."""

    def error(self, mean, workers=1):
        spread, base = workers ** -0.5, newton_schulz(mean)
        return lambda delta: ((newton_schulz(mean + spread * delta) - base) / spread).pow(2).sum()


# ==== 6. The communicator: which matrices go geometry-aware, one call per step ====================
#
# A matrix that may use a geometry has a layer (sections 3, 4) with encode, decode, refresh and
# the decision's state: built (its geometry made), use_geo (decided to send in it), gain; any other
# tensor travels as it is. A step: every worker's gradients into coordinates, through the
# collective, the mean back; then, where due, the geometry: proposals measured and decided, new
# ones made.


GEOMETRIES = ("geofp8", "subspace", "euclidean")
SELECTIONS = ("gain", "all", "list")
JUDGES = ("optimizer", "l2")
FEEDBACK_STAGES = ("1", "2", "both")
COLLECTIVES = ("two-stage", "fp8-sum")


@dataclass
class GeoOptions:
    """The method's settings (nanogeo's Options adds production's)."""
    geometry: str = "subspace"      # subspace (section 4) | geofp8 (section 3, the published
                                    # method: ask for it by name) | euclidean
    fmt: str = "e4m3"
    block: object = 128             # values per scale group, "row" or "tensor" (see groups_of)
    geo_refresh: int = 0            # new geometry every N steps (0: 50 for geofp8, else 4)
    geo_warmup: int = 0             # steps sent in Euclidean coordinates first
    select: str = "gain"            # which matrices use it: gain (measured) | all | list
    geo_layers: tuple = ()          # select="list": the names that may
    geo_judge: str = "optimizer"    # the error as the optimizer sees it (section 5) | plain l2
    judge_every: int = 4            # geofp8: re-measure the factors in use every N steps
    geo_enter_gain: float = 1.10    # go geometry-aware when Euclidean error / its error >= this
    geo_exit_gain: float = 1.00     # ... and back below this (both 0 with a list: fixed choice)
    min_numel: int = 4096           # smaller matrices stay Euclidean
    vocabulary: tuple = ()          # so do these weights: the embedding, an untied output head
                                    # (found by module: nanogeo.parallel.hooks.vocabulary_layers)
    vocab_size: int = 0             # ... or, knowing shapes only, a dimension of this size
    whiten_rank: int = 32           # geofp8: r of A's low-rank part
    damping: float = 1e-3           # geofp8
    moment_decay: float = 0.95      # geofp8: EMA of the moments across refreshes
    geo_rank: int = 16              # subspace: r per side, at most min(m, n) // 2
    iters: int = 1                  # subspace: iterations per refresh
    scatter_core: bool = True       # subspace: each core entry in a scale group of its own
    collective: str = "two-stage"   # or "fp8-sum": the paper's (one scale a tensor, codes summed)
    stage2_fmt: str = ""            # stage 2's format ("": fmt's), e.g. e4m3 after an NVFP4 stage 1
    error_feedback: bool = False    # add what the codec lost to the next step's send, of ...
    feedback_stages: str = "1"      # ... stage 1 (each rank's send), "2" (each owner's mean), "both"

    def choices(self):
        """{field: allowed values} of the string fields."""
        return {"geometry": GEOMETRIES, "fmt": FORMATS, "select": SELECTIONS, "geo_judge": JUDGES,
                "stage2_fmt": ("", *FORMATS), "feedback_stages": FEEDBACK_STAGES,
                "collective": COLLECTIVES}

    def __post_init__(self):
        for key, allowed in self.choices().items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {', '.join(allowed)}, got "
                                 f"{getattr(self, key)!r}")
        if self.geo_refresh == 0:
            self.geo_refresh = 50 if self.geometry == "geofp8" else 4
        if min(self.geo_rank, self.geo_refresh, self.whiten_rank, self.judge_every) < 1:
            raise ValueError("geo_rank, whiten_rank, geo_refresh and judge_every must be >= 1")
        if isinstance(self.vocabulary, str):
            raise ValueError("vocabulary is a list of weight names, e.g. ('lm_head.weight',)")
        self.geo_layers, self.vocabulary = tuple(self.geo_layers), tuple(self.vocabulary)
        self.stage2_fmt = "" if self.stage2_fmt == self.fmt else self.stage2_fmt

    @property
    def scale_block(self):
        """The scale groups core scattering plans for (NVFP4: always 16)."""
        return NVFP4_BLOCK if self.fmt == "nvfp4" else self.block


def why_euclidean(name, shape, opts, linear=None):
    """Why a tensor stays Euclidean (a short reason), or None if it may use the geometry.
    `linear`: the names of the model's nn.Linear weights, found by module type, never by name or
    shape (nanogeo.parallel.hooks.linear_layers); None: every matrix may."""
    if opts.geometry == "euclidean":
        return "euclidean mode"
    if len(shape) != 2:
        return "not 2-D"
    if opts.select == "list":       # an explicit list (it still passes the gain check)
        return None if name in opts.geo_layers else "not selected"
    if linear is not None and name not in linear:
        return "not a linear layer"
    if name in opts.vocabulary or (opts.vocab_size and opts.vocab_size in shape):
        return "vocabulary"         # the embedding or an untied output head
    if math.prod(shape) < opts.min_numel:
        return "small"
    return None


class Communicator:
    """Averages a fixed list of named tensors through the two-stage collective, each matrix in
    Euclidean or geometry-aware coordinates, one step() a training step: reduce() over the
    process group, reduce_workers() for W simulated workers (K-FAC `moments` when moments_due():
    {"input": {name: A}} and the tokens each A averaged, {"tokens": {"input": {name: t}}})."""
    LAYERS = {"geofp8": WhitenedLayer, "subspace": SubspaceLayer}

    def __init__(self, named_shapes, options=None, group=None, linear=None):
        self.opts, self.group = options or GeoOptions(), group
        self.names = [n for n, _ in named_shapes]
        self.shapes = {n: tuple(s) for n, s in named_shapes}
        self.layer_class = self.LAYERS.get(self.opts.geometry)     # None: Euclidean
        may = [n for n in self.names if why_euclidean(n, self.shapes[n], self.opts, linear) is None]
        self.layers = {n: self.layer_class.create(n, self.shapes[n], self.opts)
                       for n in may}    # name -> the geometry in use (or being built)
        self.proposals = {}     # name -> new geometry, not yet measured, not yet used
        # select="list": the names listed (production's "fragile": the profile's top_k)
        self.listed = set(self.opts.geo_layers) if self.opts.select == "list" else set()
        if self.listed - set(self.names):
            raise ValueError(f"geo_layers names tensors this model does not have, e.g. "
                             f"{sorted(self.listed - set(self.names))[0]!r}: list this model's")
        # its geometry is built from K-FAC moments (the whitening), as its layer class's is
        self.from_moments = bool(self.layers) and self.layer_class.from_moments
        self.views = {}         # name -> its optimizer's view (watch()); none: plain L2
        self.residuals = {}     # error feedback, stage 1: worker -> [what its last send lost]
        self.stage2_residuals = {}  # ... stage 2: shard -> [what its owner's mean lost, a piece each]
        self.warned = False
        self.steps_taken = 0    # steps taken: counted at the end of each (step)
        o = self.opts
        if o.collective == "fp8-sum" and (o.fmt not in FP8_FORMATS or o.stage2_fmt
                                          or o.error_feedback):
            raise ValueError("the FP8-sum collective sends one FP8 format, without error "
                             "feedback here: drop stage2_fmt and error_feedback")

    def watch(self, views):
        """Judge each layer by the error its optimizer sees (section 5): {name: a view with
        .error(mean, workers) -> (delta -> squared size)}, e.g. nanogeo.parallel.hooks'."""
        self.views = dict(views)
        return self

    # -- coordinates -----------------------------------------------------------------------

    def sent_in_geometry(self, name):
        """Is `name` sent in its geometry-aware coordinates now?"""
        layer = self.layers.get(name)
        return (layer is not None and layer.use_geo and layer.built
                and self.steps_taken > self.opts.geo_warmup)

    def to_coords(self, name, g):
        """g in the coordinates `name` is sent in."""
        return self.layers[name].encode(g) if self.sent_in_geometry(name) else g

    def from_coords(self, name, c):
        """Back to the original coordinates."""
        return self.layers[name].decode(c) if self.sent_in_geometry(name) else c

    def moments_due(self):
        """Does the next step() need K-FAC moments (the whitening refreshes after it:
        a multiple of geo_refresh steps taken before it)?"""
        return self.from_moments and self.steps_taken % self.opts.geo_refresh == 0

    # -- one step ----------------------------------------------------------------------------

    def reduce(self, grads, moments=None):
        """Average grads (matching self.names) over the process group, in place (one step);
        `moments`: this rank's K-FAC moments. Returns the bytes this rank sent."""
        across = dist.is_initialized()
        rank = dist.get_rank(self.group) if across else 0
        means, nbytes = self.step({rank: grads}, moments, across_ranks=across)
        for g, m in zip(grads, means):
            g.copy_(m)
        return nbytes

    def reduce_workers(self, worker_grads, moments=None):
        """reduce()'s numerics for W simulated workers (`moments`: already averaged over all
        of them): (means, bytes a rank sends)."""
        return self.step(dict(enumerate(worker_grads)), moments, across_ranks=False)

    def step(self, worker_grads, moments=None, *, across_ranks):
        """One whole step for the workers this process holds ({index: their gradients}): W
        simulated ones, or this rank's over the process group (across_ranks). `moments`: K-FAC
        moments on a step moments_due() announced. Returns (the means, bytes a rank sends)."""
        # 1. what each worker sends: its gradients in fp32, plus what its last send lost
        as_sent = {w: self.outgoing(w, grads) for w, grads in worker_grads.items()}
        if moments is not None and across_ranks:    # this rank's moments, all ranks' averaged:
            (mine,) = as_sent.values()               # every rank builds the same geometry
            moments = self.average_moments(moments, mine[0].device)
        # 2. each tensor in the coordinates it is sent in (sent_in_geometry: the decision's)
        coords = {w: [self.to_coords(n, g) for n, g in zip(self.names, gs)]
                  for w, gs in as_sent.items()}
        # 3. the collective (section 2): every worker ends with the same mean, in coordinates
        sent, o = list(coords.values()), self.opts      # over the process group: [this rank's]
        if o.collective == "fp8-sum":
            mean_coords, nbytes = fp8_sum_mean(sent, o.fmt, across_ranks, self.group)
        else:
            layout, feedback = self.layout(coords, across_ranks), self.stage2_feedback()
            if across_ranks:
                mean_coords, nbytes = all_reduce_mean(sent[0], layout, group=self.group,
                                                      feedback=feedback)
            else:
                mean_coords, nbytes = simulate_mean(sent, layout, feedback=feedback)
            if self.feeds_back(1):
                self.keep_send_losses(coords, layout)
        # 4. the means in original coordinates, for the optimizer: each a tensor of its own, as
        #    a gradient is (BLAS may round a product by where its matrix starts in memory)
        means = {n: self.from_coords(n, c.clone()) for n, c in zip(self.names, mean_coords)}
        # 5. the step is taken; where the geometry is due, what waits is measured on this step's
        #    gradients and decided (judge), and new geometry proposed (measured on a later step)
        if self.steps_taken % o.geo_refresh:    # not a step moments_due() announced:
            moments = None                      # the whitening refreshes on its own
        self.steps_taken += 1
        if self.layers and self.geometry_due(moments is not None, self.steps_taken):
            judged = self.to_judge()
            if judged:
                self.judge(judged, means, list(as_sent.values()), across_ranks)
            for name, found in self.refresh_inputs(means, moments).items():
                self.propose(name, found)
        return list(means.values()), nbytes

    def average_moments(self, moments, device):
        """Every rank's K-FAC input moments averaged, each weighted by the tokens it averaged
        (moments["tokens"]["input"][name]) - E[a a^T] over every rank's tokens - so that every
        rank builds the same factors. One all-reduce of a slot per layer, alike on every rank:
        a layer a rank did not run adds zeros and 0 tokens (a moment given without its tokens
        weighs 0); one no rank ran stays out."""
        given, counted = moments.get("input", {}), moments.get("tokens", {}).get("input", {})
        widths = [self.shapes[n][1] for n in self.layers]                  # A is d_in x d_in
        tokens = [counted.get(n, 0) for n in self.layers]
        parts = [given[n].reshape(-1) * t if n in given else torch.zeros(d * d, device=device)
                 for n, d, t in zip(self.layers, widths, tokens)]
        flat = torch.cat(parts + [torch.tensor(tokens, dtype=torch.float32, device=device)])
        dist.all_reduce(flat, group=self.group)
        totals, counts = flat[:-len(widths)].split([d * d for d in widths]), flat[-len(widths):]
        return {"input": {n: total.view(d, d) / count_divisor(count, total) for n, d, total, count
                          in zip(self.layers, widths, totals, counts.tolist()) if count > 0}}

    def outgoing(self, worker, grads):
        """A worker's gradients as sent: fp32, in original coordinates, plus what its last
        send lost (error feedback, stage 1)."""
        fp32 = [g.float() for g in grads]
        lost = self.residuals.get(worker)
        return fp32 if lost is None else [g + r for g, r in zip(fp32, lost)]

    def layout(self, coords, across_ranks):
        """The ShardLayout of the tensors in coordinates ({worker: [tensors]}), cut for the
        process group or for the simulated workers."""
        world = dist.get_world_size(self.group) if across_ranks else len(coords)
        shapes = [t.shape for t in next(iter(coords.values()))]
        return ShardLayout(shapes, self.opts.fmt, self.opts.block, world, self.opts.stage2_fmt)

    def stage2_feedback(self):
        """Stage 2's residuals (every shard's this process owns), when error feedback keeps them."""
        return self.stage2_residuals if self.feeds_back(2) else None

    def feeds_back(self, stage):
        """Does error feedback keep residuals of stage 1 or 2?"""
        o = self.opts
        return o.error_feedback and o.feedback_stages in (str(stage), "both")

    def keep_send_losses(self, coords, layout):
        """Error feedback, stage 1: what each worker's own send lost - its tensors in
        coordinates minus their round trip through stage 1's codec - back in original
        coordinates, to be added to its next send (outgoing). (Quantizing again gives the bytes
        that were sent: rounding to nearest is a function of the values.)"""
        for w, tensors in coords.items():
            back = dequantize_bucket(quantize_bucket(tensors, layout), layout, stage=1)
            lost = [c - b for c, b in zip(tensors, back)]
            self.residuals[w] = [self.from_coords(n, c) for n, c in zip(self.names, lost)]

    # -- the geometry --------------------------------------------------------------------------

    def geometry_due(self, fresh_moments, steps_taken):
        """Does the geometry move once `steps_taken` steps are taken: proposals to measure, a
        geometry in use but unmeasured, a refresh, or (the whitening) a re-measurement?"""
        if self.proposals or any(l.built and math.isnan(l.gain) for l in self.layers.values()):
            return True
        if self.from_moments:
            return fresh_moments or steps_taken % self.opts.judge_every == 0
        return (steps_taken % self.opts.geo_refresh == 0
                or not all(layer.built for layer in self.layers.values()))

    def to_judge(self):
        """The layers a geometry step measures: every proposal; the geometry in use where
        unmeasured, and for the whitening at every check."""
        return [n for n, layer in self.layers.items() if n in self.proposals
                or (layer.built and (self.from_moments or math.isnan(layer.gain)))]

    def refresh_inputs(self, means, moments):
        """{name: what its new geometry is built from}: the whitening's averaged K-FAC
        input moment ({"input": A}), when given; the others' decoded mean every geo_refresh steps,
        or until built."""
        if self.from_moments:
            given = (moments or {}).get("input", {})
            return {n: {"input": given[n]} for n in self.layers if n in given}
        return {n: means[n] for n, layer in self.layers.items()
                if self.steps_taken % self.opts.geo_refresh == 0 or not layer.built}

    def propose(self, name, found):
        """New geometry for `name` from its refresh input - a copy: refresh() assigns new
        tensors, the layer in use stays - and a proposal until later gradients measure it
        (measured on the gradients it was built from, it would look better than it is), unless
        decide() takes it unmeasured."""
        proposal = copy.copy(self.layers[name])
        proposal.gain = float("nan")                    # not measured yet
        proposal.refresh(found)
        if self.decide(name, proposal):
            proposal.use_geo = True
            self.layers[name] = proposal
        else:
            self.proposals[name] = proposal

    def decide(self, name, layer):
        """THE decision: does `name` send in `layer`'s coordinates from now on?
          select="all": always - forced, unmeasured (a control that must act);
          select="list" (production: "fragile", whose profile makes the list): only the names
            in `listed`, and with both gains 0 always (the paper's fixed choice, unmeasured);
          otherwise by the measured gain (Euclidean error / geometry-aware error, as the layer's
            optimizer sees them) with hysteresis: enter at geo_enter_gain, stay while >=
            geo_exit_gain; unmeasured (nan): not yet.
        Outside stay two gates that are not per-layer choices: why_euclidean() (which tensors
        have coordinates at all; no unlisted matrix computes geometry) and sent_in_geometry()'s
        warm-up (a step count: decided here, forced layers would wait as proposals and be
        measured)."""
        opts = self.opts
        if opts.select == "all":
            return True
        listed = name in self.listed
        if opts.select != "gain" and (not listed or max(opts.geo_enter_gain, opts.geo_exit_gain) <= 0):
            return listed
        return layer.gain >= (opts.geo_exit_gain if layer.use_geo else opts.geo_enter_gain)

    def judge(self, names, means, as_sent, across_ranks):
        """Measure each layer's proposal (or, without one, its geometry in use) against
        Euclidean on this step's gradients, decide, and put what was measured in use."""
        layers = {n: self.proposals.pop(n, self.layers[n]) for n in names}
        errors = self.measure(layers, means, as_sent, across_ranks)
        for (name, layer), (euclid, *rotated) in zip(layers.items(), errors.tolist()):
            best = min(range(len(rotated)), key=rotated.__getitem__)    # the first of equals
            if len(rotated) > 1:
                layer.sides = layer.SIDES[best]
            geo = rotated[best]
            layer.gain = math.sqrt(euclid / geo) if geo > 0 else (math.inf if euclid > 0 else 1.0)
            layer.use_geo = self.decide(name, layer)
            self.layers[name] = layer

    def measure(self, layers, means, as_sent, across_ranks):
        """(layers, 1 + rotations) float64 on the device: for each worker's gradient as sent,
        the squared codec error of Euclidean FP8 and of the geometry-aware codec in each of the
        layer's rotations (SIDES), as its optimizer sees it around the mean, summed over the
        workers - and over the ranks, so every rank decides alike."""
        world = dist.get_world_size(self.group) if across_ranks else 1
        errors = []
        for name, layer in layers.items():
            seen = self.error_seen(name, means[name], world * len(as_sent))
            rotations = [layer.with_sides(sides) for sides in layer.SIDES]
            for worker in as_sent:
                g = worker[self.names.index(name)].float()
                errors.append(seen(self.round_trip(g) - g))
                errors += [seen(r.decode(self.round_trip(r.encode(g))) - g) for r in rotations]
        errors = torch.stack(errors).double().view(len(layers), len(as_sent), -1).sum(1)
        if across_ranks:
            dist.all_reduce(errors, group=self.group)
        return errors                           # on the device: judge's .tolist() reads it

    def error_seen(self, name, mean, workers):
        """delta -> a gradient error's squared size as the layer's optimizer sees it (its
        view, section 5), or in plain L2 - warning once if asked for but no optimizer is watched."""
        view = self.views.get(name) if self.opts.geo_judge == "optimizer" else None
        if view is not None:
            return view.error(mean, workers)
        if self.opts.geo_judge == "optimizer" and not self.views and not self.warned:
            self.warned = True
            warnings.warn("compress.Communicator: geo_judge='optimizer' but no optimizer is watched, so the "
                          "layers are judged in plain L2: call watch() (the DDP hook: "
                          "state.watch(optimizers)) or pass geo_judge='l2'", stacklevel=2)
        return lambda delta: delta.pow(2).sum()

    def round_trip(self, x):
        """x through the codec and back."""
        return dequantize(quantize(x, self.opts.fmt, self.opts.block))


# ==== 7. See it work: python compress.py ==========================================================

def planted_gradients(ranks, steps, d_out=96, d_in=128, tokens=64, seed=0):
    """[(each rank's gradient, A)] per step of one linear layer, anisotropic as LLM layers are:
    input variances falling over three decades along random directions (A far from round),
    output errors along four directions every rank shares (a dominant subspace)."""
    g = torch.Generator().manual_seed(seed)
    mixing = orthonormal(torch.randn(d_in, d_in, generator=g)) * torch.logspace(0, -3, d_in).sqrt()
    shared = 3 * orthonormal(torch.randn(d_out, 4, generator=g)).T                    # (4, d_out)
    out = []
    for _ in range(steps):
        a = [torch.randn(tokens, d_in, generator=g) @ mixing.T for _ in range(ranks)]
        delta = [torch.randn(tokens, 4, generator=g) @ shared
                 + 0.3 * torch.randn(tokens, d_out, generator=g) for _ in range(ranks)]
        out.append(([[d.T @ x / tokens] for d, x in zip(delta, a)],      # G = sum delta a^T
                    sum(x.T @ x for x in a) / (tokens * ranks)))         # A = E[a a^T]
    return out


DEMO_ROWS = (  # geometry, codec, select, and a line that reads the row
    ("euclidean", "e4m3", "gain", "FP8, the two-stage collective (section 2): half of bf16's bytes"),
    ("geofp8", "e4m3", "gain", "the whitening (section 3), used only where it measures better"),
    ("geofp8", "e4m3", "all", "forced: not orthogonal, its error comes back times F^T, along A's "
     "large directions (worse\n    in L2); it spends precision on A's small ones, where a "
     "preconditioned optimizer divides"),
    ("subspace", "e4m3", "gain", "the rotation (section 4): orthogonal, the dominant energy on "
     "a few exact entries"),
    ("subspace", "e4m3", "all", "the rotation forced from its first proposal on"),
    ("euclidean", "nvfp4", "gain", "4 bits, a quarter of bf16's bytes: several times FP8's error"),
    ("subspace", "nvfp4", "all", "the rotation forced at 4 bits, where the studies found room"))


def demo(ranks=8, steps=12):
    """Planted gradients through the two-stage collective in each coordinate system and codec,
    each matrix judged as training judges it - by the error Muon's update sees (MuonFirstStep):
    per row the decision and its last measured gain, then the error of the averaged gradient in
    L2 and in Muon's update, and the bytes a rank sends."""
    data, late = planted_gradients(ranks, steps), slice(steps - 6, steps)
    exact = [(m, newton_schulz(m)) for m in [sum(w[0] for w in grads) / ranks
                                              for grads, _ in data][late]]
    bf16_bytes = 2 * (ranks - 1) / ranks * 96 * 128 * 2     # a bf16 ring all-reduce, per rank
    bf16 = [(sum(w[0].bfloat16().float() for w in grads) / ranks).bfloat16().float()
            for grads, _ in data]
    rows = [("bf16", "", "-", *mean_errors(bf16[late], exact), bf16_bytes,
             "each rank's gradient and the mean rounded to bf16: the wire most clusters send")]
    for geometry, fmt, select, reading in DEMO_ROWS:
        comm = Communicator([("w", (96, 128))], GeoOptions(geometry=geometry, fmt=fmt,
                                                           select=select, min_numel=0))
        comm.watch({"w": MuonFirstStep()})
        done = [comm.reduce_workers(grads, {"input": {"w": A}} if comm.moments_due() else None)
                for grads, A in data]                                   # [(means, bytes)]
        rows.append((geometry, fmt, decision(comm, "w", select),
                     *mean_errors([m[0] for m, _ in done][late], exact), done[-1][1], reading))
    print(f"{ranks} simulated ranks, a 96 x 128 linear layer, groups of 128 values, each judged by "
          f"the error\nMuon's update sees. Steps {steps - 5}-{steps}: the averaged gradient's "
          "error in L2 and in Muon's update\n(both against Euclidean e4m3's), and the bytes a "
          "rank sends per step against bf16's:")
    for geometry, fmt, how, l2, muon, nbytes, reading in rows:
        print(f"  {geometry:9s} {fmt:5s} {how:18s} L2 {l2 / rows[1][3]:4.2f}x  Muon "
              f"{muon / rows[1][4]:4.2f}x  {nbytes / bf16_bytes:.2f}x bytes\n    {reading}")


def mean_errors(means, exact):
    """The mean over steps of the averaged gradient's relative error, in L2 and in Muon's first
    update (NS(decoded) against NS(exact)); exact: [(mean, its NS)] per step."""
    relative = lambda a, b: float((a - b).norm() / b.norm())
    return (sum(relative(m, e) for m, (e, _) in zip(means, exact)) / len(exact),
            sum(relative(newton_schulz(m), u) for m, (_, u) in zip(means, exact)) / len(exact))


def decision(comm, name, select):
    """What the gain check decided for `name`, and the gain it measured last."""
    layer = comm.layers.get(name)
    if layer is None:
        return "-"
    gain = "unmeasured" if math.isnan(layer.gain) else f"gain {layer.gain:.2f}"
    used = "forced" if select == "all" else "used" if comm.sent_in_geometry(name) else "not used"
    return f"{used}, {gain}"


if __name__ == "__main__":
    demo()
