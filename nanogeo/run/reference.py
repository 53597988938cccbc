"""
`train.py --impl=reference`: train with compress.py's `Communicator` - the specification - in
place of the fast path (nanogeo/parallel/communicator.py's ProductionCommunicator). An edit of
compress.py then changes what trains, on real ranks and with --simulate_workers alike.

The specification is the method without the machinery: no buckets (the whole model is averaged
at once), the K-FAC moments averaged over the ranks' tokens in one all-reduce of a fixed slot
list, the whitening's eigenpairs by --whiten_solver=auto's rule. Euclidean FP8, the subspace
rotation, NVFP4, the mixed wire (an e4m3 stage 2), error feedback and the published whitening
end on the fast path's bits (tests/test_reference.py), and so does the paper's FP8-sum
collective for Euclidean FP8 (fp8-paper) on gloo and simulated ranks - with the model in one of
the fast path's buckets (NVFP4's tensor scales and fp8-sum's ring chunks are per bucket;
docs/method.md). The flags of what it does not state - that collective with a geometry or error
feedback or another sum order, Four Over Six, stochastic rounding, the Hadamard control, the
whitening's ablations and a --whiten_solver other than auto, stage 1's feedback on the
geometry-aware matrices only, stage 2's feedback with a geometry (its residual lives in
coordinates that move), --log_stages, resuming - stop the run with one line naming them.

`Reference` is the thin adapter train.py needs around it: the names train.py's log and
simulated ranks read (coords, moment_layers, each simulated rank's moments averaged); every
other attribute is the specification's own.
"""

import dataclasses

import compress
from nanogeo.parallel import hooks
from nanogeo.run.config import ConfigError

# train.py flags (with the default that leaves them off) the specification has no statement of
FAST_ONLY = {"sum_order": "ring", "scale_sync_every": 1, "nvfp4_scale": "6",
             "stochastic_round": False, "feedback_geo_only": False, "whiten_factor": "lowrank",
             "whiten_sides": "input", "factor_decay": 0.0, "log_stages": False, "resume": False}


def check(cfg):
    """A ConfigError naming the first flag --impl=reference cannot run."""
    if cfg.comm == "hadamard":
        raise ConfigError("--impl=reference: compress.py has no Hadamard control; use "
                          "--impl=fast for --comm=hadamard")
    if cfg.error_feedback and cfg.feedback_stages != "1" and cfg.comm != "fp8":
        raise ConfigError("--impl=reference: compress.py keeps stage 2's residual where the "
                          "fast path drops it (when a geometry's coordinates change); use "
                          "--feedback_stages=1, --comm=fp8 or --impl=fast")
    if cfg.collective == "fp8-sum" and (cfg.comm != "fp8" or cfg.error_feedback):
        raise ConfigError("--impl=reference: compress.py states the paper's FP8-sum collective "
                          "for Euclidean FP8 without error feedback; use --comm=fp8 or "
                          "--impl=fast")
    if cfg.comm == "geofp8" and cfg.whiten_solver != "auto":
        raise ConfigError("--impl=reference: compress.py states --whiten_solver=auto's rule "
                          "(subspace iteration where the gain check measures each factor, else "
                          "eigh); drop --whiten_solver or use --impl=fast")
    if cfg.geo_layers.startswith("fragile:"):
        raise ConfigError("--impl=reference: compress.py has no saturation profiler; use "
                          "--geo_layers=gain, all or a file, or --impl=fast")
    for flag, off in FAST_ONLY.items():
        if getattr(cfg, flag) != off:
            raise ConfigError(f"--impl=reference: compress.py has no --{flag}; drop it or use "
                              "--impl=fast")


def spec_options(options):
    """compress.GeoOptions holding the fields of production's Options that the spec states."""
    return compress.GeoOptions(**{f.name: getattr(options, f.name)
                                  for f in dataclasses.fields(compress.GeoOptions)})


class Reference:
    """compress.Communicator as train.py drives it."""

    def __init__(self, named_shapes, options, linear):
        self.spec = compress.Communicator(named_shapes, spec_options(options), linear=linear)
        # why each tensor without a layer stays Euclidean (train.py's layer table prints it)
        self.reasons = {n: compress.why_euclidean(n, s, self.spec.opts, linear) or "-"
                        for n, s in named_shapes}

    def __getattr__(self, name):        # step (train.py's call), names, shapes, layers, opts, ...
        return getattr(self.spec, name)

    def coords(self, name):
        return "geo" if self.spec.sent_in_geometry(name) else "euclidean"

    def whitened_sides(self):
        """compress.py whitens the input side (K-FAC's A) only."""
        return ("input",)

    def moment_layers(self):
        """The layers whose K-FAC moments the forward hooks collect (the whitening's)."""
        return list(self.spec.layers) if self.spec.from_moments else []

    def reduce_workers(self, worker_grads, moments=None):
        """`moments`: each simulated rank's, averaged here as compress.Communicator
        .average_moments averages them over real ranks - weighted by tokens, the ranks' sums
        added in rank order - by the function the fast path's simulated ranks use (its bits are
        those of one all-reduce of the same slots: tests/test_reference.py)."""
        if moments:
            shapes = {n: self.spec.shapes[n] for n in self.moment_layers()}
            moments = hooks.average_worker_moments(moments, shapes, self.whitened_sides(),
                                                   worker_grads[0][0].device)
        return self.spec.reduce_workers(worker_grads, moments)

    def state_dict(self):
        return {}               # nothing to resume from: --resume is refused (check)
