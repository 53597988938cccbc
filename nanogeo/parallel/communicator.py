"""
The communicator as training runs it: compress.Communicator (the method: coordinates, the
two-stage collective, refresh, the gain check, the decision) restated in its faster forms, with
what production adds around it - a class of its own, not a subclass (which of its methods
restates which step of compress.py's: docs/method.md, "Two implementations"), held to
compress.py's bits by tests/test_reference.py:

  * memory: the tensors averaged a bucket at a time (bucket_mb, nanogeo.wire.buckets; each
    bucket through compress.py's collective: exchange() for step()'s step 3), each mean written
    into its gradient as it is decoded, the gain check measured then;
  * the wire: the packed stages, NVFP4, stochastic rounding's streams, a stage 2 in a format of
    its own (--stage2_fmt) and each rank's kept round trip (nanogeo.wire.collective),
    and the paper's collective, one FP8 all_reduce SUM with per-tensor scales
    (nanogeo.wire.fp8sum), with its fragility profile and the published top-k selection;
  * error feedback: each rank's own stage-1 rounding error, kept in original coordinates and
    added back at the next step (the paper's missing ablation is Euclidean + error feedback);
  * across ranks: the K-FAC moments averaged over the ranks (nanogeo.parallel.hooks); the
    geometry step (nanogeo.parallel.geometry_step, a mixin of the class below): one finiteness
    decision for all ranks before the geometry moves, the check that every rank holds the same
    geometry after a refresh (nanogeo.geometry.agreement), FSDP's row blocks;
  * the layers' state for the rank checks and checkpoints, the Hadamard control and the dense
    ablations (nanogeo.geometry.layers, .hadamard): whitening factors other than the low-rank
    one and their EMA, exact or random subspace bases, the stale residual of the published
    defect (c);
  * the subspace rotation's matrices of one shape encoded, decoded, refreshed and judged
    together, compress.py's functions mapped over the stack (nanogeo.geometry.batched): a GPU
    launches each op once per shape group, and waits on the host once per group and refresh
    (the SVD), not once per matrix;
  * a benchmark's stage timer, the layer table's reasons, checkpoints.

Options (nanogeo.parallel.options) are compress.GeoOptions plus production's fields.
"""
import copy
import zlib

import torch
import torch.distributed as dist

import compress
from nanogeo import RenamedAttribute, ReusedName
from nanogeo.geometry import agreement, batched, layers
from nanogeo.parallel import hooks
from nanogeo.parallel.geometry_step import GeometryStep
from nanogeo.parallel.options import (  # noqa: F401  (their home before)
    COLLECTIVES, FEEDBACK_STAGES, GEOMETRIES, OLD_GEOMETRY, RENAMED, SELECTIONS, SUBSPACE_SIDES,
    SUM_ORDERS, WHITEN_SIDES, Options)
from nanogeo.parallel.precision import ieee
from nanogeo.wire import buckets, collective, fp8sum, packing


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


class ProductionCommunicator(GeometryStep):
    """compress.Communicator in the production forms (module docstring): the same interface
    (step, reduce, reduce_workers, watch, moments_due, steps_taken, layers, ...). train.py (its
    step), the DDP hook, FSDP2 and the tools use this one."""
    LAYERS = layers.LAYERS      # compress.py's layers with their state, and the Hadamard control
    # the names before compress.py's one-name-per-thing pass (906d8c0), kept for one release
    # more; except the counter's old name, step, which ended early (0.2.0): it is
    # compress.Communicator.step's, the method below (assigning to it raises, naming steps_taken)
    chosen = RenamedAttribute("listed")
    kind = RenamedAttribute("layer_class")
    uses_moments = RenamedAttribute("from_moments")
    is_geo = RenamedAttribute("sent_in_geometry")
    wants_moments = RenamedAttribute("moments_due")

    def __init__(self, named_shapes, options=None, group=None, linear=None,
                 timer=collective.NO_TIMER):
        self.opts, self.group = options or Options(), group
        self.names = [n for n, _ in named_shapes]
        self.shapes = {n: tuple(s) for n, s in named_shapes}
        self.layer_class = self.LAYERS.get(self.opts.geometry)     # None: Euclidean
        may = [n for n in self.names
               if compress.why_euclidean(n, self.shapes[n], self.opts, linear) is None]
        self.layers = {n: self.layer_class.create(n, self.shapes[n], self.opts)
                       for n in may}    # name -> the geometry in use (or being built)
        self.proposals = {}     # name -> new geometry, not yet measured, not yet used
        # select="list": the names listed; "fragile": the profile's top_k (select_fragile)
        self.listed = set(self.opts.geo_layers) if self.opts.select == "list" else set()
        if self.listed - set(self.names):
            raise ValueError(f"geo_layers names tensors this model does not have, e.g. "
                             f"{sorted(self.listed - set(self.names))[0]!r}: list this model's")
        self.from_moments = bool(self.layers) and self.layer_class.from_moments
        self.views = {}         # name -> its optimizer's view (watch()); none: plain L2
        self.warned = False
        self.steps_taken = 0    # steps taken: counted at the end of each
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
        """g in the coordinates `name` is sent in."""
        with self.timer.stage("rotate"):
            return self.layers[name].encode(g) if self.sent_in_geometry(name) else g

    @ieee
    def from_coords(self, name, c):
        """Back to the original coordinates."""
        with self.timer.stage("rotate"):
            return self.layers[name].decode(c) if self.sent_in_geometry(name) else c

    # -- the matrices of one shape together (nanogeo.geometry.batched) -----------------------------

    def all_to_coords(self, names, tensors):
        """to_coords of each (compress.Communicator.step's step 2), the rotated matrices of one
        shape and sides encoded together."""
        return self.rotate_all(names, tensors, inverse=False)

    def all_from_coords(self, names, tensors):
        """from_coords of each (step 4), likewise."""
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
                    rotated = batched.rotate_stack_(group[0], X, bases, inverse).unbind()
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
        """compress.Communicator.reduce: step() of this rank's gradients, written in place."""
        across = dist.is_initialized()
        rank = dist.get_rank(self.group) if across else 0
        return self.step({rank: grads}, moments, across_ranks=across)[1]

    def step(self, worker_grads, moments=None, *, across_ranks):
        """compress.Communicator.step, a bucket at a time (step_in_buckets). Unlike the spec's,
        it overwrites the gradients of a process holding one worker (a rank's, as train.py's
        reduce_gradients calls it; or one simulated worker's): each tensor's mean is written
        into its gradient as soon as its last bucket is decoded, and the means returned are
        those gradients (fp32 ones; others hold the mean rounded, and the fp32 mean returns)."""
        if moments is not None and across_ranks:
            moments = self.average_moments(moments)
        return self.step_in_buckets(worker_grads, moments, across_ranks,
                                    in_place=len(worker_grads) == 1)

    step = ReusedName(step, "steps_taken")

    def step_in_buckets(self, worker_grads, moments, across_ranks, in_place=False):
        """compress.Communicator.step a bucket at a time (buckets()): each bucket's part
        of the tensors into coordinates, through the collective (exchange) and back before the
        next bucket's, then the geometry. A step holds one bucket's temporaries, not the model's.

        in_place (step() of one worker, the caller's gradients): each tensor's mean is written
        into its gradient as soon as it is decoded, and where the coming geometry step judges a
        layer (judged_next) its codec errors are measured then (layer_errors), while the
        gradient as sent is still there: the gain check needs no copy of the gradients."""
        # each tensor as sent (outgoing: fp32, plus error feedback's residual) is made at its
        # first bucket (take_off), so a step holds a bucket's worth of them, not the model's
        as_sent = {w: list(grads) for w, grads in worker_grads.items()}
        carried = BucketedStep(as_sent, across_ranks,
                            [*worker_grads.values()][0] if in_place else None,
                            self.judged_next(moments) if in_place else {}, len(self.names))
        self.taken = {} if in_place else None
        flights, finite, saturated = {}, [], []
        try:
            for k, bucket in enumerate(self.buckets()):
                flights.update(self.take_off([s for s in bucket if s.start == 0], carried))
                coords = {w: [flights[s.index].piece(w, s) for s in bucket] for w in as_sent}
                mean_pieces, nbytes, local, fractions = self.exchange(coords, across_ranks, k)
                carried.nbytes += nbytes
                saturated.append(fractions)
                if self.keeps_stage1():
                    finite.append(agreement.all_finite(mean_pieces))
                for j, s in enumerate(bucket):
                    flights[s.index].land(s, mean_pieces[j],
                                           None if local is None else [rt[j] for rt in local])
                self.arrive({s.index: flights.pop(s.index) for s in bucket if s.end == s.numel},
                            carried)
                del coords, mean_pieces, local      # freed before the next bucket's exchange
            if self.keeps_stage1() and finite:
                self.keep_residuals(carried.lost, torch.stack(finite).all())
            if self.decompose:      # the mean an exact second stage would deliver (this rank's)
                self.stage1 = carried.stage1
            fractions = [f for f in saturated if f is not None]     # (fp8-sum's profile)
            if fractions:
                self.count_saturation(torch.cat(fractions))
            self.advance(dict(zip(self.names, carried.means)), list(as_sent.values()), moments,
                         across_ranks)
        finally:
            self.taken = None
        return carried.means, carried.nbytes

    def take_off(self, segments, carried):
        """The tensors whose first bucket this is ({index: InFlight}): into coordinates on every
        worker, the matrices of one shape rotated together (all_to_coords)."""
        indices = [s.index for s in segments]
        for w, tensors in carried.as_sent.items():     # each one as sent, made now
            for i, g in zip(indices, self.outgoing_of(w, indices, tensors)):
                tensors[i] = g
        names = [self.names[i] for i in indices]
        coords = {w: self.all_to_coords(names, [grads[i] for i in indices])
                  for w, grads in carried.as_sent.items()}
        return {s.index: self.in_flight(s, {w: cs[j] for w, cs in coords.items()}, carried)
                for j, s in enumerate(segments)}

    def in_flight(self, segment, coords, carried):
        """A tensor at its first bucket, in coordinates on every worker ({worker: tensor}; the
        stale-residual ablation, defect c, adds the residual there) - contiguous when it is
        cut, with the buffers its mean (and error feedback's loss, --log_stages' round trips)
        gather in. Its mean gathers in its coordinates themselves unless they are the gradient
        as sent and that is read after the exchange (by the simulator's gain check, or this
        step's)."""
        i, n = segment.index, self.names[segment.index]
        if self.opts.stale_residual and self.has_feedback(n):
            coords = {w: c + self.residuals[w][n] if n in self.residuals.get(w, {}) else c
                      for w, c in coords.items()}
        if buckets.is_whole(segment):
            return InFlight(coords)
        coords = {w: c.contiguous() for w, c in coords.items()}
        w, first = next(iter(coords.items()))
        read_later = carried.grads is None or n in carried.judged
        aliased = first.untyped_storage().data_ptr() == \
            carried.as_sent[w][i].untyped_storage().data_ptr()     # (a view of it counts too)
        target = torch.empty_like(first) if read_later and aliased else first
        lost = ({w: torch.empty_like(c) for w, c in coords.items()}
                if self.keeps_stage1() and self.has_feedback(n) else None)
        local = {w: torch.empty_like(c) for w, c in coords.items()} if self.decompose else None
        return InFlight(coords, target, lost, local)

    def arrive(self, flights, carried):
        """The tensors after their last bucket ({index: InFlight}), the matrices of one shape
        rotated back together (all_from_coords): error feedback's loss and --log_stages' stage-1
        mean in original coordinates, and each mean decoded (carried.means) - in place, measured
        for the gain check where it is judged, then written into the gradient."""
        names = {i: self.names[i] for i in flights}
        fed = [i for i in flights if self.keeps_stage1() and self.has_feedback(names[i])]
        lost = {i: flights[i].lost_to_codec() for i in fed}
        for w in carried.as_sent:
            back = [lost[i][w] for i in fed]
            if not self.opts.stale_residual:
                back = self.all_from_coords([names[i] for i in fed], back)
            carried.lost[w].update((names[i], d) for i, d in zip(fed, back))
        if self.decompose:
            local = [torch.stack(list(flights[i].local.values())).mean(0) for i in flights]
            for i, mean in zip(flights, self.all_from_coords(list(names.values()), local)):
                carried.stage1[i] = mean
        means = dict(zip(flights, self.all_from_coords(list(names.values()),
                                                      [f.mean for f in flights.values()])))
        if carried.grads is None:
            for i, mean in means.items():
                carried.means[i] = mean
            return
        [as_sent] = carried.as_sent.values()
        judged = {names[i]: carried.judged[names[i]] for i in flights if names[i] in carried.judged}
        if judged:
            world = dist.get_world_size(self.group) if carried.across_ranks else 1
            index = {n: i for i, n in names.items()}
            self.taken.update(self.measure_now(
                judged, {n: means[index[n]] for n in judged},
                {n: [as_sent[index[n]]] for n in judged}, world))
        for i, mean in means.items():
            if mean is not carried.grads[i]:
                carried.grads[i].copy_(mean)
            as_sent[i] = None       # (read no more: the gain check's measurement is taken)
            # the geometry reads the fp32 mean: the gradient itself where it is fp32 (bf16 or
            # fp16 gradients of a DDP model hold it rounded, and the subspace iteration's and
            # the Householder completion's triangular solves take no bf16)
            carried.means[i] = carried.grads[i] if carried.grads[i].dtype == mean.dtype else mean

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
            self.timer, opts.stage2_fmt, opts.nvfp4_scale,
            sender=dist.get_rank(self.group) if across_ranks else None)
        if keep_local:
            layout = collective.KeptSends(layout, workers[0][0].device)
        if across_ranks:
            means, nbytes = compress.all_reduce_mean(workers[0], layout, group=self.group)
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
        return {n: (layer, self.errors_of(n, layer, means[n], grads[n], world * len(grads[n])))
                for n, layer in layers.items()}

    def layer_errors(self, name, layer, mean, grads, workers):
        """errors_of (one layer's part of compress.Communicator.measure); on a step that wrote
        its means in place, the errors step_in_buckets measured as the layer's mean was decoded
        (the gradient as sent is gone by now)."""
        if self.taken is None:
            return self.errors_of(name, layer, mean, grads, workers)
        measured, errors = self.taken.pop(name, (None, None))
        if measured is not layer:
            raise RuntimeError(f"the gain check measures {name!r}, which step_in_buckets did not "
                               "measure before writing its mean in place (judged_next)")
        return errors

    def local_scales(self):
        return (self.opts.scale_sync_every > 1
                and self.steps_taken % self.opts.scale_sync_every != 0)

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
