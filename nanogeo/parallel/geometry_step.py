"""
The geometry step as training runs it: compress.Communicator.step's step 5 (the step counted,
then - where due - the gain check and new geometry) with what a run over many ranks needs, the
base of ProductionCommunicator (nanogeo.parallel.communicator). compress.Communicator's
coordinates, gain check and decision are restated here (the first section below), in the same
words, and held to it by tests/test_reference.py (entries and exits, bit for bit),
tests/test_optimizer_metric.py (decide, case by case) and tests/test_compress.py (the methods
restated in the same words: the same code); around them:

  * one finiteness decision for all ranks before the geometry moves (a non-finite mean or moment
    is counted in `skipped` and changes nothing), read with the judge's measurements in one host
    read a geometry step (host_read);
  * the check that every rank holds the same geometry after a refresh (nanogeo.geometry
    .agreement), launched on the step that proposes and read on the next geometry step;
  * FSDP's row blocks; the matrices of one shape measured and refreshed together
    (nanogeo.geometry.batched); both rotations measured where Options.sides="auto";
  * the paper's profiled selection ("fragile": the top_k matrices by saturated FP8 sums over the
    warmup, in Euclidean mode).
"""
import copy
import math
import warnings

import numpy
import torch
import torch.distributed as dist

import compress
from nanogeo.geometry import agreement, batched, update_error
from nanogeo.parallel.precision import ieee
from nanogeo.wire import nvfp4, packing


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


class GeometryStep:
    """ProductionCommunicator's geometry step (module docstring); it relies on the
    communicator's state (layers, proposals, opts, group, timer, rows, stacks, ...)."""

    # -- compress.Communicator's coordinates, gain check and decision ---------------------------

    def watch(self, views):
        """Judge each layer by the error its optimizer sees: {name: a view with .error(mean,
        workers) -> (delta -> squared size)} (nanogeo.parallel.hooks.optimizer_views)."""
        self.views = dict(views)
        return self

    def sent_in_geometry(self, name):
        """Is `name` sent in its geometry-aware coordinates now?"""
        layer = self.layers.get(name)
        return (layer is not None and layer.use_geo and layer.built
                and self.steps_taken > self.opts.geo_warmup)

    def moments_due(self):
        """Does the next step need K-FAC moments (the whitening refreshes after it)?"""
        return self.from_moments and self.steps_taken % self.opts.geo_refresh == 0

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

    def propose(self, name, found):
        """New geometry for `name` from its refresh input, a copy (the layer in use stays)."""
        proposal = copy.copy(self.layers[name])
        proposal.gain = float("nan")                    # not measured yet
        proposal.refresh(found)
        self.consider(name, proposal)

    def consider(self, name, proposal):
        """A proposal until later gradients measure it - unless decide() takes it unmeasured."""
        self.proposed = True
        if self.decide(name, proposal):
            proposal.use_geo = True
            self.layers[name] = proposal
        else:
            self.proposals[name] = proposal

    def decide(self, name, layer):
        """compress.Communicator.decide: select="all" always; a list (select="list", or the
        published top-k "fragile") its names, unmeasured where both gains are 0; otherwise the
        measured gain with hysteresis (enter at geo_enter_gain, stay while >= geo_exit_gain)."""
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

    def measure_each(self, layers, means, as_sent, across_ranks):
        """compress.Communicator.measure, matrix by matrix: (layers, 1 + rotations) float64 on
        the device, the squared codec errors Euclidean and in each rotation as the optimizer
        sees them, summed over the workers and the ranks (every rank decides alike)."""
        world = dist.get_world_size(self.group) if across_ranks else 1
        errors = []
        for name, layer in layers.items():
            grads = [worker[self.names.index(name)] for worker in as_sent]
            errors += self.layer_errors(name, layer, means[name], grads, world * len(as_sent))
        errors = torch.stack(errors).double().view(len(layers), len(as_sent), -1).sum(1)
        if across_ranks:
            dist.all_reduce(errors, group=self.group)
        return errors

    def errors_of(self, name, layer, mean, grads, workers):
        """One layer's squared codec errors (compress.Communicator.measure's, for one layer),
        Euclidean and in its coordinates, for each worker's gradient as sent, as its optimizer
        sees them: a list of device scalars."""
        seen, errors = self.error_seen(name, mean, workers), []
        for g in grads:
            g = g.float()
            errors.append(seen(self.round_trip(g) - g))
            errors += [seen(back - g) for back in self.through_codec(layer, g)]
        return errors

    def plain_error_seen(self, name, mean, workers):
        """compress.Communicator.error_seen: the layer's optimizer view, or plain L2 - warning
        once if asked for but no optimizer is watched."""
        view = self.views.get(name) if self.opts.geo_judge == "optimizer" else None
        if view is not None:
            return view.error(mean, workers)
        if self.opts.geo_judge == "optimizer" and not self.views and not self.warned:
            self.warned = True
            warnings.warn("geo_judge='optimizer' but no optimizer is watched, so the layers are "
                          "judged in plain L2: call watch() (the DDP hook: state.watch("
                          "optimizers)) or pass geo_judge='l2'", stacklevel=3)
        return lambda delta: delta.pow(2).sum()

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
            return self.measure_each(layers, means, as_sent, across_ranks)
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
        """compress.Communicator.refresh_inputs - {name: what its new geometry is built from}:
        the whitening's averaged K-FAC moments ({side: moment}), when given; the others' decoded
        mean every geo_refresh steps, or until built - after the step's flags are read
        (host_read)."""
        if self.from_moments:
            given = {n: {side: moments[side][n] for side in self.whitened_sides()
                         if n in moments.get(side, {})} for n in self.layers} if moments else {}
            found = {n: sides for n, sides in given.items() if sides}
        else:
            found = {n: means[n] for n, layer in self.layers.items()
                     if self.steps_taken % self.opts.geo_refresh == 0 or not layer.built}
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
        """propose() for each {name: its refresh input} (compress.Communicator.step's step 5),
        the new geometry of the matrices of one shape built together (nanogeo.geometry.batched:
        the rotation's bases, the low-rank whitening's factors; under FSDP the rotation's
        completions)."""
        keys = {n: batched.refresh_key(self.layers[n], found) for n, found in inputs.items()}
        refreshed, rotations = {}, []       # rotations: [(proposals, means)], one SVD for all
        for key, group in batched.groups(keys).items():
            if key is None:
                continue
            numel = math.prod(self.shapes[group[0]])
            for names in batched.runs(group, numel, self.stack_limit()):
                proposals = self.unmeasured_copies(names)
                found = [inputs[n] for n in names]
                if key[0] == "subspace":
                    rotations.append((proposals, found))
                else:
                    batched.refresh_group(proposals, found)
                refreshed.update(zip(names, proposals))
        if rotations:
            batched.refresh_stacks(rotations)
        sharded = [n for n in inputs if n not in refreshed and batched.row_sharded(self.layers[n])]
        if sharded:                         # FSDP's rows: the completions together
            proposals = self.unmeasured_copies(sharded)
            batched.refresh_rows(proposals, [inputs[n] for n in sharded])
            refreshed.update(zip(sharded, proposals))
        for name, found in inputs.items():
            if name in refreshed:
                self.consider(name, refreshed[name])
            else:
                self.propose(name, found)

    def unmeasured_copies(self, names):
        """Each layer's copy to refresh into a proposal, not yet measured (as propose() makes)."""
        proposals = [copy.copy(self.layers[n]) for n in names]
        for proposal in proposals:
            proposal.gain = float("nan")
        return proposals

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
        return compress.dequantize(compress.quantize(x, self.opts.fmt, self.opts.block))

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
            return self.plain_error_seen(name, mean, workers)
        view = self.views.get(name) if self.opts.geo_judge == "optimizer" else None
        return update_error.UpdateError(view, mean, rows, workers)
