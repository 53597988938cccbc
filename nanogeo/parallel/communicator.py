"""
The communicator as training runs it: compress.Communicator (the method: coordinates, the
two-stage collective, error feedback, refresh, the gain check) with what production adds around
it - a subclass, so that compress.py stays the one statement of the method and every addition
here is an override that calls it:

  * the wire: the packed stages, NVFP4 and stochastic rounding's streams (nanogeo.wire.collective),
    and the paper's collective, one FP8 all_reduce SUM with per-tensor scales
    (nanogeo.wire.fp8sum), with its fragility profile and the published top-k selection;
  * across ranks: the K-FAC statistics averaged over the ranks (nanogeo.parallel.hooks), one
    finiteness decision for all of them before the geometry moves, the check that every rank
    holds the same geometry after a refresh (nanogeo.parallel.agreement);
  * the layers' state for the rank checks and checkpoints, and the dense ablations
    (nanogeo.parallel.layers): whitening factors other than the low-rank one and
    their EMA, exact or random subspace bases, the stale residual of the published defect (c);
  * checkpoints: state_dict / load_state_dict.

Options are compress.GeoOptions plus the fields of this module's Options.
"""
import copy
import zlib
from dataclasses import dataclass

import torch

import compress
from nanogeo.parallel import agreement, hooks, layers
from nanogeo.wire import collective, fp8sum

# options renamed to train.py's flag names (one vocabulary), and the whitening's old name
RENAMED = {"refresh": "geo_refresh", "warmup": "geo_warmup", "judge": "geo_judge",
           "enter_gain": "geo_enter_gain", "exit_gain": "geo_exit_gain",
           "factor": "whiten_factor", "stochastic": "stochastic_round"}
OLD_GEOMETRY = {"whiten": "geofp8"}
COLLECTIVES = ("two-stage", "fp8-sum")
SUM_ORDERS = ("ring", "tree")      # fp8-sum: the order NCCL adds in (nanogeo/wire/fp8sum.py)
SELECTIONS = compress.SELECTIONS + ("fragile",)


@dataclass
class Options(compress.GeoOptions):
    collective: str = "two-stage"   # or "fp8-sum": the paper's per-tensor scales + FP8 all_reduce
    sum_order: str = "ring"         # fp8-sum: the order NCCL adds in ("ring" or "tree")
    scale_sync_every: int = 1       # fp8-sum: >1 reproduces the published local-scale defect
    top_k: int = 0                  # select="fragile": the top_k matrices by fraction of saturated
                                    # FP8 sums over the warmup steps (needs collective="fp8-sum")
    stochastic_round: bool = False  # stochastic rounding (two-stage collective only)
    stochastic_stages: str = "both" # ... in both stages, or only "1" (each rank's send) or "2"
                                    # (the re-quantized averaged shard)
    # ablations (nanogeo/parallel/layers.py)
    whiten_factor: str = "lowrank"  # lowrank | lowrank-dense | full | diag | block
    whiten_block: int = 64          # block size of whiten_factor="block"
    factor_decay: float = 0.0       # EMA of the triangular factor itself (published: 0.95)
    full: bool = False              # exact dense eigenbases (reference / ablation)
    basis: str = "householder"      # "householder" or "random" (dense random rotation)
    stale_residual: bool = False    # keep the residual in the old coordinates (defect c)

    def choices(self):
        return {**super().choices(), "select": SELECTIONS, "collective": COLLECTIVES,
                "sum_order": SUM_ORDERS, "whiten_factor": layers.WHITEN_FACTORS,
                "basis": ("householder", "random"),
                "stochastic_stages": tuple(collective.ROUNDING_STAGES)}

    def __post_init__(self):
        super().__post_init__()
        if self.scale_sync_every < 1:
            raise ValueError("scale_sync_every must be >= 1")
        if self.collective == "fp8-sum" and (self.fmt == "nvfp4" or self.stochastic_round):
            raise ValueError("the fp8-sum collective sums e4m3/e5m2 codes with nearest rounding; "
                             "use collective='two-stage' for nvfp4 or stochastic rounding")
        if self.stochastic_stages != "both" and not self.stochastic_round:
            raise ValueError("stochastic_stages chooses the stages that stochastic_round rounds "
                             "stochastically: turn stochastic_round on too (--stochastic_round)")
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


class ProductionCommunicator(compress.Communicator):
    """compress.Communicator with the production forms (module docstring). train.py, the DDP
    hook, FSDP2 and the tools use this one."""

    def __init__(self, named_shapes, options=None, group=None, linear=None, timer=compress.NO_TIMER):
        super().__init__(named_shapes, options or Options(), group, linear, timer)
        self.rounding_stream = zlib.crc32("\0".join(self.names).encode())  # its own random draws
        self.skipped = 0        # geometry updates skipped for a non-finite mean
        self.saturation = None  # fp8-sum: running sum of each tensor's saturated fraction
        self.saturation_steps = 0

    LAYERS = layers.LAYERS      # compress.py's layers, with their state (nanogeo.parallel.layers)

    def _new_layer(self, name):
        shape, opts = self.shapes[name], self.opts
        if opts.geometry != "subspace" or not opts.dense_bases:
            return super()._new_layer(name)
        r = min(shape) if opts.full else min(opts.geo_rank, min(shape) // 2)
        return layers.DenseSubspaceLayer(shape, r, seed=zlib.crc32(name.encode()), opts=opts,
                                         sides="both" if opts.sides == "auto" else opts.sides)

    # -- the wire --------------------------------------------------------------------------------

    def rounding_seed(self):
        """This step's stochastic-rounding seed, different for every tensor list (every DDP
        bucket, every FSDP module): buckets of the same layout must not round alike."""
        return (self.opts.seed * 7919 + self.step) * 2_147_483_659 + self.rounding_stream

    def _exchange(self, coords):
        (tensors,), opts = coords, self.opts
        if opts.collective == "fp8-sum":
            means, nbytes, local, saturated = fp8sum.all_reduce_fp8_sum(
                tensors, opts.fmt, self.group, opts.sum_order, self._local_scales(),
                self._profiling())
            self._count_saturation(saturated)
            return means, nbytes, [local]
        means, nbytes, *local = collective.all_reduce_mean(
            tensors, opts.fmt, opts.block, self.group, opts.stochastic_round, self.rounding_seed(),
            return_local=opts.error_feedback, timer=self.timer, stages=opts.stochastic_stages)
        return means, nbytes, local or None

    def _simulate(self, coords):
        opts = self.opts
        if opts.collective == "fp8-sum":
            means, nbytes, local, saturated = fp8sum.simulate_fp8_sum(
                coords, opts.fmt, opts.sum_order, self._local_scales(), self._profiling())
            self._count_saturation(saturated)
            return means, nbytes, local
        means, nbytes, *local = collective.simulate_mean(
            coords, opts.fmt, opts.block, opts.stochastic_round, self.rounding_seed(),
            return_local=opts.error_feedback, stages=opts.stochastic_stages)
        return means, nbytes, local[0] if local else None

    def _round_trip(self, x):
        return collective.round_trip(x, self.opts.fmt, self.opts.block)

    def _local_scales(self):
        return self.opts.scale_sync_every > 1 and self.step % self.opts.scale_sync_every != 0

    # -- the paper's profiled selection ------------------------------------------------------------

    def _profiling(self):
        """Is the fragility profile taken this step? During the warmup for select="fragile",
        always in Euclidean mode (nanogeo.tools.profile)."""
        warmup = self.opts.select == "fragile" and self.step < self.opts.geo_warmup
        return warmup or self.opts.geometry == "euclidean"

    def _count_saturation(self, saturated):
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

    def advance(self, means, worker_grads, across_ranks=False, rows=None, moments=None):
        super().advance(means, worker_grads, across_ranks, rows, moments)
        if self.layers and self.opts.select == "fragile" and self.step == self.opts.geo_warmup:
            self._select_fragile()

    def _select_fragile(self):
        """The published selection: the top_k matrices by mean fraction of saturated FP8 sums
        over the profiled (warmup) steps may go geometry-aware, if their gain allows."""
        scores = self.fragility()
        ranked = sorted(self.layers, key=lambda n: -scores.get(n, 0.0))
        self.chosen = set(ranked[:self.opts.top_k])
        for n in ranked:
            self._choose(n, self.layers[n])

    # -- across ranks ------------------------------------------------------------------------------

    def _average_moments(self, moments, device):
        """The K-FAC statistics of every rank (this rank's, summed over the group; or a list of
        each simulated worker's) -> their token-weighted mean, the same on every rank."""
        if not (isinstance(moments, list) or (moments is not None and self.across_ranks)):
            return moments
        shapes = {n: self.shapes[n] for n in self.moment_layers()}
        if isinstance(moments, list):
            return hooks.average_worker_moments(moments, shapes, self.whitened_sides(), device)
        return hooks.average_moments(moments, shapes, self.whitened_sides(),
                                     self._sum_over_ranks, device)

    def _update_geometry(self, means, worker_grads, moments, whiten_now):
        """Only from finite means and statistics (else counted in `skipped`); after a refresh
        across ranks, check that every rank holds the same geometry."""
        if not self._finite(means, moments):
            self.skipped += 1   # a non-finite mean (or statistic) must not reach the geometry
            return False
        with self.timer.stage("geometry"):
            refreshed = super()._update_geometry(means, worker_grads, moments, whiten_now)
        if self.across_ranks and refreshed:
            device = next(iter(means.values())).device
            newest = [self.candidates.get(n, layer) for n, layer in self.layers.items()]
            agreement.verify_geometry(newest, self.group, self.step, device)
        return refreshed

    def _finite(self, means, moments):
        """Are this step's means (and statistics) finite? One host sync, on geometry steps only.
        The ranks decide together through one small all-reduce: under FSDP (rows) each holds
        its own rows, and under DDP a rank whose copy went bad alone must not skip the geometry
        steps (and their collectives) that the others run."""
        tensors = list(means.values())
        for side in ("input", "output"):
            tensors += list((moments or {}).get(side, {}).values())
        bad = self._sum_over_ranks((~agreement.all_finite(tensors)).double())
        return bad.item() == 0

    # -- error feedback: a non-finite step keeps the old residual; the stale ablation ---------------

    def _prepare(self, grads, worker):
        if not self.opts.stale_residual:
            return super()._prepare(grads, worker)
        residual = self.residuals.pop(worker, {})      # defect (c): added in coordinates
        outgoing, coords = super()._prepare(grads, worker)
        self.residuals[worker] = residual
        return outgoing, [c + residual[n] if self._has_feedback(n) and n in residual else c
                          for n, c in zip(self.names, coords)]

    def _residual(self, name, lost):
        """The stale-residual ablation keeps the loss in the coordinates it was made in."""
        return lost if self.opts.stale_residual else super()._residual(name, lost)

    def _keep_residuals(self, coords, local, mean_coords):
        """As compress.py's, but a step whose mean is not finite (an fp16 GradScaler overflow;
        the optimizer skips it) keeps the old residual: chosen on the device, no host sync."""
        old = {w: self.residuals.get(w, {}) for w in coords}
        super()._keep_residuals(coords, local, mean_coords)
        finite = agreement.all_finite(mean_coords)
        for w in coords:
            self.residuals[w] = {n: torch.where(finite, r, old[w].get(n, torch.zeros_like(r)))
                                 for n, r in self.residuals[w].items()}

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self):
        layers = {n: layer.state_dict() for n, layer in self.layers.items() if layer.ready}
        candidates = {n: layer.state_dict() for n, layer in self.candidates.items()}
        residuals = {w: dict(r) for w, r in self.residuals.items()}
        return {"geometry": self.opts.geometry, "step": self.step, "layers": layers,
                "candidates": candidates, "residuals": residuals, "chosen": sorted(self.chosen),
                "saturation": self.saturation, "saturation_steps": self.saturation_steps}

    def load_state_dict(self, state):
        saved = state.get("geometry", "subspace")       # checkpoints before the whitening existed
        saved = OLD_GEOMETRY.get(saved, saved)          # its name before
        if (state["layers"] or state.get("candidates")) and saved != self.opts.geometry:
            raise ValueError(f"the communicator state is for geometry={saved!r}, not "
                             f"{self.opts.geometry!r}: resume with the same method")
        self.step = state["step"]
        self.residuals = {w: dict(r) for w, r in state.get("residuals", {}).items()}
        self.saturation = state.get("saturation")
        self.saturation_steps = state.get("saturation_steps", 0)
        self.chosen = set(state.get("chosen", self.chosen))
        for n, layer_state in state["layers"].items():
            self.layers[n].load_state_dict(layer_state)
        self.candidates = {}                # (none in checkpoints from before they existed)
        for n, layer_state in state.get("candidates", {}).items():
            if n not in self.layers:
                raise ValueError(f"the communicator state has new geometry for {n!r}, which is "
                                 "not a candidate matrix here: resume with the same model")
            self.candidates[n] = copy.copy(self.layers[n])  # as _propose makes one (FSDP's
            self.candidates[n].load_state_dict(layer_state)  # core-scattering choice included)
