"""
The codec and the two-stage collective as training runs them: compress.py's reference, with
nanogeo's forms passed in.

  * stochastic rounding of every format (the codec and its wire are compress.py's);
  * layouts (compress.ShardLayout subclasses): the packed stages (one codec call per bucket
    and stage: nanogeo/wire/packing.py, and NVFP4's own) for integer blocks, packing.PieceLayout
    (piece by piece) otherwise;
  * stochastic rounding's random streams: one per rank and stage, the simulator drawing exactly
    what the ranks draw;
  * each rank's own round trip of stage 1, for error feedback (KeptSends);
  * a benchmark's stage timer (TimedLayout), and the bytes of a ring all-reduce (the bf16
    baseline every wire is compared with);
  * a second format for stage 2 (TwoFormatLayout, --stage2_fmt): e.g. an NVFP4 all-to-all and an
    e4m3 all-gather, since re-quantizing the mean is the larger error at 4 bits.

The wire is compress.py's, byte for byte, and so are the means (tests/test_compress.py).
ProductionCommunicator.exchange passes bucket_layout()'s layout to compress.all_reduce_mean
itself; mean_over_ranks / mean_over_workers do the same for the tools and tests.
"""
import contextlib
import functools
import math

import torch

import compress
from nanogeo.wire import nvfp4, packing

FORMATS = compress.FORMATS


def ring_allreduce_bytes(numel, bytes_per_element, world_size):
    """Bytes each rank sends in a ring all-reduce: reduce-scatter + all-gather, each moving
    (W - 1) / W of the buffer: the bf16 baseline (2 bytes an element) that every wire is
    compared with, and the paper's FP8-sum collective (1 byte; plus its scales' MAX all-reduce)."""
    return int(2 * (world_size - 1) * numel * bytes_per_element // world_size)


class NoTimer:
    """Times nothing: the default stage timer (a benchmark passes one that measures each stage;
    a plain class, so states pickle)."""
    @staticmethod
    def stage(name):
        return contextlib.nullcontext()


NO_TIMER = NoTimer()


class FeedbackLayout:
    """A layout whose stage 2 keeps error feedback's residual in a packing.ShardFeedback."""

    def __init__(self, layout, feedback):
        self.layout, self.feedback = layout, feedback

    def __getattr__(self, name):
        return getattr(self.layout, name)

    def average_shard(self, received, shard, feedback=None):
        """The layout's owner step with this layout's residuals (compress.py's `feedback`
        argument: None - the fast path keeps its own, packed, per bucket)."""
        if feedback is not None:
            raise ValueError("a FeedbackLayout keeps stage 2's residuals itself: pass no feedback")
        return self.layout.average_shard(received, shard, self.feedback)


class KeptSends:
    """A layout that keeps what stage 1 sends, to decode each rank's own round trip after the
    collective (local()): error feedback keeps what that round trip lost."""

    def __init__(self, layout, device):
        self.layout, self.device, self.sends, self.one_rank = layout, device, None, True

    def __getattr__(self, name):
        return getattr(self.layout, name)

    def quantize_shards(self, flats):                  # all_reduce_mean's stage 1
        self.sends = [self.layout.quantize_shards(flats)]
        return self.sends[0]

    def quantize_ranks(self, rank_tensors):            # simulate_mean's, of every rank
        self.sends, self.one_rank = self.layout.quantize_ranks(rank_tensors), False
        return self.sends

    def local(self):
        """[each kept rank's round trip: its tensors, fp32] (rank order)."""
        if self.one_rank:           # all_reduce_mean (none kept: only empty tensors, none sent)
            empty = torch.empty(0, dtype=torch.uint8, device=self.device)
            return [compress.dequantize_bucket(self.sends[0] if self.sends else empty,
                                               self.layout, stage=1)]
        if not sum(self.nbytes):    # only empty tensors
            return [compress.dequantize_bucket(send, self.layout) for send in self.sends]
        sizes = [math.prod(s) for s in self.shapes]
        return [[t.view(s) for t, s in zip(v.split(sizes), self.shapes)]
                for v in self.layout.dequantize_ranks(self.sends)]


class TimedLayout:
    """A layout whose codec stages a benchmark's timer measures: "quantize" (stage 1's),
    "reduce" (the owner's: decode the W copies, add, quantize again) and "decode" (stage 2's
    end); the
    all_to_all and all_gather are the rest of the collective's time."""

    def __init__(self, layout, timer):
        self.layout, self.timer = layout, timer

    def __getattr__(self, name):
        return getattr(self.layout, name)

    def quantize_shards(self, flats):
        with self.timer.stage("quantize"):
            return self.layout.quantize_shards(flats)

    def average_shard(self, received, shard, feedback=None):
        with self.timer.stage("reduce"):
            return self.layout.average_shard(received, shard, feedback)

    def dequantize_shards(self, buffer, stride=None, stage=2):
        with self.timer.stage("decode"):
            return self.layout.dequantize_shards(buffer, stride, stage)


class TwoFormatLayout:
    """A layout whose stages send two formats (--stage2_fmt): stage 1 (each rank's send, the
    owner's decode of the W copies) in stage1_layout's, stage 2 (the owner's mean quantized
    again, gathered, decoded by every rank) in stage2_layout's - two layouts of the same pieces,
    so each piece's mean is quantized again as that same piece. stage2_nbytes: stage 2's shard
    sizes, which compress.all_reduce_mean gathers and compress.collective_bytes counts."""

    def __init__(self, stage1_layout, stage2_layout):
        self.stage1_layout, self.stage2_layout = stage1_layout, stage2_layout
        self.stage2_fmt, self.stage2_nbytes = stage2_layout.fmt, stage2_layout.nbytes
        self.stage2_piece_nbytes = stage2_layout.piece_nbytes

    def __getattr__(self, name):        # stage 1's: pieces, nbytes, quantize_shards, ...
        return getattr(self.stage1_layout, name)

    def with_streams(self, rng_for, sender=None):
        """Stage 1 rounded as rng_for says (as rank `sender` sends), stage 2 to nearest (Options
        rejects stochastic rounding of a second stage-2 format)."""
        if rng_for is None:
            return self
        return TwoFormatLayout(self.stage1_layout.with_streams(rng_for, sender),
                               self.stage2_layout)

    def average_shard(self, received, shard, feedback=None):
        """The owner's step: the W copies decoded and added in rank order by stage 1's codec,
        divided by W, quantized again by stage 2's (packed FP8: in one call; the wire is
        compress.quantize's of each piece either way). No stage-2 error feedback (Options
        refuses it with a stage-2 format of its own)."""
        if feedback is not None:
            raise ValueError("a stage 2 in its own format (stage2_fmt) keeps no error feedback: "
                             "pass no feedback, or drop stage2_fmt")
        W = packing.world_divisor(self.world_size, received)
        means = [v / W for v in self.stage1_layout.sum_copies(received, shard)]
        second = self.stage2_layout
        if not means:
            return received.new_empty(0)
        if isinstance(second, packing.PackedLayout) and second.fmt in compress.FP8_FORMATS:
            B = second.block            # each piece zero-padded to whole groups, as quantize does
            blocks = torch.cat([torch.nn.functional.pad(v, (0, -v.numel() % B)) for v in means])
            return packing.pack_groups(blocks.view(-1, B), second.fmt)
        return torch.cat([second.quantize_piece(v, p) for v, p in zip(means, second.pieces[shard])])

    def dequantize_shards(self, buffer, stride=None, stage=2):
        """stage 2's bytes by stage2_layout, a rank's own stage-1 send by stage1_layout."""
        layout = self.stage2_layout if stage == 2 else self.stage1_layout
        return layout.dequantize_shards(buffer, stride)


def two_format_layout(shapes, fmt, stage2_fmt, block, world_size, nvfp4_scale="6"):
    """TwoFormatLayout: both stages on the pieces layout() cuts for the FP8 one of the two
    formats (its groups of `block` are whole NVFP4 blocks of 16 when block is a multiple of 16:
    cut in NVFP4's finer groups instead, every piece would pad its last FP8 group), each
    stage scaling them in its own groups (NVFP4: 16; FP8: `block`) from the piece's start."""
    cut = layout(shapes, stage2_fmt if fmt == "nvfp4" else fmt, block, world_size).pieces

    def pieces_for(f):
        b = compress.NVFP4_BLOCK if f == "nvfp4" else block
        return [[p if p.block == b else p._replace(shape=(p.end - p.start,), block=b)
                 for p in shard] for shard in cut]
    return TwoFormatLayout(layout(shapes, fmt, block, world_size, pieces_for(fmt),
                                  nvfp4_scale=nvfp4_scale),
                           layout(shapes, stage2_fmt, block, world_size, pieces_for(stage2_fmt),
                                  nvfp4_scale=nvfp4_scale))


def stochastic_quantize(x, fmt="e4m3", block=128, generator=None):
    """compress.quantize, rounded stochastically (from `generator`; None: torch's global
    stream): the same wire."""
    compress.check_codec(fmt, block)
    if fmt == "nvfp4":
        return nvfp4.quantize_nvfp4_stochastic(x, generator)
    return packing.quantize_fp8_stochastic(x, fmt, block, generator)


def layout(shapes, fmt, block, world_size, pieces=None, packed=True, nvfp4_scale="6"):
    """The ShardLayout of a bucket: packed for FP8 in integer blocks (packed=False: piece by
    piece, the reference the packed form is tested against; a one-byte format of compress.py's
    other than FP8 always goes piece by piece, through compress.quantize); NVFP4's block scales
    as nvfp4_scale says (nanogeo.wire.nvfp4.NVFP4_SCALES; other formats ignore it)."""
    if fmt == "nvfp4":                                  # always blocks of 16
        kind = nvfp4.Nvfp4PackedLayout if packed else nvfp4.Nvfp4Layout
        return kind(shapes, fmt, block, world_size, pieces, nvfp4_scale)
    packable = packed and isinstance(block, int) and fmt in compress.FP8_FORMATS
    kind = packing.PackedLayout if packable else packing.PieceLayout
    return kind(shapes, fmt, block, world_size, pieces)


@functools.lru_cache(maxsize=64)
def shard_layout(shapes, fmt, block, world_size, stage2_fmt="", nvfp4_scale="6"):
    """layout() (or with another stage2_fmt, two_format_layout()), built once per (shapes,
    formats, world size): the collective asks for the same one every step."""
    if stage2_fmt and stage2_fmt != fmt:
        return two_format_layout(shapes, fmt, stage2_fmt, block, world_size, nvfp4_scale)
    return layout(shapes, fmt, block, world_size, nvfp4_scale=nvfp4_scale)


def rng(seed, rank, stage, device):
    """The stochastic-rounding stream of one rank and stage; the simulator uses the same ones.
    seed None: torch's global stream."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + rank * 101 + stage) % (2 ** 63))
    return generator


ROUNDING_STAGES = {"both": (1, 2), "1": (1,), "2": (2,)}    # stochastic_stages -> the stages


def streams(stochastic, seed, device, stages="both"):
    """A layout's rounding for this step (with_streams): rng_for(rank, stage) -> (stochastic,
    generator), stochastic from rng of (rank, stage) in the chosen `stages` ("both", "1": each
    rank's own send, "2": the owner's re-quantization of the averaged shard), to nearest in the
    other; None: every stage to nearest."""
    if not stochastic:
        return None
    chosen = ROUNDING_STAGES[stages]
    return lambda rank, stage: ((True, rng(seed, rank, stage, device)) if stage in chosen
                                else (False, None))


def bucket_layout(tensors, fmt, block, world, stochastic=False, seed=None, stages="both",
                  feedback=None, timer=NO_TIMER, stage2_fmt="", nvfp4_scale="6", sender=None):
    """The layout one step's collective runs on a bucket of tensors: cached by shapes, with this
    step's stochastic-rounding streams (in the `stages` of streams(); stage 1 as rank `sender`
    sends - a simulator's layout, sender None, draws each rank's own), stage 2's error feedback
    (`feedback`: a packing.ShardFeedback), a benchmark's `timer` on its codec stages, stage
    2 in `stage2_fmt` ("": fmt) and NVFP4's block scales as `nvfp4_scale` says."""
    if stage2_fmt and stage2_fmt != fmt and (feedback is not None or stochastic and stages != "1"):
        raise ValueError("a stage 2 in its own format (stage2_fmt) rounds to nearest and keeps no "
                         "error feedback: pass stages='1' and feedback=None, or drop stage2_fmt")
    bucket = shard_layout(tuple(tuple(t.shape) for t in tensors), fmt, block, world, stage2_fmt,
                          nvfp4_scale)
    bucket = bucket.with_streams(streams(stochastic, seed, tensors[0].device, stages), sender)
    if feedback is not None:
        bucket = FeedbackLayout(bucket, feedback)
    return bucket if timer is NO_TIMER else TimedLayout(bucket, timer)


def mean_over_ranks(tensors, fmt="e4m3", block=128, group=None, stochastic=False, seed=None,
                    return_local=False, stages="both", feedback=None, timer=NO_TIMER,
                    stage2_fmt="", nvfp4_scale="6"):
    """compress.all_reduce_mean on bucket_layout()'s layout: packed, NVFP4, stochastic rounding,
    stage-2 error feedback, a second stage-2 format; return_local adds this rank's own round
    trip (KeptSends)."""
    across = torch.distributed.is_initialized()
    world = torch.distributed.get_world_size(group) if across else 1
    me = torch.distributed.get_rank(group) if across else 0
    bucket = bucket_layout(tensors, fmt, block, world, stochastic, seed, stages, feedback, timer,
                           stage2_fmt, nvfp4_scale, sender=me)
    kept = KeptSends(bucket, tensors[0].device) if return_local else bucket
    means, nbytes = compress.all_reduce_mean(tensors, kept, group=group)
    return (means, nbytes, kept.local()[0]) if return_local else (means, nbytes)


def mean_over_workers(worker_tensors, fmt="e4m3", block=128, stochastic=False, seed=None,
                      return_local=False, stages="both", feedback=None, stage2_fmt="",
                      nvfp4_scale="6"):
    """compress.simulate_mean on the same layouts: exactly mean_over_ranks' numerics
    (return_local: and each rank's own round trip)."""
    bucket = bucket_layout(worker_tensors[0], fmt, block, len(worker_tensors), stochastic, seed,
                           stages, feedback, stage2_fmt=stage2_fmt, nvfp4_scale=nvfp4_scale)
    kept = KeptSends(bucket, worker_tensors[0][0].device) if return_local else bucket
    means, nbytes = compress.simulate_mean(worker_tensors, kept)
    return (means, nbytes, kept.local()) if return_local else (means, nbytes)
