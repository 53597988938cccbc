"""
Buckets: the explicit path averages the gradients a bucket at a time, not the model as one.

Averaged as one bucket, a step holds several fp32 copies of every gradient at once - the
tensors in wire order, each rank's decoded copies of its shard, their sum, the decoded mean
(3x the gradients' bytes for FP8, 5x for NVFP4: BENCHMARKS.md section 21), 7-12 GB at
llama-600m. Cut into buckets of at most `bucket_mb` MiB, those temporaries exist for one bucket
at a time, and each bucket's mean is written back into the gradients before the next one
starts (ProductionCommunicator.step_in_buckets; train.reduce_gradients for fp32 and bf16).

How the gradients are cut - from their shapes alone, in their fixed order, so alike on every
rank and in the simulator (every rank runs the same buckets' collectives in the same order):
  * tensors join the current bucket in order while it has room for them (as DDP fills its
    buckets); one that does not fit starts the next;
  * a tensor larger than a bucket is cut into segments of whole scale groups (`quantum`
    elements: the FP8 block, NVFP4's 16, whole rows with row scaling), each a bucket, the last
    one sharing its bucket with the tensors after it. A group is never cut, so every value is
    quantized with the same neighbours as in the whole tensor: with FP8's own scale per group
    the bytes and the means are those of one bucket, bit for bit (tests/test_bucket.py). (NVFP4
    also has one fp32 scale per piece - a rank's share of a tensor in a bucket - so its pieces,
    and with them its numerics, follow the buckets: the simulator, cutting alike, matches the
    ranks bit for bit at every bucket size.)
  * a tensor that cannot be cut without changing its scales (one scale per tensor, as the
    fp8-sum collective sends, or `block="tensor"`) is a bucket of its own when it is larger.

The default, 25 MiB, is DDP's (bucket_cap_mb): the temporaries stay at a few buckets' worth
(~0.1-0.2 GB whatever the model's size), while each bucket's all_to_all and all_gather still
move megabytes per rank (6.5 MB of FP8 for a 25 MiB fp32 bucket), where NCCL is bandwidth-bound
rather than latency-bound; at llama-600m that is ~100 buckets, ~200 collectives a step.
`bucket_mb=0` averages the model as one bucket (the path before buckets; 4-6x its gradients).
"""
import math
from collections import namedtuple

import compress

DEFAULT_BUCKET_MB = 25.0        # as DDP's bucket_cap_mb

# A range of one tensor's flat elements in a bucket: index, the tensor's place in the model's
# list; [start, end) of its numel; the shape it is quantized as: the tensor's own when it is
# whole; (end - start,), or with row scaling (rows, row length), for a segment.
Segment = namedtuple("Segment", "index start end shape numel")


def capacity(bucket_mb):
    """Elements of fp32 in a bucket of bucket_mb MiB (None: bucket_mb=0, no limit)."""
    if bucket_mb < 0:
        raise ValueError(f"bucket_mb must be >= 0 (MiB of fp32 gradients per bucket, e.g. "
                         f"{DEFAULT_BUCKET_MB:g}; 0: the whole model as one bucket), got {bucket_mb}")
    return max(1, int(bucket_mb * 2 ** 20) // 4) if bucket_mb else None


def scale_quantum(shape, fmt, block, stage2_fmt=""):
    """The elements a cut through a tensor of `shape` must be a multiple of so that it cuts no
    scale group of the two-stage collective (the groups its layouts cut shards at: the FP8
    format's `block`, NVFP4's 16, a row with row scaling); None: no cut keeps them (one scale
    per tensor, or per share of a tensor: `block="tensor"`, row scaling of a vector)."""
    cut_fmt = stage2_fmt if fmt == "nvfp4" and stage2_fmt else fmt    # (two_format_layout's)
    if cut_fmt == "nvfp4":
        return compress.NVFP4_BLOCK
    if isinstance(block, int):
        return block
    if block == "row" and len(shape) >= 2:
        return math.prod(shape[1:])
    return None


def plan(shapes, bucket_mb, quantum, rows=False):
    """The buckets of tensors of `shapes` (in this order): a list of buckets, each a list of
    Segments. quantum(shape) -> the elements a cut through that tensor must be a multiple of
    (None: never cut); rows: the quantum is a row (row scaling), and a segment keeps the shape of
    its rows. bucket_mb=0: every tensor whole, in one bucket."""
    room_for = capacity(bucket_mb)
    shapes = [tuple(s) for s in shapes]
    if room_for is None:
        return [[Segment(t, 0, math.prod(s), s, math.prod(s)) for t, s in enumerate(shapes)]
                ] if shapes else []
    buckets, current, room = [], [], room_for

    def add(segment):
        nonlocal current, room
        n = segment.end - segment.start
        if current and n > room:        # full: the next bucket
            buckets.append(current)
            current, room = [], room_for
        current.append(segment)
        room -= n

    for t, shape in enumerate(shapes):
        numel, q = math.prod(shape), quantum(shape)
        if numel <= room_for or q is None:
            add(Segment(t, 0, numel, shape, numel))
            continue
        # larger than a bucket: segments of whole scale groups, a bucket each (at least a group)
        length = max(q, room_for // q * q)
        for start in range(0, numel, length):
            end = min(numel, start + length)
            if current:                 # each segment opens its bucket
                buckets.append(current)
                current, room = [], room_for
            cut = ((end - start) // q, q) if rows else (end - start,)
            add(Segment(t, start, end, cut, numel))
    if current:
        buckets.append(current)
    return buckets


def is_whole(segment):
    """Does the segment hold its whole tensor (in the tensor's own shape)?"""
    return segment.start == 0 and segment.end == segment.numel


def codec_plan(shapes, bucket_mb, fmt, block, stage2_fmt=""):
    """plan() for the two-stage collective's codec: cuts at whole scale groups (scale_quantum);
    with row scaling a segment is whole rows, in the shape of its rows."""
    cut_fmt = stage2_fmt if fmt == "nvfp4" and stage2_fmt else fmt
    return plan(shapes, bucket_mb, lambda shape: scale_quantum(shape, fmt, block, stage2_fmt),
                rows=block == "row" and cut_fmt != "nvfp4")
