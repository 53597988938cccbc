"""
The packed form of compress.py's two-stage collective: a whole bucket through the FP8 codec in
ONE call per stage, instead of one per piece (a bucket has W x T pieces: thousands of small
kernel launches per step at scale). nanogeo.wire.collective passes it into compress.ShardLayout
for e4m3 / e5m2 with integer blocks; the means are bit-identical to quantizing piece by piece (tests/test_compress.py,
test_packed_codec_equals_one_call_per_piece), the wire carries < block padding bytes more per
piece.

With integer blocks every piece is cut into groups of `block` elements starting at the piece's
start, the last one zero-padded, and each group travels as [fp32 scale | block fp8 codes]: a
shard is a (groups, 4 + block) byte matrix, and all shards of a bucket stacked are one. So
stage 1 is one concatenation of the pieces in wire order (with their padding), one encode and
one concatenation of scales and codes; stage 2 decodes the W copies as one matrix and adds
them in rank order (the per-piece path's order: W - 1 additions, not one .sum, whose order
differs); stage 3 decodes the W shards as one matrix and concatenates the pieces' values back
into tensors. Only views and host-side bookkeeping per piece. NVFP4's packed form
(nanogeo/wire/nvfp4.py) is this class with its own codec and wire.
"""
import torch

import compress
from nanogeo.wire import kernels


def pack_groups(groups, fmt, stochastic=False, generator=None):
    """(G, L) fp32 -> (G * (4 + L),) uint8 wire bytes, per group [fp32 scale | L codes]."""
    if stochastic:
        scale, codes = compress.encode_groups(groups, fmt, stochastic, generator)
    else:                               # compress.encode_groups, with the kernel compiled or not
        dtype, fmax = compress.FP8_FORMATS[fmt]
        scale, codes = kernels.KERNELS["fp8_encode"](groups, fmax, dtype)
    return torch.cat([scale.view(torch.uint8).view(-1, 4), codes], dim=1).view(-1)


def unpack_groups(buffer, block, fmt):
    """Inverse of pack_groups: uint8 bytes -> (G, block) fp32 values."""
    rows = buffer.view(-1, 4 + block)
    scale = rows[:, :4].contiguous().view(torch.float32).view(-1)       # (G,)
    return kernels.KERNELS["fp8_decode_groups"](rows[:, 4:], scale, compress.FP8_FORMATS[fmt][0])


def sum_in_rank_order(copies):
    """(W, ...) -> their sum over the first dimension, added left to right, copy 0 + copy 1 + ...:
    the order of the piece-by-piece path (compress.sum_shard), so the sums are equal bit for
    bit. (torch's .sum(dim=0) adds in another order - in blocks of 16 or more rows on a CPU, a
    tree on a GPU - and rounds differently.)"""
    total = copies[0]
    for copy in copies[1:]:
        total = total + copy
    return total


class Packing:
    """The packed wire form of one compress.ShardLayout (FP8, integer block)."""

    def __init__(self, layout):
        B = layout.block
        self.block, self.fmt, self.world_size = B, layout.fmt, layout.world_size
        self.first_group = [0]          # shard j's groups: first_group[j] to first_group[j + 1]
        self.encode_order = []                  # (tensor, start, end, pad), in wire order
        by_tensor = [[] for _ in layout.shapes]  # (start, shard, first group in shard, n)
        for j, pieces in enumerate(layout.pieces):
            q = 0
            for p in pieces:
                n = p.end - p.start
                count = -(-n // B)
                self.encode_order.append((p.tensor, p.start, p.end, count * B - n))
                by_tensor[p.tensor].append((p.start, j, q, n))
                q += count
            self.first_group.append(self.first_group[-1] + q)
        self.decode_order = [(j, q, n) for pieces in by_tensor for _, j, q, n in sorted(pieces)]

    def piece_nbytes(self, piece):
        """Groups of [fp32 scale | block codes], the last one padded."""
        return -(-(piece.end - piece.start) // self.block) * (4 + self.block)

    def blocks_in_wire_order(self, flats):
        """The bucket's flat fp32 tensors -> (groups, block): every piece in wire order, cut
        into groups of `block` from its start, the last one zero-padded."""
        return self.rows_in_wire_order([f.view(1, -1) for f in flats])

    def rows_in_wire_order(self, rows):
        """(R, numel) fp32 per tensor -> (R x groups, block): each row's pieces in wire order,
        each padded with zeros to whole groups."""
        zero, parts = compress.on_device((0.0,) * self.block, rows[0].device), []
        for t, start, end, pad in self.encode_order:
            parts.append(rows[t][:, start:end])
            if pad:
                parts.append(zero[:pad].expand(len(rows[t]), pad))
        return torch.cat(parts, dim=1).view(-1, self.block)

    def encode_ranks(self, rank_flats):
        """Stage 1 of R simulated ranks in one call: rank_flats[i] = rank i's flat fp32 tensors
        -> (R, bytes), row i = encode(rank_flats[i]). Every group is quantized on its own, so
        stacking the ranks changes no byte (nearest rounding; stochastic rounding draws from
        each rank's own stream: compress.encode_ranks encodes those one by one)."""
        rows = [torch.stack(column) for column in zip(*rank_flats)]     # (R, numel) per tensor
        return pack_groups(self.rows_in_wire_order(rows), self.fmt).view(len(rank_flats), -1)


    def encode(self, flats, stochastic=False, generator=None):
        """Stage 1: the bucket's flat fp32 tensors -> the W shards' bytes, back to back."""
        return pack_groups(self.blocks_in_wire_order(flats), self.fmt, stochastic, generator)

    def sum_copies(self, received, shard):
        """Stage 2: the W received copies of `shard` -> their fp32 sum, (groups, block). (Every
        FP8 group carries its own scale, so the bytes decode without the shard's layout.)"""
        values = unpack_groups(received, self.block, self.fmt)
        return sum_in_rank_order(values.view(self.world_size, -1, self.block))

    def requantize(self, total, shard, stochastic=False, generator=None):
        """Stage 2: the summed shard divided by W, back to wire bytes."""
        return pack_groups(total / self.world_size, self.fmt, stochastic, generator)

    def piece_values(self, total, pieces):
        """sum_copies' result as one flat fp32 view per piece of the shard."""
        flat, out, first = total.reshape(-1), [], 0
        for p in pieces:
            n = p.end - p.start
            out.append(flat[first: first + n])
            first += -(-n // self.block) * self.block
        return out

    def decode(self, buffer, stride=None):
        """Stage 3: the W shards' bytes (shard j at j * stride, or back to back) -> the bucket's
        flat fp32 values in tensor order. The padding rows of a gathered buffer (shards shorter
        than the largest) decode to garbage (scale 0); they are never read."""
        first_group = self.first_group if stride is None else \
            [j * (stride // (4 + self.block)) for j in range(self.world_size)]
        return self.in_tensor_order(unpack_groups(buffer, self.block, self.fmt).reshape(-1),
                                    first_group)

    def decode_ranks(self, sends):
        """R simulated ranks' stage-1 bytes (R, bytes) -> (R, values) in tensor order, in one
        codec call: each rank's own round trip, for error feedback."""
        values = unpack_groups(sends.reshape(-1), self.block, self.fmt).view(len(sends), -1)
        return self.in_tensor_order(values, self.first_group)

    def in_tensor_order(self, flat, first_group):
        """Decoded groups, flat (or (R, flat) for R ranks), shard j's from group first_group[j]
        on -> the bucket's flat fp32 values in tensor order, the padding left out."""
        B, parts = self.block, []
        for j, q, n in self.decode_order:
            first = first_group[j] + q
            parts.append(flat[..., first * B: first * B + n])
        return torch.cat(parts, dim=-1)
