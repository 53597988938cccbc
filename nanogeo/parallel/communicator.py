"""
The communicator as training runs it: compress.Communicator (the method: coordinates, the
two-stage collective, refresh, the gain check, the decision) with what production adds around
it - a subclass that overrides some of compress.py's methods (the list, with what this file does
in each: docs/method.md, "Two implementations"), held to compress.py's bits by
tests/test_reference.py:

  * memory: the tensors averaged a bucket at a time (bucket_mb, nanogeo.wire.buckets; each
    bucket is compress.py's collective, exchange() in collective()'s place), each mean written
    into its gradient as it is decoded, the gain check measured then;
  * the wire: the packed stages, NVFP4, stochastic rounding's streams, a stage 2 in a format of
    its own (--stage2_fmt) and each rank's kept round trip (nanogeo.wire.collective),
    and the paper's collective, one FP8 all_reduce SUM with per-tensor scales
    (nanogeo.wire.fp8sum), with its fragility profile and the published top-k selection;
  * error feedback: each rank's own stage-1 rounding error, kept in original coordinates and
    added back at the next step (the paper's missing ablation is Euclidean + error feedback);
  * across ranks: the K-FAC moments averaged over the ranks (nanogeo.parallel.hooks), one
    finiteness decision for all of them before the geometry moves, the check that every rank
    holds the same geometry after a refresh (nanogeo.geometry.agreement), FSDP's row blocks;
  * the layers' state for the rank checks and checkpoints, the Hadamard control and the dense
    ablations (nanogeo.geometry.layers, .hadamard): whitening factors other than the low-rank
    one and their EMA, exact or random subspace bases, the stale residual of the published
    defect (c);
  * the subspace rotation's matrices of one shape encoded, decoded, refreshed and judged
    together, compress.py's functions mapped over the stack (nanogeo.geometry.batched): a GPU
    launches each op once per shape group, and waits on the host once per group and refresh
    (the SVD), not once per matrix;
  * a benchmark's stage timer, the layer table's reasons, checkpoints.

Options are compress.GeoOptions plus the fields of this module's Options.
"""
import copy
import math
import zlib
from dataclasses import dataclass

import numpy
import torch
import torch.distributed as dist

import compress
from nanogeo import RenamedAttribute
from nanogeo.geometry import agreement, batched, hadamard, layers, update_error
from nanogeo.parallel import hooks
from nanogeo.parallel.precision import ieee
from nanogeo.wire import buckets, collective, fp8sum, nvfp4, packing

# options renamed to train.py's flag names (one vocabulary), and the whitening's old name
RENAMED = {"refresh": "geo_refresh", "warmup": "geo_warmup", "judge": "geo_judge",
           "enter_gain": "geo_enter_gain", "exit_gain": "geo_exit_gain",
           "factor": "whiten_factor", "stochastic": "stochastic_round"}
OLD_GEOMETRY = {"whiten": "geofp8"}
COLLECTIVES = compress.COLLECTIVES
SUM_ORDERS = ("ring", "tree")      # fp8-sum: the order NCCL adds in (nanogeo/wire/fp8sum.py)
SELECTIONS = compress.SELECTIONS + ("fragile",)
GEOMETRIES = compress.GEOMETRIES + ("hadamard",)
FEEDBACK_STAGES = compress.FEEDBACK_STAGES
SUBSPACE_SIDES = ("both", "left", "right", "auto")
WHITEN_SIDES = ("input", "output", "both")


@dataclass
class Options(compress.GeoOptions):
    sum_order: str = "ring"         # fp8-sum: the order NCCL adds in ("ring" or "tree")
    scale_sync_every: int = 1       # fp8-sum: >1 reproduces the published local-scale defect
    top_k: int = 0                  # select="fragile": the top_k matrices by fraction of saturated
                                    # FP8 sums over the warmup steps (needs collective="fp8-sum")
    seed: int = 0                   # stochastic rounding's and the Hadamard control's draws
    nvfp4_scale: str = "6"          # NVFP4's block scales: each block's max at 6, or "4over6":
                                    # at 6 or 4, whichever errs less (Four Over Six)
    stochastic_round: bool = False  # stochastic rounding (two-stage collective only)
    stochastic_stages: str = "both" # ... in both stages, or only "1" (each rank's send) or "2"
                                    # (the re-quantized averaged shard)
    feedback_geo_only: bool = False # stage 1 only on the geometry-aware matrices (as published)
    # the Hadamard control (geometry="hadamard", nanogeo/geometry/hadamard.py)
    hadamard_block: int = 128       # entries per Walsh-Hadamard block, a power of two
    hadamard_sides: str = "right"   # "right": along each row (row-local), "both": columns too
    sides: str = "auto"             # subspace: both | left (output side) | right (input side) |
                                    # auto (both or right, the better measured; right keeps every
                                    # row's scale)
    # ablations (nanogeo/geometry/layers.py)
    whiten_sides: str = "input"     # geofp8: input (published) | output | both
    whiten_factor: str = "lowrank"  # lowrank | lowrank-dense | full | diag | block
    whiten_block: int = 64          # block size of whiten_factor="block"
    whiten_solver: str = "auto"     # the low-rank factor's top-r eigenpairs: "subspace" iteration,
                                    # warm-started (nanogeo/geometry/eigensolver.py), or "eigh"
                                    # (compress.py's full float64 eigendecomposition); "auto":
                                    # subspace where the gain check measures every factor before
                                    # use (geo_layers=gain), eigh where layers are used unmeasured
    factor_decay: float = 0.0       # EMA of the triangular factor itself (published: 0.95)
    full: bool = False              # exact dense eigenbases (reference / ablation)
    decay: float = 0.0              # subspace: EMA of the covariances (0: the latest mean only)
    basis: str = "householder"      # "householder" or "random" (dense random rotation)
    stale_residual: bool = False    # keep the residual in the old coordinates (defect c)
    # memory (nanogeo/wire/buckets.py)
    bucket_mb: float = buckets.DEFAULT_BUCKET_MB    # average a bucket of at most this many MiB
                                    # of fp32 gradients at a time (0: the whole list as one)

    def choices(self):
        return {**super().choices(), "geometry": GEOMETRIES,
                "select": SELECTIONS, "collective": COLLECTIVES, "sum_order": SUM_ORDERS,
                "sides": SUBSPACE_SIDES, "whiten_sides": WHITEN_SIDES,
                "whiten_factor": layers.WHITEN_FACTORS, "whiten_solver": layers.WHITEN_SOLVERS,
                "basis": ("householder", "random"),
                "stage2_fmt": ("", *compress.FORMATS), "nvfp4_scale": nvfp4.NVFP4_SCALES,
                "stochastic_stages": tuple(collective.ROUNDING_STAGES),
                "feedback_stages": FEEDBACK_STAGES,
                "hadamard_sides": hadamard.HADAMARD_SIDES}

    def __post_init__(self):
        super().__post_init__()
        compress.check_codec(self.fmt, self.block)
        if self.hadamard_block < 2 or self.hadamard_block & (self.hadamard_block - 1):
            raise ValueError(f"hadamard_block must be a power of two >= 2 (e.g. 128), got "
                             f"{self.hadamard_block}")
        buckets.capacity(self.bucket_mb)        # (its check: bucket_mb >= 0)
        if self.scale_sync_every < 1:
            raise ValueError("scale_sync_every must be >= 1")
        fp8 = self.fmt in compress.FP8_FORMATS
        if self.collective == "fp8-sum" and (not fp8 or self.stochastic_round):
            raise ValueError("the fp8-sum collective sums e4m3/e5m2 codes with nearest rounding; "
                             f"use collective='two-stage' for {self.fmt} or stochastic rounding")
        if self.stochastic_round and not (fp8 or self.fmt == "nvfp4"):
            raise ValueError(f"stochastic_round rounds e4m3, e5m2 and nvfp4 codes, not "
                             f"{self.fmt}: drop stochastic_round (--stochastic_round)")
        if self.feedback_stages != "1" and not (self.error_feedback
                                                and self.collective == "two-stage"):
            raise ValueError("feedback_stages chooses the stages of the two-stage collective that "
                             "error_feedback keeps residuals for: turn error_feedback on "
                             "(--error_feedback), on collective='two-stage'")
        if self.stochastic_stages != "both" and not self.stochastic_round:
            raise ValueError("stochastic_stages chooses the stages that stochastic_round rounds "
                             "stochastically: turn stochastic_round on too (--stochastic_round)")
        self.check_stage2_fmt()
        self.check_nvfp4_scale()
        if self.full and self.basis != "householder":
            raise ValueError("full=True (exact bases) and basis='random' are two different "
                             "ablations; choose one")
        if self.sides == "auto" and self.dense_bases:
            self.sides = "both"     # the choice is between Householder rotations; dense: both
        if self.collective == "fp8-sum":
            self.block = "tensor"   # its one scale per tensor; the gain check measures that codec
        if self.select == "fragile" and (self.collective != "fp8-sum" or self.top_k < 1
                                         or self.geo_warmup < 1):
            raise ValueError("select='fragile' profiles saturated FP8 sums during the warmup: it "
                             "needs collective='fp8-sum', geo_warmup >= 1 and top_k >= 1")

    def check_stage2_fmt(self):
        """A stage-2 format of its own: on the two-stage collective, rounded to nearest, without
        stage 2's error feedback, after NVFP4 in integer blocks (the same format: ""). The gain
        check still measures `fmt`'s round trip only: stage 1's codec."""
        if self.stage2_fmt == self.fmt:
            self.stage2_fmt = ""
        if not self.stage2_fmt:
            return
        if self.collective != "two-stage":
            raise ValueError("stage2_fmt is the format of the two-stage collective's all-gather; "
                             "the fp8-sum collective has none: drop stage2_fmt (--stage2_fmt)")
        if self.stochastic_round and self.stochastic_stages != "1":
            raise ValueError("stage2_fmt: a stage 2 in its own format rounds to nearest; round "
                             "stage 1 only (stochastic_stages='1') or drop stage2_fmt")
        if self.error_feedback and self.feedback_stages != "1":
            raise ValueError("stage2_fmt: stage 2's error feedback is not supported in a format "
                             "of its own; use feedback_stages='1' or drop stage2_fmt")
        compress.check_codec(self.stage2_fmt, self.block)
        if self.fmt == "nvfp4" and not isinstance(self.block, int):
            raise ValueError(f"stage2_fmt={self.stage2_fmt!r} after nvfp4 scales stage 2 in "
                             f"groups of `block` elements: use an integer block (e.g. 128), not "
                             f"{self.block!r}")

    def check_nvfp4_scale(self):
        """Four Over Six scales NVFP4 blocks (a stage in nvfp4), rounded to nearest: its choice
        compares the two encodings' errors, which a stochastic draw would not reproduce."""
        if self.nvfp4_scale == "6":
            return
        if "nvfp4" not in (self.fmt, self.stage2_fmt):
            raise ValueError(f"nvfp4_scale={self.nvfp4_scale!r} chooses NVFP4's block scales: "
                             "send a stage in nvfp4 (--fmt=nvfp4) or drop nvfp4_scale")
        if self.stochastic_round:
            raise ValueError(f"nvfp4_scale={self.nvfp4_scale!r} rounds to nearest: drop "
                             "stochastic_round (--stochastic_round) or nvfp4_scale")

    @classmethod
    def of(cls, **options):
        """Options(**options), with a one-line error that names the new name of a renamed one."""
        old = sorted(set(options) & set(RENAMED))
        if old:
            raise ValueError(f"option {old[0]!r} is now {RENAMED[old[0]]!r} (the name of train.py's "
                             f"flag): pass {RENAMED[old[0]]}=...")
        if options.get("geometry") in OLD_GEOMETRY:
            raise ValueError(f"geometry={options['geometry']!r} is now "
                             f"{OLD_GEOMETRY[options['geometry']]!r}")
        return cls(**options)

    @property
    def dense_bases(self):
        """The subspace rotation with dense bases (ablations: full=True or basis="random")."""
        return self.full or self.basis != "householder"


def same_coordinates(before, after):
    """Are two coordinates_in_use() the same: every geometry made of the same tensor objects, on
    the same sides?"""
    return all((a is None) == (b is None) and (a is None or (
        a[1] == b[1] and len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0]))))
        for a, b in zip(before, after))


class NonFiniteStep(Exception):
    """A geometry step's means or moments are not finite on some rank (host_read)."""


class RepairedUnmeasured(Exception):
    """The agreement check repaired proposals that a step writing its means in place measured
    before the repair: they stay proposals, measured on the next step's gradients (a refresh due
    on that step waits for the next refresh step; every rank takes this path together)."""


class InFlight:
    """One tensor between its first bucket and its last (ProductionCommunicator.step_in_buckets):
    its coordinates on each worker ({worker: tensor}) and what the exchange returned of it.
    Whole in one bucket, the bucket's mean and round trips themselves; cut into segments,
    gathered segment by segment into `target` (its mean, in coordinates), `lost` (each worker's
    loss to the codec: error feedback) and `local` (each worker's round trip: --log_stages)."""

    def __init__(self, coords, target=None, lost=None, local=None):
        self.coords, self.lost, self.local = coords, lost, local
        self.whole, self.mean = target is None, target

    def piece(self, worker, segment):
        """What `worker` sends of it in the segment's bucket."""
        c = self.coords[worker]
        return c if self.whole else c.view(-1)[segment.start: segment.end].view(segment.shape)

    def land(self, segment, mean, local):
        """The segment's mean (in coordinates) and each worker's round trip of it (None: not
        kept), back from the exchange."""
        if self.whole:
            self.mean, self.local = mean, None if local is None else dict(zip(self.coords, local))
            return
        span = slice(segment.start, segment.end)
        if local is None and self.lost is not None:
            raise RuntimeError("error feedback needs each worker's round trip of a cut tensor; "
                               "the exchange returned none (keep_local)")
        for w, back in zip(self.coords, local or []):
            if self.lost is not None:
                self.lost[w].view(-1)[span] = self.coords[w].view(-1)[span] - back.reshape(-1)
            if self.local is not None:
                self.local[w].view(-1)[span] = back.reshape(-1)
        self.mean.view(-1)[span] = mean.reshape(-1)     # last: it may be the coordinates

    def lost_to_codec(self):
        """{worker: what the codec lost of it, in coordinates} (error feedback)."""
        if not self.whole:
            return self.lost
        return {w: c - back for (w, c), back in zip(self.coords.items(), self.local.values())}


class BucketedStep:
    """What one step of ProductionCommunicator.step_in_buckets carries from bucket to bucket."""

    def __init__(self, as_sent, across_ranks, grads, judged, count):
        self.as_sent = as_sent              # {worker: its tensors as sent (outgoing), each the raw
                                            # gradient until its first bucket (take_off)}
        self.across_ranks = across_ranks
        self.grads = grads                  # in place: the gradients the means go into (else None)
        self.judged = judged                # {name: layer} the gain check measures as they arrive
        self.means = [None] * count         # each tensor's mean, once decoded
        self.nbytes = 0                     # bytes sent
        self.lost = {w: {} for w in as_sent}    # error feedback: {worker: {name: codec's loss}}
        self.stage1 = [None] * count        # --log_stages: the mean of the round trips


class ProductionCommunicator(compress.Communicator):
    """compress.Communicator with the production forms (module docstring). train.py, the DDP
    hook, FSDP2 and the tools use this one."""
    LAYERS = layers.LAYERS      # compress.py's layers with their state, and the Hadamard control
    # the names before compress.py's one-name-per-thing pass (906d8c0), for one release (then
    # step_in_buckets, below, takes compress.Communicator.step's name)
    step = RenamedAttribute("steps_taken")
    chosen = RenamedAttribute("listed")
    kind = RenamedAttribute("layer_class")
    uses_moments = RenamedAttribute("from_moments")
    is_geo = RenamedAttribute("sent_in_geometry")
    wants_moments = RenamedAttribute("moments_due")

    def __init__(self, named_shapes, options=None, group=None, linear=None,
                 timer=collective.NO_TIMER):
        super().__init__(named_shapes, options or Options(), group, linear)
        self.timer = timer          # a benchmark's stage timer: where the time goes
        self.reasons = {n: compress.why_euclidean(n, self.shapes[n], self.opts, linear)
                        for n in self.names if n not in self.layers}    # why it stays Euclidean
        self.residuals = {}     # worker index -> {name: fp32 residual}, with error feedback
        self.rows = {}          # FSDP: name -> this rank's RowBlocks of its gradient
        self.rounding_stream = zlib.crc32("\0".join(self.names).encode())  # its own random draws
        self.skipped = 0        # geometry updates skipped for a non-finite mean
        self.saturation = None  # fp8-sum: running sum of each tensor's saturated fraction
        self.saturation_steps = 0
        self.proposed = False   # the step in progress proposed new geometry (rank agreement)
        self.bad = None         # this geometry step's finiteness flag, until read (host_read)
        self.pending = None     # (flags, layers, step) of the last agreement check, until read
        self.repaired = False   # host_read repaired the geometry (rank 0's broadcast)
        self.decompose = False  # keep this step's stage-1 mean (nanogeo.run.summary.stage_errors)
        self.stage1 = None      # ... each worker's own round trip, averaged, original coordinates
        self.stacks = batched.StackedBases()    # the rotations in use, stacked by shape
        self.plan = None        # the buckets (buckets()), made at the first step
        self.taken = None       # an in-place step's gain-check measurements: {name: (layer, errors)}

    def coords(self, name):
        """"geo" or "euclidean": the coordinates `name` is sent in now (logs and tables)."""
        return "geo" if self.sent_in_geometry(name) else "euclidean"

    def whitened_sides(self):
        o = self.opts
        return ("input", "output") if o.whiten_sides == "both" else (o.whiten_sides,)

    def moment_layers(self):
        """Names of the weights whose layers' K-FAC moments the whitening needs."""
        return list(self.layers) if self.from_moments else []

    @ieee       # the coordinates in IEEE fp32 even where the model's matmuls use TF32 (precision.py)
    def to_coords(self, name, g):
        with self.timer.stage("rotate"):
            return super().to_coords(name, g)

    @ieee
    def from_coords(self, name, c):
        with self.timer.stage("rotate"):
            return super().from_coords(name, c)

    # -- the matrices of one shape together (nanogeo.geometry.batched) -----------------------------

    def all_to_coords(self, names, tensors):
        """to_coords of each, the rotated matrices of one shape and sides encoded together."""
        return self.rotate_all(names, tensors, inverse=False)

    def all_from_coords(self, names, tensors):
        """from_coords of each, likewise."""
        return self.rotate_all(names, tensors, inverse=True)

    @ieee
    def rotate_all(self, names, tensors, inverse):
        keys = {i: batched.rotation_key(self.layers[n]) if self.sent_in_geometry(n)
                and batched.stackable(self.layers[n]) else None for i, n in enumerate(names)}
        out = list(tensors)
        for key, where in batched.groups(keys).items():
            if key is None:                     # Euclidean, or a layer that is not stacked
                one = self.from_coords if inverse else self.to_coords
                for i in where:
                    out[i] = one(names[i], tensors[i])
                continue
            for run in batched.runs(where, tensors[where[0]].numel(), self.stack_limit()):
                group = [self.layers[names[i]] for i in run]
                with self.timer.stage("rotate"):
                    bases = self.stacks.of((key, tuple(names[i] for i in run)),
                                           [layer.transform for layer in group])
                    X = torch.stack([tensors[i] for i in run])
                    rotated = batched.rotate_stack(group[0], X, bases, inverse).unbind()
                for i, x in zip(run, rotated):
                    out[i] = x
        return out

    def stack_limit(self):
        """The most elements the matrices stacked together may hold (a bucket's: a stack is a
        copy; None with one bucket, bucket_mb=0)."""
        return buckets.capacity(self.opts.bucket_mb)

    # -- the K-FAC moments, averaged over the ranks ---------------------------------------------

    def average_moments(self, moments):
        """Token-weighted, over a fixed list of (side, layer) slots, in one all-reduce (a rank
        that collected nothing for a layer adds zero tokens)."""
        return hooks.average_moments(moments, self.moment_shapes(), self.whitened_sides(),
                                     self.sum_over_ranks, hooks.moments_device(moments))

    def reduce_workers(self, worker_grads, moments=None):
        """compress.Communicator.reduce_workers; `moments` may also be a list, each simulated
        rank's moments, averaged with the same arithmetic as over real ranks."""
        if isinstance(moments, list):
            moments = hooks.average_worker_moments(moments, self.moment_shapes(),
                                                   self.whitened_sides(), worker_grads[0][0].device)
        return self.step_in_buckets(dict(enumerate(worker_grads)), moments, across_ranks=False)

    def moment_shapes(self):
        return {n: self.shapes[n] for n in self.moment_layers()}

    def sum_over_ranks(self, t):
        dist.all_reduce(t, group=self.group)
        return t

    # -- the wire, a bucket at a time, and error feedback -------------------------------------------

    def buckets(self):
        """The bucket plan (nanogeo/wire/buckets.py): the tensors in buckets of at most bucket_mb
        MiB, a tensor larger than a bucket cut at whole scale groups; made once."""
        if self.plan is None:
            o = self.opts
            self.plan = buckets.codec_plan([self.shapes[n] for n in self.names], o.bucket_mb,
                                           o.fmt, o.block, o.stage2_fmt)
        return self.plan

    def rounding_seed(self, bucket=0):
        """This step's stochastic-rounding seed, different for every tensor list (every DDP
        bucket, every FSDP module) and every bucket of one: buckets of the same layout must not
        round alike."""
        seed = (self.opts.seed * 7919 + self.steps_taken) * 2_147_483_659 + self.rounding_stream
        return seed + bucket * 0x9E3779B97F4A7C15       # (bucket 0: the seed of one bucket)

    def has_feedback(self, name):
        """Does stage 1's error feedback keep a residual for `name`?"""
        o = self.opts
        return (o.error_feedback and o.feedback_stages != "2"
                and (not o.feedback_geo_only or self.sent_in_geometry(name)))

    def keeps_stage1(self):
        """Does error feedback keep stage 1's residuals (feedback_stages "1" or "both")?"""
        return self.opts.error_feedback and self.opts.feedback_stages != "2"

    def stage2_feedback(self, bucket=0):
        """Stage 2's error feedback for one bucket (packing.ShardFeedback), or None."""
        on = self.opts.error_feedback and self.opts.feedback_stages != "1"
        return packing.ShardFeedback(self.residuals, bucket) if on else None

    def coordinates_in_use(self):
        """What the coordinates every matrix is sent in now are made of (the tensors and the
        rotated sides of each geometry in use; the objects, not their ids): stage 2's residual,
        made in them, is dropped when they change (same_coordinates)."""
        return [(self.layers[n].tensors(), self.layers[n].sides)
                if self.sent_in_geometry(n) else None for n in self.layers]

    def outgoing(self, worker, grads):
        """Error feedback: each gradient plus the rank's residual of the last step, in original
        coordinates (the stale-residual ablation adds it in coordinates: take_off())."""
        return self.outgoing_of(worker, range(len(self.names)), grads)

    def outgoing_of(self, worker, indices, grads):
        """outgoing() of the tensors at `indices` of the list `grads` only."""
        fp32 = [grads[i].float() for i in indices]
        residual = {} if self.opts.stale_residual else self.residuals.get(worker, {})
        names = [self.names[i] for i in indices]
        return [g + residual[n] if self.has_feedback(n) and n in residual else g
                for n, g in zip(names, fp32)]

    def reduce(self, grads, moments=None):
        """compress.Communicator.reduce, each tensor's mean written into its gradient as soon as
        its last bucket is decoded (step_in_buckets, in_place)."""
        across = dist.is_initialized()
        rank = dist.get_rank(self.group) if across else 0
        if moments is not None and across:
            moments = self.average_moments(moments)
        return self.step_in_buckets({rank: grads}, moments, across, in_place=True)[1]

    def step_in_buckets(self, worker_grads, moments, across_ranks, in_place=False):
        """compress.Communicator.step a bucket at a time (buckets()): each bucket's part
        of the tensors into coordinates, through the collective (exchange) and back before the
        next bucket's, then the geometry. A step holds one bucket's temporaries, not the model's.

        in_place (reduce(): one worker, the caller's gradients): each tensor's mean is written
        into its gradient as soon as it is decoded, and where the coming geometry step judges a
        layer (judged_next) its codec errors are measured then (layer_errors), while the
        gradient as sent is still there: the gain check needs no copy of the gradients."""
        # each tensor as sent (outgoing: fp32, plus error feedback's residual) is made at its
        # first bucket (take_off), so a step holds a bucket's worth of them, not the model's
        as_sent = {w: list(grads) for w, grads in worker_grads.items()}
        step = BucketedStep(as_sent, across_ranks,
                            [*worker_grads.values()][0] if in_place else None,
                            self.judged_next(moments) if in_place else {}, len(self.names))
        self.taken = {} if in_place else None
        flights, finite, saturated = {}, [], []
        try:
            for k, bucket in enumerate(self.buckets()):
                flights.update(self.take_off([s for s in bucket if s.start == 0], step))
                coords = {w: [flights[s.tensor].piece(w, s) for s in bucket] for w in as_sent}
                mean_pieces, nbytes, local, fractions = self.exchange(coords, across_ranks, k)
                step.nbytes += nbytes
                saturated.append(fractions)
                if self.keeps_stage1():
                    finite.append(agreement.all_finite(mean_pieces))
                for j, s in enumerate(bucket):
                    flights[s.tensor].land(s, mean_pieces[j],
                                           None if local is None else [rt[j] for rt in local])
                self.arrive({s.tensor: flights.pop(s.tensor) for s in bucket if s.end == s.numel},
                            step)
                del coords, mean_pieces, local      # freed before the next bucket's exchange
            if self.keeps_stage1() and finite:
                self.keep_residuals(step.lost, torch.stack(finite).all())
            if self.decompose:      # the mean an exact second stage would deliver (this rank's)
                self.stage1 = step.stage1
            fractions = [f for f in saturated if f is not None]     # (fp8-sum's profile)
            if fractions:
                self.count_saturation(torch.cat(fractions))
            self.advance(dict(zip(self.names, step.means)), list(as_sent.values()), moments,
                         across_ranks)
        finally:
            self.taken = None
        return step.means, step.nbytes

    def take_off(self, segments, step):
        """The tensors whose first bucket this is ({index: InFlight}): into coordinates on every
        worker, the matrices of one shape rotated together (all_to_coords)."""
        indices = [s.tensor for s in segments]
        for w, tensors in step.as_sent.items():     # each one as sent, made now
            for i, g in zip(indices, self.outgoing_of(w, indices, tensors)):
                tensors[i] = g
        names = [self.names[i] for i in indices]
        coords = {w: self.all_to_coords(names, [grads[i] for i in indices])
                  for w, grads in step.as_sent.items()}
        return {s.tensor: self.in_flight(s, {w: cs[j] for w, cs in coords.items()}, step)
                for j, s in enumerate(segments)}

    def in_flight(self, segment, coords, step):
        """A tensor at its first bucket, in coordinates on every worker ({worker: tensor}; the
        stale-residual ablation, defect c, adds the residual there) - contiguous when it is
        cut, with the buffers its mean (and error feedback's loss, --log_stages' round trips)
        gather in. Its mean gathers in its coordinates themselves unless they are the gradient
        as sent and that is read after the exchange (by the simulator's gain check, or this
        step's)."""
        i, n = segment.tensor, self.names[segment.tensor]
        if self.opts.stale_residual and self.has_feedback(n):
            coords = {w: c + self.residuals[w][n] if n in self.residuals.get(w, {}) else c
                      for w, c in coords.items()}
        if buckets.is_whole(segment):
            return InFlight(coords)
        coords = {w: c.contiguous() for w, c in coords.items()}
        w, first = next(iter(coords.items()))
        read_later = step.grads is None or n in step.judged
        aliased = first.untyped_storage().data_ptr() == \
            step.as_sent[w][i].untyped_storage().data_ptr()     # (a view of it counts too)
        target = torch.empty_like(first) if read_later and aliased else first
        lost = ({w: torch.empty_like(c) for w, c in coords.items()}
                if self.keeps_stage1() and self.has_feedback(n) else None)
        local = {w: torch.empty_like(c) for w, c in coords.items()} if self.decompose else None
        return InFlight(coords, target, lost, local)

    def arrive(self, flights, step):
        """The tensors after their last bucket ({index: InFlight}), the matrices of one shape
        rotated back together (all_from_coords): error feedback's loss and --log_stages' stage-1
        mean in original coordinates, and each mean decoded (step.means) - in place, measured
        for the gain check where it is judged, then written into the gradient."""
        names = {i: self.names[i] for i in flights}
        fed = [i for i in flights if self.keeps_stage1() and self.has_feedback(names[i])]
        lost = {i: flights[i].lost_to_codec() for i in fed}
        for w in step.as_sent:
            back = [lost[i][w] for i in fed]
            if not self.opts.stale_residual:
                back = self.all_from_coords([names[i] for i in fed], back)
            step.lost[w].update((names[i], d) for i, d in zip(fed, back))
        if self.decompose:
            local = [torch.stack(list(flights[i].local.values())).mean(0) for i in flights]
            for i, mean in zip(flights, self.all_from_coords(list(names.values()), local)):
                step.stage1[i] = mean
        means = dict(zip(flights, self.all_from_coords(list(names.values()),
                                                      [f.mean for f in flights.values()])))
        if step.grads is None:
            for i, mean in means.items():
                step.means[i] = mean
            return
        [as_sent] = step.as_sent.values()
        judged = {names[i]: step.judged[names[i]] for i in flights if names[i] in step.judged}
        if judged:
            world = dist.get_world_size(self.group) if step.across_ranks else 1
            index = {n: i for i, n in names.items()}
            self.taken.update(self.measure_now(
                judged, {n: means[index[n]] for n in judged},
                {n: [as_sent[index[n]]] for n in judged}, world))
        for i, mean in means.items():
            if mean is not step.grads[i]:
                step.grads[i].copy_(mean)
            as_sent[i] = None       # (read no more: the gain check's measurement is taken)
            # the geometry reads the fp32 mean: the gradient itself where it is fp32 (bf16 or
            # fp16 gradients of a DDP model hold it rounded, and a refresh's QR takes no bf16)
            step.means[i] = step.grads[i] if step.grads[i].dtype == mean.dtype else mean

    def exchange(self, coords, across_ranks, bucket):
        """One bucket through the wire as training runs it - the paper's FP8-sum collective, or
        compress.py's two-stage one on nanogeo.wire's layout (packed, NVFP4, stochastic rounding,
        stage 2's error feedback, a benchmark's timer), over the group or simulated ({worker:
        its tensors of the bucket in coordinates}). Returns (means, bytes, [each worker's own
        round trip] for error feedback and --log_stages or None, the fp8-sum collective's
        saturated fractions or None)."""
        opts = self.opts
        workers, keep_local = list(coords.values()), self.keeps_stage1() or self.decompose
        if opts.collective == "fp8-sum":
            return self.fp8_sum(workers, across_ranks)
        world = dist.get_world_size(self.group) if across_ranks else len(workers)
        layout = collective.bucket_layout(
            workers[0], opts.fmt, opts.block, world, opts.stochastic_round,
            self.rounding_seed(bucket), opts.stochastic_stages, self.stage2_feedback(bucket),
            self.timer, opts.stage2_fmt, opts.nvfp4_scale)
        if keep_local:
            layout = collective.KeptSends(layout, workers[0][0].device)
        if across_ranks:
            means, nbytes = compress.all_reduce_mean(workers[0], layout, self.group)
        else:
            means, nbytes = compress.simulate_mean(workers, layout)
        return means, nbytes, layout.local() if keep_local else None, None

    def fp8_sum(self, workers, across_ranks):
        """The paper's collective: (means, bytes, [each worker's own round trip], saturated)."""
        opts = self.opts
        if across_ranks:
            means, nbytes, local, saturated = fp8sum.all_reduce_fp8_sum(
                workers[0], opts.fmt, self.group, opts.sum_order, self.local_scales(),
                self.profiling())
            return means, nbytes, [local], saturated
        return fp8sum.simulate_fp8_sum(workers, opts.fmt, opts.sum_order, self.local_scales(),
                                       self.profiling())

    def keep_residuals(self, lost, finite):
        """Each worker's loss to the codec ({worker: {name: loss}}, in original coordinates -
        so a refresh of the geometry re-expresses it at the next encode; the published method
        keeps it in the old coordinates: defect c, stale_residual) as its residual. A step
        whose mean is not finite (`finite`: a bool on the device; an fp16 GradScaler overflow,
        the optimizer skips it) keeps the old residual: picked on the device, no host sync."""
        for worker, new in lost.items():
            old = self.residuals.get(worker, {})
            for n, r in new.items():    # into the new loss itself: no third copy at the peak
                torch.where(finite, r, old[n] if n in old else r.new_zeros(()), out=r)
            self.residuals[worker] = dict(new)
            self.residuals[worker].update((key, r) for key, r in old.items()   # stage 2's, kept
                                          if packing.ShardFeedback.owns(key))  # beside

    # -- the gain check, measured as the means arrive (step_in_buckets' in_place) -------------------

    def judged_next(self, moments):
        """{name: layer} the coming advance() measures (compress.Communicator.to_judge, on a step
        whose geometry moves), the proposal where there is one."""
        fresh = moments is not None and self.steps_taken % self.opts.geo_refresh == 0
        if not (self.layers and self.geometry_due(fresh, self.steps_taken + 1)):
            return {}
        return {n: self.proposals.get(n, self.layers[n]) for n in self.to_judge()}

    @ieee       # a measurement of the gain check: IEEE fp32 (precision.py)
    def measure_now(self, layers, means, grads, world):
        """{name: (layer, its errors as layer_errors returns them)} of the judged layers whose
        means arrived ({name: layer}, {name: mean}, {name: [the gradient as sent]}), the
        matrices of one shape measured together where they can be (errors_by_group)."""
        if self.batchable(layers):
            rows = self.errors_by_group(layers, means, grads, world)
            return {n: (layer, list(rows[n].reshape(-1).unbind())) for n, layer in layers.items()}
        return {n: (layer, compress.Communicator.layer_errors(self, n, layer, means[n], grads[n],
                                                              world * len(grads[n])))
                for n, layer in layers.items()}

    def layer_errors(self, name, layer, mean, grads, workers):
        """compress.Communicator.layer_errors; on a step that wrote its means in place, the
        errors step_in_buckets measured as the layer's mean was decoded (the gradient as sent is
        gone by now)."""
        if self.taken is None:
            return super().layer_errors(name, layer, mean, grads, workers)
        measured, errors = self.taken.pop(name, (None, None))
        if measured is not layer:
            raise RuntimeError(f"the gain check measures {name!r}, which step_in_buckets did not "
                               "measure before writing its mean in place (judged_next)")
        return errors

    def local_scales(self):
        return (self.opts.scale_sync_every > 1
                and self.steps_taken % self.opts.scale_sync_every != 0)

    # -- the paper's profiled selection ----------------------------------------------------------

    def profiling(self):
        """Is the fragility profile taken this step? During the warmup for select="fragile",
        always in Euclidean mode (nanogeo.lab.profile)."""
        warmup = self.opts.select == "fragile" and self.steps_taken < self.opts.geo_warmup
        return warmup or self.opts.geometry == "euclidean"

    def count_saturation(self, saturated):
        """Add up the fragility profile (None: not taken). On the device: no host sync."""
        if saturated is not None:
            self.saturation = saturated if self.saturation is None else self.saturation + saturated
            self.saturation_steps += 1

    def fragility(self):
        """{name: mean fraction of saturated FP8 sums} over the steps so far (fp8-sum only)."""
        if self.saturation is None:
            return {}
        scores = (self.saturation / self.saturation_steps).tolist()
        return dict(zip(self.names, scores))

    def select_fragile(self):
        """The published selection: the top_k matrices by mean fraction of saturated FP8 sums
        over the profiled (warmup) steps are the list decide() lets use the geometry."""
        scores = self.fragility()
        ranked = sorted(self.layers, key=lambda n: -scores.get(n, 0.0))
        self.listed = set(ranked[:self.opts.top_k])
        for n in ranked:
            self.layers[n].use_geo = self.decide(n, self.layers[n])

    # -- the geometry: FSDP's rows, finiteness, rank agreement ---------------------------------------

    @ieee       # the gain check's measurements and the new geometry: IEEE fp32 (precision.py)
    def advance(self, means, as_sent, moments=None, across_ranks=False, rows=None):
        """compress.Communicator.step's step 5 (the step counted; the geometry where due), as
        update_geometry below does it; `rows` (FSDP): {name: this rank's RowBlocks}, when
        `means` holds only this rank's rows; then, after the warmup, the fragile selection."""
        if rows:
            self.rows = rows
            for n, layer in [*self.layers.items(), *self.proposals.items()]:
                layer.rows = rows.get(n)
        stage2 = self.opts.error_feedback and self.opts.feedback_stages != "1"
        before = self.coordinates_in_use()
        if self.steps_taken % self.opts.geo_refresh:    # (compress.Communicator.step's step 5)
            moments = None
        self.steps_taken += 1
        if self.layers and self.geometry_due(moments is not None, self.steps_taken):
            self.update_geometry(means, as_sent, moments, across_ranks)
        if not same_coordinates(before, self.coordinates_in_use()):
            self.stacks = batched.StackedBases()        # the old bases' stacks: freed
            for residual in self.residuals.values() if stage2 else ():
                for key in [k for k in residual if packing.ShardFeedback.owns(k)]:
                    del residual[key]               # stage 2's: made in the old coordinates
        if (self.layers and self.opts.select == "fragile"
                and self.steps_taken == self.opts.geo_warmup):
            self.select_fragile()

    def update_geometry(self, means, as_sent, moments, across_ranks):
        """Only from finite means and moments (else counted in `skipped`); after new geometry
        across ranks, check that every rank holds the same.

        One host read per geometry step (host_read): the finiteness flag is read with the
        judge's measurements when there are any (measure), else before the refresh inputs
        are used (refresh_inputs), else at the end; a non-finite step then undoes nothing but the
        proposals taken out for judging. The agreement check of new geometry is launched here
        and read with the next geometry step's flags: the proposals are first used when they
        are judged, on that step, after it (repaired, they are measured again)."""
        self.bad = self.nonfinite(means, moments, across_ranks)
        proposals = dict(self.proposals)
        self.proposed = False
        try:
            with self.timer.stage("geometry"):
                judged = self.to_judge()        # (compress.Communicator.step's step 5)
                if judged:
                    self.judge(judged, means, as_sent, across_ranks)
                self.propose_all(self.refresh_inputs(means, moments))
                if self.bad is not None:        # neither judged nor proposed: read it now
                    self.host_read()
        except NonFiniteStep:
            self.proposals.clear()
            self.proposals.update(proposals)
            self.skipped += 1   # a non-finite mean (or moment) must not reach the geometry
            return
        except RepairedUnmeasured:  # measured again on the next step's gradients
            self.proposals.clear()
            self.proposals.update(proposals)
            return
        if across_ranks and self.proposed:
            device = next(iter(means.values())).device
            newest = [self.proposals.get(n, layer) for n, layer in self.layers.items()]
            self.pending = (agreement.geometry_agreement(newest, self.group, device), newest,
                            self.steps_taken)

    def host_read(self, values=None):
        """The geometry step's one host read: its finiteness flag, the last refresh's agreement
        flags (repaired here on a mismatch) and `values` (a device tensor). Returns values as a
        float64 numpy array; raises NonFiniteStep if the step's means or moments are not
        finite on some rank."""
        parts = [self.bad.reshape(1)]
        pending, self.bad, self.pending = self.pending, None, None
        if pending is not None:
            parts.append(pending[0].double())
        if values is not None:
            parts.append(values.double().reshape(-1))
        read = torch.cat(parts).cpu().numpy()   # the one transfer
        bad, read, self.repaired = read[0] != 0, read[1:], False
        if pending is not None:
            agree, newest, step = pending
            flags, read = read[:agree.numel()], read[agree.numel():]
            self.repaired = agreement.repair_geometry([bool(f) for f in flags], newest, self.group, step,
                                      agree.device)
        if bad:
            raise NonFiniteStep
        return read if values is None else read.reshape(values.shape)

    def measure(self, layers, means, as_sent, across_ranks):
        """compress.Communicator.measure, read with the step's flags (host_read): a numpy array
        (its .tolist() is judge's). Measured again where the agreement check repaired the
        proposals. With sides="auto", each layer is rotated to the better of its two rotations
        (through_codec), and that one's error is returned."""
        errors = self.codec_errors(layers, means, as_sent, across_ranks)
        if self.bad is None:
            read = errors.cpu().numpy()
        else:
            read = self.host_read(errors)
            if self.repaired:   # (rare) measured on proposals that differed across the ranks
                if self.taken is not None:      # the gradients as sent are overwritten by now
                    raise RepairedUnmeasured
                read = self.codec_errors(layers, means, as_sent, across_ranks).cpu().numpy()
        if not self.auto_sides():
            return read
        right = read[:, 2] < read[:, 1]         # the first of equals, as min() picks: both
        for layer, alone in zip(layers.values(), right):
            if layer.sides != ("right" if alone else "both"):
                layer.rotate_sides("right" if alone else "both")
        return numpy.stack([read[:, 0], numpy.where(right, read[:, 2], read[:, 1])], axis=1)

    def codec_errors(self, layers, means, as_sent, across_ranks):
        """compress.Communicator.measure, the matrices of one shape, sides and optimizer view
        measured together (errors_by_group) where every layer can be - on a step that wrote its
        means in place, what step_in_buckets measured as they arrived (layer_errors)."""
        if self.taken is not None or not self.batchable(layers):
            return super().measure(layers, means, as_sent, across_ranks)
        world = dist.get_world_size(self.group) if across_ranks else 1
        index = {n: i for i, n in enumerate(self.names)}
        grads = {n: [worker[index[n]] for worker in as_sent] for n in layers}
        rows = self.errors_by_group(layers, means, grads, world * len(as_sent))
        errors = torch.stack([rows[n] for n in layers]).double().sum(1)   # (layers, K)
        if across_ranks:
            dist.all_reduce(errors, group=self.group)
        return errors

    def batchable(self, layers):
        """Can the gain check measure these layers together (nanogeo.geometry.batched): each a
        stackable rotation, the optimizer watched or judge="l2" (else compress.py warns, matrix
        by matrix), and the codec one call can run on a stack (not Four Over Six's choice)?"""
        watched = self.opts.geo_judge == "l2" or self.views
        four_over_six = self.opts.fmt == "nvfp4" and self.opts.nvfp4_scale == "4over6"
        return bool(watched) and not four_over_six and all(
            batched.stackable(layer) for layer in layers.values())

    def errors_by_group(self, layers, means, grads, workers):
        """{name: (W, K) errors} (batched.codec_errors: per worker, the Euclidean round trip's
        then each rotation's error as the optimizer sees it) of layers ({name: layer}) grouped
        by shape, sides and optimizer view; grads: {name: [each worker's gradient as sent]}."""
        auto = self.auto_sides()
        views = {n: self.views.get(n) if self.opts.geo_judge == "optimizer" else None
                 for n in layers}
        keys = {n: (layer.shape, None if auto else batched.sides_of(layer.transform),
                    batched.view_key(views[n])) for n, layer in layers.items()}
        rows = {}
        for group in batched.groups(keys).values():
            for names in batched.runs(group, means[group[0]].numel(), self.stack_limit()):
                stacked = [torch.stack([grads[n][w].float() for n in names])
                           for w in range(len(grads[names[0]]))]
                errors = batched.codec_errors(
                    [layers[n] for n in names], torch.stack([means[n] for n in names]), stacked,
                    [views[n] for n in names], auto, self.round_trip_stack, workers)
                rows.update(zip(names, errors.unbind()))
        return rows

    def round_trip_stack(self, X):
        """round_trip() of each matrix of X (L, m, n), bit-equal, in one codec call."""
        return batched.round_trip_stack(X, self.opts.fmt, self.opts.block)

    def refresh_inputs(self, means, moments):
        """compress.Communicator.refresh_inputs, after the step's flags are read (host_read)."""
        found = super().refresh_inputs(means, moments)
        if found and self.bad is not None:
            self.host_read()
        return found

    def nonfinite(self, means, moments, across_ranks):
        """(1,) float64 on the device: 1 where this step's means (or moments) are not finite,
        on this rank - or, across_ranks, on any: the ranks decide together through one small
        all-reduce (under FSDP each holds its own rows, and under DDP a rank whose copy went bad
        alone must not skip the geometry steps, and their collectives, that the others run)."""
        tensors = list(means.values())
        for side in ("input", "output"):
            tensors += list((moments or {}).get(side, {}).values())
        bad = (~agreement.all_finite(tensors)).double().reshape(1)
        if across_ranks:
            self.sum_over_ranks(bad)
        return bad

    def propose_all(self, inputs):
        """compress.Communicator.propose_all, the new geometry of the matrices of one shape
        built together (nanogeo.geometry.batched.refresh_group: the rotation's bases, the
        low-rank whitening's factors)."""
        keys = {n: batched.refresh_key(self.layers[n], found) for n, found in inputs.items()}
        refreshed, rotations = {}, []       # rotations: [(proposals, means)], one SVD for all
        for key, group in batched.groups(keys).items():
            if key is None:
                continue
            numel = math.prod(self.shapes[group[0]])
            for names in batched.runs(group, numel, self.stack_limit()):
                proposals = [copy.copy(self.layers[n]) for n in names]     # as propose() makes
                for proposal in proposals:
                    proposal.gain = float("nan")
                found = [inputs[n] for n in names]
                if key[0] == "subspace":
                    rotations.append((proposals, found))
                else:
                    batched.refresh_group(proposals, found)
                refreshed.update(zip(names, proposals))
        if rotations:
            batched.refresh_stacks(rotations)
        for name, found in inputs.items():
            if name in refreshed:
                self.consider(name, refreshed[name])
            else:
                self.propose(name, found)

    def consider(self, name, proposal):
        self.proposed = True
        super().consider(name, proposal)

    def auto_sides(self):
        """Does the gain check compare two rotations (sides="auto"): both sides, and the column
        side alone, which keeps every row's scale (an error spread over rows lands on rows AdamW
        may divide by a tiny root)?"""
        return (self.opts.sides == "auto" and self.layer_class is not None
                and issubclass(self.layer_class, compress.SubspaceLayer))

    def round_trip(self, x):
        """x through stage 1's codec and back, as the collective encodes it (Four Over Six's
        block scales where nvfp4_scale says so)."""
        if self.opts.fmt == "nvfp4" and self.opts.nvfp4_scale == "4over6":
            return compress.dequantize(nvfp4.quantize_4over6(x))
        return super().round_trip(x)

    def through_codec(self, layer, g):
        """g through the codec in the layer's coordinates, or with sides="auto" in each of its
        two rotations."""
        if not self.auto_sides():       # the rotation in use only (sides fixed by Options)
            return [layer.decode(self.round_trip(layer.encode(g)))]
        return [layer.decode(self.round_trip(layer.encode(g, rotation)), rotation)
                for rotation in (layer.rotation("both"), layer.rotation("right"))]

    def error_seen(self, name, mean, workers):
        """Under FSDP (rows) the error of this rank's rows only, as its optimizer sees them (or
        in L2): the gain check's all-reduce adds the ranks' rows up."""
        rows = self.rows.get(name)
        if rows is None:
            return super().error_seen(name, mean, workers)
        view = self.views.get(name) if self.opts.geo_judge == "optimizer" else None
        return update_error.UpdateError(view, mean, rows, workers)

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self):
        layer_states = {n: layer.state_dict() for n, layer in self.layers.items() if layer.built}
        proposals = {n: layer.state_dict() for n, layer in self.proposals.items()}
        residuals = {w: dict(r) for w, r in self.residuals.items()}
        return {"geometry": self.opts.geometry, "step": self.steps_taken, "layers": layer_states,
                "proposals": proposals, "residuals": residuals, "listed": sorted(self.listed),
                "saturation": self.saturation, "saturation_steps": self.saturation_steps}

    def load_state_dict(self, state):
        saved = state.get("geometry", "subspace")       # checkpoints before the whitening existed
        saved = OLD_GEOMETRY.get(saved, saved)          # its name before
        proposals = state.get("proposals", state.get("candidates", {}))    # (their old name)
        if (state["layers"] or proposals) and saved != self.opts.geometry:
            raise ValueError(f"the communicator state is for geometry={saved!r}, not "
                             f"{self.opts.geometry!r}: resume with the same method")
        self.steps_taken = state["step"]
        self.residuals = {w: dict(r) for w, r in state.get("residuals", {}).items()}
        self.saturation = state.get("saturation")
        self.saturation_steps = state.get("saturation_steps", 0)
        self.listed = set(state.get("listed", state.get("chosen", self.listed)))  # (old name)
        for n, layer_state in state["layers"].items():
            self.layers[n].load_state_dict(layer_state)
        self.proposals = {}                 # (none in checkpoints from before they existed)
        for n, layer_state in proposals.items():
            if n not in self.layers:
                raise ValueError(f"the communicator state has new geometry for {n!r}, which is "
                                 "not a candidate matrix here: resume with the same model")
            self.proposals[n] = copy.copy(self.layers[n])   # as propose() makes one (FSDP's
            self.proposals[n].load_state_dict(layer_state)  # core-scattering choice included)
