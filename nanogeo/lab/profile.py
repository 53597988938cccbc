"""
The published GeoFP8's layer selection: which matrices are "numerically fragile"?

    python -m nanogeo.lab.profile --workers=8 --steps=100 --top_k=4 --out layers.json
    torchrun --standalone --nproc_per_node=2 train.py --comm=geofp8 --geo_layers=layers.json

The paper profiles a Euclidean FP8 run: every matrix is sent with one e5m2 scale shared by all
ranks (the max of their amax) and its FP8 codes are summed by the all_reduce, which saturates at
the format's max. A matrix's fragility score is the fraction of its summed codes at +-max,
averaged over the first N steps; the highest-scoring matrices get the whitening transform, all
others stay Euclidean. (At 600M parameters the paper's top 13 were all MLP down-projections.)

This tool trains --preset in one process as --workers data-parallel workers (the model steps with
their exact mean, nanogeo.lab.capture's loop), sends every step's gradients through the paper's
collective as simulated (nanogeo.wire.fp8sum.simulate_fp8_sum: fp16 adds, saturating re-rounds per
hop, in ring or tree order), prints the ranking and writes the selection:

    --top_k K        the K highest scores (the paper's rule)
    --threshold T    every matrix whose score is >= T
    --by gain        instead of fragility: this project's measured selection - whiten every
                     candidate and keep the matrices whose codec error it lowers by >= 1.1x

The output file is JSON: {"selected": [names], "scores": {name: score}, ...}; train.py's
--geo_layers=FILE and the DDP hook (select="list", geo_layers=...) take the "selected" list.
Roles come from the model's modules (nn.Linear weights; the vocabulary's weights by
hooks.vocabulary_layers), never from names or shapes.
The same profile runs inside train.py with --geo_layers=fragile:K --collective=fp8-sum.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass

import torch

import compress
import model as model_lib
from prepare_data import ShardError
from nanogeo.lab.capture import CaptureConfig, simulated_training
from nanogeo.run import config
from nanogeo.parallel import hooks
from nanogeo.parallel.communicator import Options, ProductionCommunicator, SUM_ORDERS


@dataclass
class ProfileConfig(CaptureConfig):
    out: str = "layers.json"
    steps: int = 100                  # profiled steps (the paper: the first 100)
    train_steps: int = 0              # steps trained before profiling starts
    workers: int = 8
    fmt: str = "e5m2"
    sum_order: str = "ring"
    by: str = "fragility"             # fragility | gain
    top_k: int = 0                    # select the K highest scores ...
    threshold: float = 0.0            # ... or every score >= this (fragility only)


def profile(cfg: ProfileConfig):
    """Scores per candidate matrix and the selected names."""
    cfg = dataclasses.replace(cfg, capture_steps=cfg.steps)
    comm = None
    geometry = "euclidean" if cfg.by == "fragility" else "geofp8"
    for step, model, optimizers, workers, moments, loss in simulated_training(
            cfg, cfg.train_steps, collect_moments=cfg.by == "gain"):
        if comm is None:
            named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
            linear = set(hooks.linear_layers(model))     # candidates, by module type
            vocabulary = hooks.vocabulary_layers(model, torch.zeros(1, 1, dtype=torch.long))
            options = Options(
                geometry=geometry, fmt=cfg.fmt, block="tensor", collective="fp8-sum",
                sum_order=cfg.sum_order, geo_refresh=1, select="gain", vocabulary=vocabulary)
            comm = ProductionCommunicator(named, options, linear=linear)
            comm.watch(hooks.optimizer_views(optimizers, model))  # gains as they see them
            candidates = [n for n, s in named
                          if compress.why_euclidean(n, s, Options(
                              geometry="geofp8", vocabulary=vocabulary), linear) is None]
        comm.reduce_workers([[w[n] for n in comm.names] for w in workers], moments)
        print(f"profiled step {step}: loss {loss:.3f}")
    if cfg.by == "fragility":
        fragility = comm.fragility()
        scores = {n: fragility[n] for n in candidates}
    else:
        scores = {n: comm.layers[n].gain for n in candidates}
    ranked = sorted(scores, key=lambda n: -scores[n])
    if cfg.by == "gain":
        selected = [n for n in ranked if comm.layers[n].use_geo]
    elif cfg.top_k:
        selected = ranked[: cfg.top_k]
    else:
        selected = [n for n in ranked if scores[n] >= cfg.threshold]
    return scores, ranked, selected


def main(argv=None):
    try:
        cfg = config.parse_config(sys.argv[1:] if argv is None else argv, ProfileConfig,
                                  presets={name: {} for name in model_lib.PRESETS},
                                  choices={"preset": tuple(model_lib.PRESETS),
                                           "optimizer": ("adamw", "muon"),
                                           "fmt": ("e4m3", "e5m2"),
                                           "sum_order": SUM_ORDERS,
                                           "by": ("fragility", "gain")}, doc=__doc__)
        if cfg.by == "fragility" and not cfg.top_k and not cfg.threshold:
            raise config.ConfigError("choose the selection: --top_k=K or --threshold=T")
        scores, ranked, selected = profile(cfg)
    except (config.ConfigError, ShardError) as e:
        sys.exit(f"nanogeo.lab.profile: error: {e}")
    label = "saturated fraction" if cfg.by == "fragility" else "measured gain"
    print(f"{'rank':>4s}  {'matrix':40s} {label:>18s}  selected")
    for k, n in enumerate(ranked):
        print(f"{k + 1:4d}  {n:40s} {scores[n]:18.6f}  {'*' if n in selected else ''}")
    with open(cfg.out, "w") as f:
        json.dump({"selected": selected, "scores": scores, "by": cfg.by, "preset": cfg.preset,
                   "workers": cfg.workers, "steps": cfg.steps, "fmt": cfg.fmt,
                   "sum_order": cfg.sum_order}, f, indent=1)
    print(f"wrote {cfg.out}: {len(selected)} of {len(ranked)} matrices selected")


if __name__ == "__main__":
    main()
