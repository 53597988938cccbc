"""
compress.py's two-stage collective as training runs it, for e4m3 / e5m2: stochastic rounding
(PieceLayout, and every layout below it) and the packed form (PackedLayout): a whole bucket
through the FP8 codec in ONE call per stage, instead of one per piece (a bucket has W x T
pieces: thousands of small kernel launches per step at scale). nanogeo.wire.collective uses it
for integer blocks; the means are bit-identical to quantizing piece by piece
(tests/test_compress.py, test_packed_codec_equals_one_call_per_piece), and so are the bytes:
compress.quantize's wire is already a (groups, 4 + block) byte matrix
(test_the_wire_is_what_compress_py_teaches).

Stochastic rounding casts each value to one of its two FP8 neighbours, with probability
proportional to closeness, so E[decode] = value: unbiased, with more variance than rounding to
nearest. Every rank and stage draws from its own stream (nanogeo.wire.collective.streams), and
the simulator from the same ones.

With integer blocks every piece is cut into groups of `block` elements starting at the piece's
start, the last one zero-padded, and each group travels as [fp32 scale | block fp8 codes]
(compress.quantize's wire): a shard is a (groups, 4 + block) byte matrix, and all shards of a
bucket stacked are one. So stage 1's quantization is one concatenation of the pieces in wire
order (with their padding), one encode and one concatenation of scales and codes; the owner
decodes the W copies as one matrix and adds them in rank order (the per-piece path's order:
W - 1 additions, not one .sum, whose order differs); stage 2's end decodes the W shards as
one matrix and concatenates the pieces' values back into tensors. Only views and host-side
bookkeeping per piece. NVFP4's packed form (nanogeo/wire/nvfp4.py) is a PackedLayout with its
own codec and wire.
"""
import copy
import functools

import torch

import compress
from nanogeo.wire import kernels

FP8_MAX_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}  # largest finite magnitude


def stochastic_fp8(y, dtype, generator=None):
    """Cast y (within the format's range) to FP8 stochastically: to one of its two neighbours,
    with probability proportional to closeness, so E[decode] = y. The stream: `generator`."""
    nearest = y.to(dtype)
    # the other neighbour: one step from `nearest` on the far side of y, found by stepping the
    # 7-bit magnitude code (fp8 magnitudes are ordered like their codes)
    near_val = nearest.float()
    mag = (nearest.view(torch.uint8) & 0x7F).int()
    overshoot = near_val.abs() > y.abs()
    other_mag = torch.where(overshoot, mag - 1, (mag + 1).clamp(max=FP8_MAX_CODE[dtype])).clamp(min=0)
    other = (other_mag | torch.where(y < 0, 0x80, 0)).to(torch.uint8).view(dtype)
    gap = (other.float() - near_val).abs()
    p_other = torch.where(gap > 0, (y - near_val).abs() / gap, torch.zeros_like(y))
    draw = torch.rand(y.shape, generator=generator, device=y.device)
    return torch.where(draw < p_other, other, nearest.view(torch.uint8).view(dtype))


def stochastic_encode(groups, fmax, dtype, generator=None):
    """compress.fp8_encode with stochastic rounding: (G, L) fp32 -> scales (G,) fp32 and codes
    (G, L) uint8."""
    scale = compress.scale_from_amax(groups.abs().amax(dim=1), fmax)            # (G,)
    y = (groups * scale[:, None]).clamp(-fmax, fmax)                   # saturated at +-fmax
    return scale, stochastic_fp8(y, dtype, generator).view(torch.uint8)


def from_host(t, device, dtype=None):
    """A host tensor on `device` (as t.to(device, dtype)): on a GPU one copy from pinned memory,
    non_blocking - from ordinary (pageable) memory the copy would make the host wait for the
    device; torch's pinned-memory cache keeps the buffer until the copy is done. A new dtype is
    cast on the host first: CUDA casts a host tensor on the host anyway (Copy.cu), into a fresh
    pageable temporary it would then copy from, so the bits are the same."""
    if t.is_cpu and torch.device(device).type == "cuda":
        return t.to(dtype or t.dtype).pin_memory().to(device, non_blocking=True)
    return t.to(device, dtype)


def world_divisor(world, like):
    """compress.count_divisor(world, like), made once per device (a fill kernel a bucket
    otherwise)."""
    return count_divisor_on(world, like.device)


@functools.lru_cache(maxsize=None)
def count_divisor_on(world, device):
    return compress.count_divisor(world, torch.empty(0, device=device))


@functools.lru_cache(maxsize=None)
def on_device(constant, device):
    """A constant tensor (or tuple of tensors, or tuple of numbers) on `device`, made once: built
    or copied from host memory at every call instead, each copy would make a GPU stream wait."""
    if isinstance(constant, tuple) and isinstance(constant[0], torch.Tensor):
        return tuple(t.to(device) for t in constant)
    return torch.tensor(constant, device=device)


def quantize_fp8_stochastic(x, fmt, block, generator=None):
    """compress.quantize (FP8), rounded stochastically from `generator` (None: torch's global
    stream): the same wire."""
    if x.numel() == 0:
        return compress.quantize(x, fmt, block)
    dtype, fmax = compress.FP8_FORMATS[fmt]
    scale, codes = stochastic_encode(compress.scale_groups(x, block), fmax, dtype, generator)
    return compress.Quantized(compress.fp8_pack(scale, codes), x.shape, fmt, block)


def pack_groups(groups, fmt, stochastic=False, generator=None):
    """(G, L) fp32 -> (G * (4 + L),) uint8: compress.quantize's wire of G whole groups, per group
    [fp32 scale | L codes]."""
    dtype, fmax = compress.FP8_FORMATS[fmt]
    if stochastic:
        return compress.fp8_pack(*stochastic_encode(groups, fmax, dtype, generator))
    return kernels.KERNELS["encode_packed"](groups, fmax, dtype)   # compiled or not


def unpack_groups(buffer, block, fmt):
    """Inverse of pack_groups: uint8 bytes -> (G, block) fp32 values (compress.dequantize's FP8
    branch, with the kernel compiled or not)."""
    return kernels.KERNELS["decode_packed"](buffer, block, compress.FP8_FORMATS[fmt][0])


class ShardFeedback:
    """Error feedback on stage 2: the owner of each shard keeps what re-quantizing its averaged
    shard lost and adds it to that shard's mean at the next step, so over steps the delivered
    means add up to the exact stage-1 means (the error does not accumulate). Kept in the
    layout's own form of the shard (a tensor, or a list with one per piece) as
    residuals[shard][KEY] (a communicator's bucket k > 0: KEY + " k"), beside the owner's
    stage-1 residuals (so checkpoints keep it with them): a rank holds only its own shard's, 1/W
    of the bucket. A non-finite loss is kept as 0."""
    KEY = "stage 2"         # not a parameter name (those are dotted identifiers)

    def __init__(self, residuals, bucket=0):
        self.residuals = residuals          # {rank: {name: residual}}
        self.key = self.KEY if bucket == 0 else f"{self.KEY} {bucket}"     # one per bucket

    @classmethod
    def owns(cls, key):
        """Is `key` of a residuals dict one of stage 2's (of any bucket)?"""
        return key == cls.KEY or key.startswith(cls.KEY + " ")

    def add(self, shard, means):
        residual = self.residuals.get(shard, {}).get(self.key)
        if residual is None:
            return means
        if isinstance(means, list):
            return [m + r for m, r in zip(means, residual)]
        return means + residual

    def keep(self, shard, means, decoded):
        """This step's loss - unless the shard's mean is not finite (an fp16 overflow: the
        optimizer skips the step), then the old residual, as stage 1's feedback does; chosen on
        the device, no host sync."""
        as_list = isinstance(means, list)
        means, decoded = (means, decoded) if as_list else ([means], [decoded])
        ends = [torch.stack(torch.aminmax(m)) for m in means if m.numel()]
        if not ends:
            return
        finite = torch.isfinite(torch.cat(ends)).all()
        old = self.residuals.get(shard, {}).get(self.key)
        old = [torch.zeros_like(m) for m in means] if old is None else old if as_list else [old]
        lost = [torch.where(finite, m - d, o) for m, d, o in zip(means, decoded, old)]
        self.residuals.setdefault(shard, {})[self.key] = lost if as_list else lost[0]


class PieceLayout(compress.ShardLayout):
    """compress.ShardLayout as production runs it, piece by piece (row and tensor scaling, and
    the reference the packed form is tested against):
      * `pieces` given explicitly (FSDP's row chunks);
      * stochastic rounding: rng_for(rank, stage) -> (stochastic, torch.Generator), set by
        with_streams on a copy for one step; None: every stage to nearest. Stage 1 draws from
        the stream of `sender`, the rank whose send it quantizes (compress.py's stage 1 takes
        no rank: its codec rounds to nearest); None: no rank's, and a stochastic stage 1
        refuses to run."""
    rng_for, sender = None, None

    def __init__(self, shapes, fmt, block, world_size, pieces=None):
        self.given = pieces
        super().__init__(shapes, fmt, block, world_size)

    def cut(self):
        return super().cut() if self.given is None else self.given

    def with_streams(self, rng_for, sender=None):
        """A copy of this (cached) layout that rounds as rng_for(rank, stage) says: (True, that
        rank's and stage's stream) stochastically, (False, None) to nearest (None: this layout
        itself, every stage to nearest), its stage 1 as rank `sender` sends (None: a simulator's
        layout, whose quantize_ranks draws each rank's send from its own). rng_for must return
        a new generator, seeded for that rank and stage, at every call: then every call of the
        copy draws the same, and the simulator what the ranks draw
        (nanogeo.wire.collective.streams; with seed=None the generator is None, torch's global
        one, which has neither)."""
        if rng_for is None:
            return self
        rounded = copy.copy(self)
        rounded.rng_for, rounded.sender = rng_for, sender
        return rounded

    def quantize_ranks(self, rank_tensors):
        """The simulator's stage 1, rank by rank (compress.ShardLayout.quantize_ranks), rank i's
        send drawing from rank i's stream."""
        if not self.rounds_sends():
            return compress.ShardLayout.quantize_ranks(self, rank_tensors)
        return torch.stack([compress.quantize_bucket(tensors, self.with_streams(self.rng_for, i))
                            for i, tensors in enumerate(rank_tensors)])

    def dequantize_ranks(self, sends):
        """R simulated ranks' stage-1 bytes (R, bytes) -> (R, values) in tensor order: each
        rank's own round trip, for error feedback (a packed layout: in one codec call)."""
        return torch.stack([self.dequantize_shards(send) for send in sends])

    def rounding(self, whose):
        """(stochastic, generator) of rank whose[0] (an int) in stage whose[1]: a new generator
        from its stream at each stage call, drawn from piece after piece."""
        return (False, None) if self.rng_for is None else self.rng_for(*whose)

    def rounds_sends(self):
        """Does stage 1 round stochastically (each rank's send from its own stream)?"""
        return self.rounding((0, 1))[0]

    def send_rounding(self):
        """Stage 1's rounding: the sender's stream. A layout made without a sender rounds stage 1
        to nearest, or refuses where it would round stochastically: every rank would draw the
        same numbers."""
        if self.sender is not None:
            return self.rounding((self.sender, 1))
        if self.rounds_sends():
            raise ValueError("a layout rounding stage 1 stochastically quantizes one rank's send: "
                             "make it with with_streams(rng_for, sender=that rank)")
        return False, None

    def quantize_piece(self, values, p, rounding=(False, None)):
        if not rounding[0]:
            return super().quantize_piece(values, p)
        return quantize_fp8_stochastic(values.view(p.shape), self.fmt, p.block, rounding[1]).buffer

    # compress.ShardLayout's stages 1 and 2, each stage call rounding from one stream
    def quantize_shards(self, flats):
        rounding = self.send_rounding()
        return torch.cat([self.quantize_piece(flats[p.index][p.start:p.end], p, rounding)
                          for shard in self.pieces for p in shard])

    def average_shard(self, received, shard, feedback=None):
        """The owner's mean, quantized again; with `feedback` (ShardFeedback) the shard's
        residual is added to the mean before it is quantized, and what this quantization loses
        is kept for the next step."""
        rounding = self.rounding((shard, 2))
        W = world_divisor(self.world_size, received)
        means = [v / W for v in self.sum_copies(received, shard)]
        if feedback is not None:
            means = feedback.add(shard, means)
        parts = [self.quantize_piece(v, p, rounding) for v, p in zip(means, self.pieces[shard])]
        out = torch.cat(parts) if parts else received.new_empty(0)
        if feedback is not None:
            feedback.keep(shard, means, self.decode_shard(out, shard))
        return out


class PackedLayout(PieceLayout):
    """The packed wire form of compress.ShardLayout (FP8, integer block): each stage one codec
    call for the whole bucket."""

    def __init__(self, shapes, fmt, block, world_size, pieces=None):
        super().__init__(shapes, fmt, block, world_size, pieces)
        B = self.block
        self.first_group = [0]          # shard j's groups: first_group[j] to first_group[j + 1]
        self.encode_order = []                  # (tensor, start, end, pad), in wire order
        by_tensor = [[] for _ in self.shapes]   # (start, shard, first group in shard, n)
        for j, pieces in enumerate(self.pieces):
            q = 0
            for p in pieces:
                n = p.end - p.start
                count = -(-n // B)
                self.encode_order.append((p.index, p.start, p.end, count * B - n))
                by_tensor[p.index].append((p.start, j, q, n))
                q += count
            self.first_group.append(self.first_group[-1] + q)
        self.decode_order = [(j, q, n) for pieces in by_tensor for _, j, q, n in sorted(pieces)]

    def blocks_in_wire_order(self, flats):
        """The bucket's flat fp32 tensors -> (groups, block): every piece in wire order, cut
        into groups of `block` from its start, the last one zero-padded."""
        return self.rows_in_wire_order([f.view(1, -1) for f in flats])

    def rows_in_wire_order(self, rows):
        """(R, numel) fp32 per tensor -> (R x groups, block): each row's pieces in wire order,
        each padded with zeros to whole groups."""
        zero, parts = on_device((0.0,) * self.block, rows[0].device), []
        for t, start, end, pad in self.encode_order:
            parts.append(rows[t][:, start:end])
            if pad:
                parts.append(zero[:pad].expand(len(rows[t]), pad))
        return torch.cat(parts, dim=1).view(-1, self.block)

    def quantize_ranks(self, rank_tensors):
        """Stage 1 of R simulated ranks in one call: rank_tensors[i] = rank i's tensors -> (R,
        bytes), row i = rank i's stage 1. Every group is quantized on its own, so stacking the
        ranks changes no byte (nearest rounding; stochastic rounding draws from each rank's own
        stream: rank by rank, where stage 1 rounds stochastically)."""
        if self.rounds_sends() or not sum(self.nbytes):
            return super().quantize_ranks(rank_tensors)
        rows = [torch.stack([t.reshape(-1).float() for t in column])    # (R, numel) per tensor
                for column in zip(*rank_tensors)]
        return pack_groups(self.rows_in_wire_order(rows), self.fmt).view(len(rank_tensors), -1)

    def quantize_shards(self, flats):
        """Stage 1's quantization: the bucket's flat fp32 tensors -> the W shards' bytes, back
        to back."""
        return pack_groups(self.blocks_in_wire_order(flats), self.fmt, *self.send_rounding())

    def sum_groups(self, received, shard):
        """The W received copies of `shard` -> their fp32 sum, (groups, block). (Every FP8
        group carries its own scale, so the bytes decode without the shard's layout.)"""
        values = unpack_groups(received, self.block, self.fmt)
        return kernels.sum_in_rank_order(values.view(self.world_size, -1, self.block))

    def sum_copies(self, received, shard):
        return self.piece_values(self.sum_groups(received, shard), self.pieces[shard])

    def average_shard(self, received, shard, feedback=None):
        """The owner's step: the summed shard divided by W, back to wire bytes (with `feedback`, as
        PieceLayout.reduce)."""
        divisor, rounding = world_divisor(self.world_size, received), self.rounding((shard, 2))
        if feedback is None and not rounding[0]:     # decode, sum, divide, encode: one call
            dtype, fmax = compress.FP8_FORMATS[self.fmt]
            return kernels.KERNELS["average_packed"](received, self.world_size, self.block,
                                                     dtype, fmax, divisor)
        means = self.sum_groups(received, shard) / divisor
        if feedback is not None:
            means = feedback.add(shard, means)
        out = pack_groups(means, self.fmt, *rounding)
        if feedback is not None:
            feedback.keep(shard, means, unpack_groups(out, self.block, self.fmt))
        return out

    def piece_values(self, total, pieces):
        """sum_groups()'s result as one flat fp32 view per piece of the shard."""
        flat, out, first = total.reshape(-1), [], 0
        for p in pieces:
            n = p.end - p.start
            out.append(flat[first: first + n])
            first += -(-n // self.block) * self.block
        return out

    def dequantize_shards(self, buffer, stride=None, stage=2):
        """Stage 2's end: the W shards' bytes (shard j at j * stride, or back to back) -> the
        bucket's flat fp32 values in tensor order. The padding rows of a gathered buffer (shards shorter
        than the largest) decode to garbage (scale 0); they are never read. (`stage`: either - one
        format, the same bytes.)"""
        first_group = self.first_group if stride is None else \
            [j * (stride // (4 + self.block)) for j in range(self.world_size)]
        return self.in_tensor_order(unpack_groups(buffer, self.block, self.fmt).reshape(-1),
                                    first_group)

    def dequantize_ranks(self, sends):
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
