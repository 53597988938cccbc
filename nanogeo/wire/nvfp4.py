"""
NVFP4, the 4-bit format of NVIDIA's Blackwell GPUs, as a codec of the two-stage collective:
blocks of 16 values, each value an e2m1 number (sign, 2 exponent bits, 1 mantissa bit: the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), each block scaled by an e4m3 number, and one fp32 scale
per tensor that brings the largest block scale to the top of e4m3's range.

    wire: [tensor scale, fp32][block scale per 16 values, e4m3][two e2m1 values per byte]

About 0.56 bytes a value (against 1.03 for e4m3 with block 128): a quarter of bf16's bytes.

The codec works on blocks: encode_blocks / decode_blocks turn a (blocks, 16) fp32 matrix into
block scales and codes and back, given each block's tensor scale. quantize / dequantize run them
on one tensor; Nvfp4PackedLayout runs them on a whole bucket of compress.py's two-stage
collective, one call per stage (the pieces' tensor scales from one segmented max), and writes
the same bytes, bit for bit, as quantizing piece by piece (tests/test_compress.py,
test_packed_nvfp4_equals_one_call_per_piece).
"""
import itertools
import math

import torch

import compress
from compress import Quantized, as_float32, num_groups, scale_groups
from nanogeo.wire import packing
from nanogeo.wire.packing import on_device

NVFP4_BLOCK = 16        # NVFP4 always scales blocks of 16 values

E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the 8 magnitudes of a 4-bit e2m1 value
SIGNED_E2M1 = E2M1_GRID + tuple(-v for v in E2M1_GRID)  # the value of each 4-bit code (8: -0.0)
E4M3_MAX = 448.0
CODE_BYTES = NVFP4_BLOCK // 2           # a block's 16 codes, two a byte


def wire_nbytes(shape):
    """fp32 tensor scale + one e4m3 scale per 16 values + two values per byte; 0 if empty."""
    numel = math.prod(shape)
    return 4 + num_groups(shape, NVFP4_BLOCK) + (numel + 1) // 2 if numel else 0


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
        # nearest: the index is the number of midpoints between grid values that a has passed;
        # ties to the even code, so a tie at 0.25, 1.25, 2.5 or 5 rounds down, one at 0.75,
        # 1.75 or 3.5 up (the even codes' values are 0, 1, 2, 4). Seven compares of a, each
        # added in place (a (.., 7) compare summed over its last dimension is ~3x slower)
        idx = torch.zeros_like(a, dtype=torch.uint8)
        for tie in (0.25, 1.25, 2.5, 5.0):
            idx += a > tie
        for tie in (0.75, 1.75, 3.5):
            idx += a >= tie
    return idx.to(torch.uint8) | (y < 0).to(torch.uint8) << 3


def tensor_scale(tensor_amax):
    """The fp32 scale that brings the largest block scale to e4m3's max (1 where amax is 0);
    elementwise, so one call serves every piece of a bucket. At least fp32's smallest normal
    number: for a piece of subnormal values (amax < 3.2e-35; the embedding rows of unseen tokens
    under error feedback) the quotient would round to 0, and a zero block's scale would be
    0 / 0 = NaN - the whole mean NaN. With the floor they decode to 0 or close to it."""
    scale = (tensor_amax / (E2M1_MAX * E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(tensor_amax > 0, scale, torch.ones_like(tensor_amax))


def encode_blocks(blocks, amax, scale, stochastic=False, generator=None):
    """blocks (G, 16) fp32, their amax (G,) and their tensor scale ((G,) or (1,)) -> block
    scales (G,) as e4m3 bytes and codes (G, 8) uint8, two a byte, low nibble first. A zero
    (the padding of a partial block) gets code 0."""
    block_scale = (amax / (E2M1_MAX * scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block_scale.float() * scale                                 # (G,) decoded block scale
    y = torch.where(step[:, None] > 0, blocks / step[:, None], torch.zeros_like(blocks))
    codes = round_to_e2m1(y.clamp(-E2M1_MAX, E2M1_MAX), stochastic, generator)   # (G, 16)
    return block_scale.view(torch.uint8), codes[:, 0::2] | (codes[:, 1::2] << 4)


def decode_blocks(block_scale, nibbles, scale):
    """Inverse of encode_blocks: e4m3 bytes (G,), codes (G, 8) uint8 and the tensor scale
    ((G,) or (1,)) -> (G, 16) fp32."""
    codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=2).view(-1).long()   # low first
    values = on_device(SIGNED_E2M1, nibbles.device).index_select(0, codes).view(-1, NVFP4_BLOCK)
    return values * (block_scale.view(torch.float8_e4m3fn).float() * scale)[:, None]


def quantize(x, stochastic=False, generator=None) -> Quantized:
    """x -> one uint8 wire buffer (the layout above)."""
    numel = x.numel()
    if numel == 0:
        return Quantized(torch.empty(0, dtype=torch.uint8, device=x.device), x.shape, "nvfp4",
                         NVFP4_BLOCK)
    blocks = scale_groups(x, NVFP4_BLOCK)                              # (G, 16) fp32
    amax = blocks.abs().amax(dim=1)                                    # (G,)
    scale = tensor_scale(amax.max()).reshape(1)
    block_scale, nibbles = encode_blocks(blocks, amax, scale, stochastic, generator)
    buffer = torch.cat([scale.view(torch.uint8), block_scale,
                        nibbles.view(-1)[: (numel + 1) // 2]])         # no padding sent
    return Quantized(buffer, x.shape, "nvfp4", NVFP4_BLOCK)


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 tensor of q's shape."""
    numel = math.prod(q.shape)
    if numel == 0:
        return torch.zeros(q.shape, device=q.buffer.device)
    n_groups = num_groups(q.shape, NVFP4_BLOCK)
    scale = as_float32(q.buffer[:4])
    nibbles = q.buffer[4 + n_groups:]
    nibbles = torch.cat([nibbles, nibbles.new_zeros(n_groups * CODE_BYTES - nibbles.numel())])
    values = decode_blocks(q.buffer[4: 4 + n_groups], nibbles.view(-1, CODE_BYTES), scale)
    return values.view(-1)[:numel].view(q.shape)


def gather_segments(source, segments, total):
    """source[..., start: start + length] for each (start, length) row of `segments` (S, 2),
    concatenated along the last dimension (total: the lengths' sum). One gather: its index is
    built on the device from the S segments, with no per-segment work on the host."""
    starts, lengths = segments.unbind(1)
    first_out = lengths.cumsum(0) - lengths                          # where each lands
    index = (starts - first_out).repeat_interleave(lengths, output_size=total)
    return source.index_select(-1, index + torch.arange(total, device=source.device))


class WireRun:
    """The pieces (compress.Piece) of one or more shards as they lie on the wire - each as
    quantize writes it, [tensor scale | block scales | codes], back to back, and the shards back
    to back or at a stride - and as one (G, 16) block matrix in which piece k owns the rows
    first_group[k] to first_group[k + 1], its last row zero-padded. encode and decode convert
    between the two: one codec call and one gather each."""

    def __init__(self, shards):
        sizes = [p.end - p.start for pieces in shards for p in pieces]
        self.groups = [-(-n // NVFP4_BLOCK) for n in sizes]
        self.code_bytes = [(n + 1) // 2 for n in sizes]               # sent: no padding
        self.first_group = [0, *itertools.accumulate(self.groups)]
        piece_nbytes = [wire_nbytes((n,)) for n in sizes]
        self.shard_nbytes, self.placement, k = [], [], 0     # placement: (shard, byte in it)
        for j, pieces in enumerate(shards):
            at = [0, *itertools.accumulate(piece_nbytes[k: k + len(pieces)])]
            self.placement += [(j, a) for a in at[:-1]]
            self.shard_nbytes.append(at[-1])
            k += len(pieces)
        self.nbytes = sum(self.shard_nbytes)
        self.owner_on_host = torch.arange(len(sizes)).repeat_interleave(
            torch.tensor(self.groups, dtype=torch.long))
        self.on_device = {}                          # (what, device) -> tensor, made once

    def cached(self, what, device, make):
        """A tensor made once per device: by make() on the host, then copied."""
        if (what, device) not in self.on_device:
            self.on_device[what, device] = torch.as_tensor(make()).to(device)
        return self.on_device[what, device]

    def owner(self, device):
        """(G,) the piece each block belongs to."""
        return self.cached("owner", device, lambda: self.owner_on_host)

    def encode(self, blocks, stochastic=False, generator=None):
        """(G, 16) fp32 -> the pieces' wire bytes, back to back. Each piece's tensor scale comes
        from the largest of its blocks' amax: one segmented max over the run."""
        P = len(self.groups)
        if not P:
            return blocks.new_empty(0, dtype=torch.uint8)
        owner = self.owner(blocks.device)
        amax = blocks.abs().amax(dim=1)                                            # (G,)
        piece_amax = amax.new_zeros(P).scatter_reduce(0, owner, amax, "amax",
                                                       include_self=False)         # (P,)
        scale = tensor_scale(piece_amax)
        block_scale, nibbles = encode_blocks(blocks, amax, scale.index_select(0, owner),
                                             stochastic, generator)
        fields = torch.cat([scale.view(torch.uint8), block_scale, nibbles.view(-1)])
        segments = self.cached("encode", blocks.device, self.encode_segments)
        return gather_segments(fields, segments, self.nbytes)

    def encode_segments(self):
        """Where each piece's [tensor scale | block scales | codes] lie in the encoded fields
        [P tensor scales, 4 bytes each | G block scales | G x 8 code bytes]."""
        P, G = len(self.groups), self.first_group[-1]
        return [segment for k, (g0, g, c) in enumerate(zip(self.first_group, self.groups,
                                                            self.code_bytes))
                for segment in ((4 * k, 4), (4 * P + g0, g), (4 * P + G + CODE_BYTES * g0, c))]

    def decode(self, rows, stride=None):
        """rows (R, bytes): R copies of the run's wire bytes, shard j at j * stride of every row
        (back to back by default) -> (R, G, 16) fp32, the padding decoded as zeros."""
        (R, width), P, G = rows.shape, len(self.groups), self.first_group[-1]
        if not P:
            return rows.new_zeros(R, 0, NVFP4_BLOCK, dtype=torch.float32)
        segments = self.cached(("decode", stride, width), rows.device,
                               lambda: self.decode_segments(stride, width))
        source = torch.cat([rows, rows.new_zeros(R, CODE_BYTES)], dim=1)   # zeros at `width`
        fields = gather_segments(source, segments, 4 * P + (1 + CODE_BYTES) * G)
        scale = fields[:, : 4 * P].reshape(-1).view(torch.float32).view(R, P)
        values = decode_blocks(fields[:, 4 * P: 4 * P + G].reshape(-1),
                               fields[:, 4 * P + G:].reshape(-1, CODE_BYTES),
                               scale.index_select(1, self.owner(rows.device)).view(-1))
        return values.view(R, G, NVFP4_BLOCK)

    def decode_segments(self, stride, width):
        """Where the fields [P tensor scales | G block scales | G x 8 code bytes] lie in a row
        of `width` bytes, shard j at j * stride (back to back if None); a partial block's unsent
        codes read the zeros decode appends at `width`."""
        shard_at = [0, *itertools.accumulate(self.shard_nbytes)] if stride is None else \
            [j * stride for j in range(len(self.shard_nbytes))]
        at = [shard_at[j] + a for j, a in self.placement]                         # piece starts
        return [(a, 4) for a in at] + [(a + 4, g) for a, g in zip(at, self.groups)] + [
            segment for a, g, c in zip(at, self.groups, self.code_bytes)
            for segment in ((a + 4 + g, c), (width, CODE_BYTES * g - c))]


def check_nvfp4(fmt, block):
    """An NVFP4 layout's codec check (compress.ShardLayout's codes FP8 only): the format must be
    nvfp4; `block` does not apply (always 16)."""
    if fmt != "nvfp4":
        raise ValueError(f"an NVFP4 layout codes nvfp4, not {fmt!r} "
                         "(nanogeo.wire.collective.layout picks the layout of a format)")


class Nvfp4Layout(packing.PieceLayout):
    """compress.ShardLayout with NVFP4 as the codec of each piece, piece by piece (the reference
    the packed form is tested against), to nearest or stochastically. Always blocks of 16
    (`block` does not apply)."""
    check_codec = staticmethod(check_nvfp4)

    def __init__(self, shapes, fmt, block, world_size, pieces=None):
        super().__init__(shapes, fmt, NVFP4_BLOCK, world_size, pieces)

    def piece_nbytes(self, p):
        """As quantize writes the piece on its own."""
        return wire_nbytes(p.shape)

    def quantize_piece(self, values, p, rounding=(False, None)):
        return quantize(values.view(p.shape), *rounding).buffer

    def dequantize_piece(self, buffer, p):
        return dequantize(Quantized(buffer, p.shape, "nvfp4", NVFP4_BLOCK))


class Nvfp4PackedLayout(Nvfp4Layout, packing.PackedLayout):
    """The packed form of a compress.ShardLayout for NVFP4: the stages as FP8's packed form
    (nanogeo/wire/packing.py) runs them - the bucket's pieces cut into blocks of 16 and stacked in
    wire order, one codec call per stage - with the piece-by-piece path's wire (Nvfp4Layout's
    piece codec and sizes): the same bytes and, summed in the same order, the same means."""

    def __init__(self, shapes, fmt, block, world_size, pieces=None):
        super().__init__(shapes, fmt, block, world_size, pieces)
        self.bucket = WireRun(self.pieces)                                       # stages 1, 3
        self.shards = [WireRun([pieces]) for pieces in self.pieces]              # stage 2

    def encode_ranks(self, rank_flats):
        """Rank by rank, as compress.ShardLayout does (each piece's tensor scale is a max over
        that rank's piece alone), not stacked as packing.PackedLayout does."""
        return compress.ShardLayout.encode_ranks(self, rank_flats)

    def encode(self, flats, rank=0):
        return self.bucket.encode(self.blocks_in_wire_order(flats), *self.rounding((rank, 1)))

    def sum_groups(self, received, shard):
        run = self.shards[shard]
        return packing.sum_in_rank_order(run.decode(received.view(self.world_size, run.nbytes)))

    def reduce(self, received, shard, feedback=None):
        run = self.shards[shard]
        means = self.sum_groups(received, shard) / self.world_size
        if feedback is not None:                # (as packing.PieceLayout.reduce)
            means = feedback.add(shard, means)
        out = run.encode(means, *self.rounding((shard, 2)))
        if feedback is not None:
            feedback.keep(shard, means, run.decode(out.view(1, -1))[0])
        return out

    def decode(self, buffer, stride=None):
        """Stage 3 (as packing.PackedLayout.decode): shard j at j * stride, or back to back."""
        values = self.bucket.decode(buffer.view(1, -1), stride)                   # (1, G, 16)
        return self.in_tensor_order(values.view(-1), self.first_group)

    def decode_ranks(self, sends):
        """R simulated ranks' stage-1 bytes (R, bytes) -> (R, values) in tensor order, in one
        codec call (each block decodes with its own piece's tensor scale)."""
        values = self.bucket.decode(sends)                                       # (R, G, 16)
        return self.in_tensor_order(values.view(len(sends), -1), self.first_group)
