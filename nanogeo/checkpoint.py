"""
Checkpoints of train.py: what a resumable run writes, and the checks that refuse to resume a
run with other numerics.

out_dir/ckpt.pt holds the model, the optimizers, the step, the config, the communicator's state
(GeoFP8 geometry) and the RNG; with error feedback every rank also writes its own residual file
next to it (residuals-rankRRRRR-stepSSSSSSS.pt). Writes are atomic (temp file, fsync, rename),
so a crash never leaves a half-written checkpoint, and the K-1 previous checkpoints are kept as
ckpt-STEP.pt.
"""
import os
from dataclasses import asdict

import torch
import torch.distributed as dist

from nanogeo.config import ConfigError


def ckpt_path(cfg):
    return os.path.join(cfg.out_dir, "ckpt.pt")


# what a checkpoint's numbers depend on: resuming with any of these changed would silently load
# mismatched geometry, optimizer state or residuals
RESUME_MUST_MATCH = ("preset", "optimizer", "comm", "fmt", "block", "collective", "geo_rank",
                     "whiten_factor", "whiten_rank", "whiten_sides", "error_feedback")


def open_checkpoint(cfg, world_size, device, master):
    """The checkpoint to resume from (None for a fresh run), after checking that it is this
    run's. A fresh run with --overwrite first moves an existing one aside (to ckpt.pt.old), so
    that an elastic restart before its first save cannot resume the replaced run."""
    path = ckpt_path(cfg)
    if not cfg.resume:
        if os.path.exists(path) and not cfg.overwrite:
            raise ConfigError(f"{cfg.out_dir} already holds another run's checkpoint; pass --resume "
                              "to continue it, --overwrite=true to replace it, or choose another "
                              "--out_dir")
        if os.path.exists(path) and master:
            os.replace(path, path + ".old")
            for name in os.listdir(cfg.out_dir):
                if name.startswith("residuals-rank"):
                    os.remove(os.path.join(cfg.out_dir, name))
        if dist.is_initialized():
            dist.barrier()          # no rank looks for a checkpoint before it is moved
        return None
    if not os.path.exists(path):
        raise ConfigError(f"--resume but {path} does not exist; drop --resume to start fresh")
    ckpt = torch.load(path, map_location=device, weights_only=True)
    saved = {"optimizer": "adamw", **ckpt["config"]}
    for flag in RESUME_MUST_MATCH:
        if flag in saved and saved[flag] != getattr(cfg, flag):
            raise ConfigError(f"{path} is a --{flag}={saved[flag]} run; resume it with that "
                              f"setting or use another --out_dir")
    saved_world = ckpt.get("world_size", world_size)
    if cfg.error_feedback and saved_world != world_size:
        raise ConfigError(f"{path} keeps error-feedback residuals for {saved_world} ranks; "
                          f"resume on {saved_world} ranks or start a new run")
    if cfg.error_feedback and ckpt.get("simulated", False) != bool(cfg.simulate_workers):
        was = "simulated ranks (--simulate_workers)" if ckpt.get("simulated") else "real ranks"
        raise ConfigError(f"{path} keeps error-feedback residuals of {was}; resume it the "
                          "same way or start a new run")
    return ckpt


def residuals_path(out_dir, rank, step):
    return os.path.join(out_dir, f"residuals-rank{rank:05d}-step{step:07d}.pt")


def save_residuals(residuals, out_dir, rank, step):
    """Error feedback keeps one residual per rank: each rank writes its own next to ckpt.pt and
    keeps it and the one before (a crash before ckpt.pt is written leaves the previous pair);
    files of later steps are from a run this one replaces."""
    atomic_save(residuals, residuals_path(out_dir, rank, step))
    prefix = f"residuals-rank{rank:05d}-step"
    steps = sorted(int(f[len(prefix):-3]) for f in os.listdir(out_dir)
                   if f.startswith(prefix) and f.endswith(".pt"))
    keep = [s for s in steps if s <= step][-2:]
    for old in steps:
        if old not in keep:
            os.remove(residuals_path(out_dir, rank, old))


def load_residuals(out_dir, rank, step, device):
    path = residuals_path(out_dir, rank, step)
    if not os.path.exists(path):
        raise ConfigError(f"{path} is missing: with --error_feedback every rank resumes its own "
                          "residual; restore the file or start a new run")
    return torch.load(path, map_location=device, weights_only=True)


def atomic_save(obj, path):
    """Write to a temp file, fsync, rename: a crash never leaves a half-written checkpoint."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def optimizer_states(optimizers):
    """The checkpoint's optimizer entries: AdamW under "optimizer", Muon under "muon"."""
    *muon, adamw = optimizers
    return {"optimizer": adamw.state_dict(), "muon": muon[0].state_dict() if muon else {}}


def load_optimizers(optimizers, ckpt):
    *muon, adamw = optimizers
    adamw.load_state_dict(ckpt["optimizer"])
    if muon:
        muon[0].load_state_dict(ckpt["muon"])


def restore(ckpt, model, optimizers, communicator, cfg, rank, world_size, device):
    """Load a checkpoint (open_checkpoint's) into a freshly built run; returns its step."""
    model.load_state_dict(ckpt["model"])
    load_optimizers(optimizers, ckpt)
    if communicator is not None and ckpt.get("communicator"):
        communicator.load_state_dict(ckpt["communicator"])
        if cfg.error_feedback and world_size > 1:   # every rank's own residual
            communicator.residuals = {rank: load_residuals(cfg.out_dir, rank, ckpt["step"], device)}
    if "rng" in ckpt:
        torch.set_rng_state(ckpt["rng"]["torch"].cpu())
    return ckpt["step"]


class Checkpointer:
    """Writes out_dir/ckpt.pt (rank 0) and, with error feedback, every rank's residual file,
    keeping the previous keep_ckpts - 1 checkpoints as ckpt-STEP.pt."""

    def __init__(self, cfg, model_config, data_parallel, rank, world_size, last_step=None):
        self.cfg, self.model_config = cfg, model_config
        self.data_parallel, self.rank, self.world_size = data_parallel, rank, world_size
        self.path = ckpt_path(cfg)
        self.last_step = last_step          # the step of this run's latest ckpt.pt, if any

    def save(self, step, model, optimizers, communicator):
        cfg = self.cfg
        if communicator is not None and cfg.error_feedback and self.world_size > 1:
            save_residuals(communicator.residuals.get(self.rank, {}), cfg.out_dir, self.rank, step)
            dist.barrier()      # every rank's residual is on disk before ckpt.pt names the step
        if self.rank != 0:
            return
        if self.last_step is not None and cfg.keep_ckpts > 1:   # keep the previous ones too
            os.replace(self.path, os.path.join(cfg.out_dir, f"ckpt-{self.last_step:07d}.pt"))
            old = sorted(f for f in os.listdir(cfg.out_dir) if f.startswith("ckpt-"))
            for name in old[: max(0, len(old) - (cfg.keep_ckpts - 1))]:
                os.remove(os.path.join(cfg.out_dir, name))
        atomic_save({"model": model.state_dict(), **optimizer_states(optimizers),
                     "step": step, "config": asdict(cfg), "model_config": asdict(self.model_config),
                     "world_size": self.data_parallel, "simulated": bool(cfg.simulate_workers),
                     "communicator": communicator.state_dict() if communicator else {},
                     "rng": {"torch": torch.get_rng_state()}}, self.path)
        self.last_step = step
