"""
NVFP4 (compress.py's 4-bit codec: blocks of 16 e2m1 values, an e4m3 scale per block, an fp32
scale per tensor) as training runs it: stochastic rounding, and the packed form of the two-stage
collective.

    wire: [tensor scale, fp32][block scale per 16 values, e4m3][two e2m1 values per byte]

Nvfp4PackedLayout runs compress.py's codec (nvfp4_encode / nvfp4_decode) on a whole bucket, one
call per stage (the pieces' tensor scales from one segmented max), and writes the same bytes,
bit for bit, as compress.quantize piece by piece (tests/test_compress.py,
test_packed_nvfp4_equals_one_call_per_piece, test_the_wire_is_what_compress_py_teaches).
"""
import functools
import itertools

import torch

import compress
from compress import NVFP4_BLOCK, Quantized
from nanogeo.wire import kernels, packing
from nanogeo.wire.packing import on_device

CODE_BYTES = NVFP4_BLOCK // 2           # a block's 16 codes, two a byte
# how a block's scale is chosen: its max at 6 (NVIDIA's recipe), or at 6 or 4, whichever errs
# less (Four Over Six, encode_4over6 below): the same wire, the same decoder
NVFP4_SCALES = ("6", "4over6")


def stochastic_e2m1(generator=None):
    """compress.e2m1_codes with stochastic rounding: |y| to one of its two grid neighbours, with
    probability proportional to closeness, so E[decode] = y (the stream: `generator`)."""
    def codes(y):
        grid = on_device(compress.E2M1_GRID, y.device)
        a = y.abs()
        low = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 6)   # grid[low] <= a
        lo, hi = grid[low], grid[low + 1]
        p_up = ((a - lo) / (hi - lo)).clamp(0, 1)
        draw = torch.rand(a.shape, generator=generator, device=y.device)
        return (low + (draw < p_up).long()).to(torch.uint8) | (y < 0).to(torch.uint8) << 3
    return codes


def encode_with(blocks, amax, scale, to_e2m1, block_max=compress.E2M1_MAX):
    """compress.nvfp4_encode restated with another rounding (`to_e2m1`: stochastic_e2m1) or
    another top for each block's amax on the e2m1 grid (`block_max`: Four Over Six's 4). With
    compress.e2m1_codes and 6 it is compress.nvfp4_encode, bit for bit (tests/test_four_over_six.py)."""
    block_scale = (amax / (block_max * scale)).clamp(max=compress.E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    step = block_scale.float() * scale                                 # (G,) decoded block scale
    y = torch.where(step[:, None] > 0, blocks / step[:, None], torch.zeros_like(blocks))
    codes = to_e2m1(y.clamp(-compress.E2M1_MAX, compress.E2M1_MAX))     # (G, 16)
    return block_scale.view(torch.uint8), codes[:, 0::2] | (codes[:, 1::2] << 4)


def encode_blocks(blocks, amax, scale, stochastic=False, generator=None):
    """compress.nvfp4_encode, to nearest or stochastically."""
    if not stochastic:
        return compress.nvfp4_encode(blocks, amax, scale)
    return encode_with(blocks, amax, scale, stochastic_e2m1(generator))


decode_blocks = compress.nvfp4_decode       # (a name of its own: tests count the calls)


def tensor_scale(amax, top=compress.E4M3_MAX):
    """compress.nvfp4_tensor_scale restated with the largest block scale brought to `top`
    (Four Over Six: FOUR_OVER_SIX_TOP); at e4m3's max it is compress's, bit for bit."""
    divisor = torch.full_like(amax, compress.E2M1_MAX * top)      # (a tensor: see compress's)
    scale = (amax / divisor).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(amax > 0, scale, 1.0)


def wire_with(x, encode, top=compress.E4M3_MAX) -> Quantized:
    """compress.quantize(x, "nvfp4") (compress.nvfp4_wire restated) with another block encoder
    `encode(blocks, amax, scale)` and the `top` of its tensor scale: the same wire format."""
    if x.numel() == 0:
        return compress.quantize(x, "nvfp4")
    blocks = compress.scale_groups(x, NVFP4_BLOCK)                     # (G, 16)
    amax = blocks.abs().amax(dim=1)
    scale = tensor_scale(amax.max(), top).reshape(1)
    block_scale, nibbles = encode(blocks, amax, scale)
    codes = nibbles.view(-1)[: (x.numel() + 1) // 2]
    buffer = torch.cat([scale.view(torch.uint8), block_scale, codes])
    return Quantized(buffer, x.shape, "nvfp4", NVFP4_BLOCK)


def quantize_nvfp4_stochastic(x, generator=None) -> Quantized:
    """compress.quantize(x, "nvfp4"), rounded stochastically: the same wire."""
    return wire_with(x, functools.partial(encode_with, to_e2m1=stochastic_e2m1(generator)))


# Four Over Six (Cook et al., arXiv 2512.02010): e2m1 has nothing between 4 and 6, so with the
# block's max at 6 a value at 0.67-1x of it loses up to 13 %. Each block is encoded twice, its
# max at 6 and at 4 (a 1.5x larger block scale: the tensor scale puts the largest block scale at
# 256, not 448, so that it still fits), and keeps the one whose decoded block is closer. The
# same bytes: the choice lives in the block scale, and decoding is unchanged. Measured on the
# study's gradients it lowers the error by 4-9 % (BENCHMARKS.md, "Four Over Six"): below the 10 %
# that would have earned it a place in compress.py's textbook codec.
FOUR_OVER_SIX_TOP = 256.0


def encode_4over6(blocks, amax, scale):
    """compress.nvfp4_encode with each block's max at 6 or at 4, whichever decodes with the
    smaller squared error (ties: 6). `scale`: tensor_scale(., FOUR_OVER_SIX_TOP)."""
    six = compress.nvfp4_encode(blocks, amax, scale)
    four = encode_with(blocks, amax, scale, compress.e2m1_codes, block_max=4.0)
    six_err, four_err = ((compress.nvfp4_decode(*enc, scale) - blocks).square().sum(dim=1)
                         for enc in (six, four))                          # (G,) each
    four_wins = four_err < six_err
    return (torch.where(four_wins, four[0], six[0]),
            torch.where(four_wins[:, None], four[1], six[1]))


def quantize_4over6(x) -> Quantized:
    """compress.quantize(x, "nvfp4") with Four Over Six's block scales: the same wire format."""
    return wire_with(x, encode_4over6, FOUR_OVER_SIX_TOP)


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

    def __init__(self, shards, four_over_six=False):
        self.four_over_six = four_over_six          # encode_4over6's block scales
        sizes = [p.end - p.start for pieces in shards for p in pieces]
        self.groups = [-(-n // NVFP4_BLOCK) for n in sizes]
        self.code_bytes = [(n + 1) // 2 for n in sizes]               # sent: no padding
        self.first_group = [0, *itertools.accumulate(self.groups)]
        piece_nbytes = [compress.wire_nbytes((n,), "nvfp4", NVFP4_BLOCK) for n in sizes]
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
        if self.four_over_six:                  # (to nearest: Options refuses it stochastic)
            scale = tensor_scale(piece_amax, FOUR_OVER_SIX_TOP)
            block_scale, nibbles = encode_4over6(blocks, amax, scale.index_select(0, owner))
        else:
            scale = compress.nvfp4_tensor_scale(piece_amax)     # elementwise: one call, P pieces
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


class Nvfp4Layout(packing.PieceLayout):
    """compress.ShardLayout for NVFP4, piece by piece (the reference the packed form is tested
    against), to nearest or stochastically; nvfp4_scale="4over6": each block's max at 6 or 4,
    whichever errs less (encode_4over6; to nearest)."""

    def __init__(self, shapes, fmt, block, world_size, pieces=None, nvfp4_scale="6"):
        if fmt != "nvfp4":
            raise ValueError(f"an NVFP4 layout codes nvfp4, not {fmt!r} "
                             "(nanogeo.wire.collective.layout picks the layout of a format)")
        if nvfp4_scale not in NVFP4_SCALES:
            raise ValueError(f"nvfp4_scale must be one of {', '.join(NVFP4_SCALES)}, got "
                             f"{nvfp4_scale!r}")
        super().__init__(shapes, fmt, NVFP4_BLOCK, world_size, pieces)
        self.four_over_six = nvfp4_scale == "4over6"

    def quantize_piece(self, values, p, rounding=(False, None)):
        if self.four_over_six:
            return quantize_4over6(values.view(p.shape)).buffer
        if not rounding[0]:
            return compress.ShardLayout.quantize_piece(self, values, p)
        return quantize_nvfp4_stochastic(values.view(p.shape), rounding[1]).buffer


class Nvfp4PackedLayout(Nvfp4Layout, packing.PackedLayout):
    """The packed form of a compress.ShardLayout for NVFP4: the stages as FP8's packed form
    (nanogeo/wire/packing.py) runs them - the bucket's pieces cut into blocks of 16 and stacked in
    wire order, one codec call per stage - with the piece-by-piece path's wire (Nvfp4Layout's
    piece codec and sizes): the same bytes and, summed in the same order, the same means."""

    def __init__(self, shapes, fmt, block, world_size, pieces=None, nvfp4_scale="6"):
        super().__init__(shapes, fmt, block, world_size, pieces, nvfp4_scale)
        self.bucket = WireRun(self.pieces, self.four_over_six)                   # stages 1, 3
        self.shards = [WireRun([pieces], self.four_over_six) for pieces in self.pieces]  # 2

    def quantize_ranks(self, rank_tensors):
        """Rank by rank, as packing.PieceLayout does (each piece's tensor scale is a max over
        that rank's piece alone; each rank's send from its own stream), not stacked as
        packing.PackedLayout does."""
        return packing.PieceLayout.quantize_ranks(self, rank_tensors)

    def quantize_shards(self, flats):
        return self.bucket.encode(self.blocks_in_wire_order(flats), *self.send_rounding())

    def sum_groups(self, received, shard):
        run = self.shards[shard]
        return kernels.sum_in_rank_order(run.decode(received.view(self.world_size, run.nbytes)))

    def sum_copies(self, received, shard):
        """sum_groups() as one flat fp32 view per piece of the shard (the two-format layout's
        stage 1: nanogeo.wire.collective.TwoFormatLayout)."""
        run, total = self.shards[shard], self.sum_groups(received, shard)
        return [total[a: b].reshape(-1)[: p.end - p.start]
                for a, b, p in zip(run.first_group, run.first_group[1:], self.pieces[shard])]

    def average_shard(self, received, shard, feedback=None):
        run = self.shards[shard]
        means = self.sum_groups(received, shard) / packing.world_divisor(self.world_size, received)
        if feedback is not None:                # (as packing.PieceLayout.reduce)
            means = feedback.add(shard, means)
        out = run.encode(means, *self.rounding((shard, 2)))
        if feedback is not None:
            feedback.keep(shard, means, run.decode(out.view(1, -1))[0])
        return out

    def dequantize_shards(self, buffer, stride=None, stage=2):
        """Stage 2's end (as packing.PackedLayout.dequantize_shards): shard j at j * stride, or
        back to back (`stage`: either - one format, the same bytes)."""
        values = self.bucket.decode(buffer.view(1, -1), stride)                   # (1, G, 16)
        return self.in_tensor_order(values.view(-1), self.first_group)

    def dequantize_ranks(self, sends):
        """R simulated ranks' stage-1 bytes (R, bytes) -> (R, values) in tensor order, in one
        codec call (each block decodes with its own piece's tensor scale)."""
        values = self.bucket.decode(sends)                                       # (R, G, 16)
        return self.in_tensor_order(values.view(len(sends), -1), self.first_group)
