"""
Checkpoints of train.py: what a resumable run writes, and the checks that refuse to resume a
run with other numerics.

out_dir/ckpt.pt holds the model, the optimizers, the step, the config, the communicator's state
(GeoFP8 geometry) and the RNG; with error feedback every rank also writes its own residual file
next to it (residuals-rankRRRRR-stepSSSSSSS.pt). Writes are atomic (temp file, fsync, rename),
so a crash never leaves a half-written checkpoint, and the K-1 previous checkpoints are kept as
ckpt-STEP.pt (a second name of the old ckpt.pt, made before the new one replaces it: at no
moment is there no ckpt.pt).

A ckpt.pt that does not load (a disk that filled up, a copy cut short) is not the end of the
run: --resume warns, naming it, keeps it as ckpt.pt.damaged and continues from the newest
ckpt-STEP.pt that loads (a missing ckpt.pt too, with a warning). Every rank tries the same files
in the same order and a file counts only if it loads on every rank, so all ranks resume from the
same step. With none that loads, --resume stops with one line naming them all.

Every rank reads the same files, so --resume needs out_dir on a filesystem that every rank
shares (on several nodes: a shared mount). Rank 0 decides what there is to resume and every rank
follows it; a rank that does not see rank 0's files stops the run on every rank with one line
naming that requirement, instead of taking another branch than rank 0 (which would hang in the
next collective).
"""
import contextlib
import os
import re
import shutil
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from nanogeo.run.config import ConfigError


def ckpt_path(cfg):
    return os.path.join(cfg.out_dir, "ckpt.pt")


KEPT_NAME = re.compile(r"ckpt-(\d+)\.pt")      # an earlier checkpoint, kept: ckpt-0000004.pt


def kept_name(step):
    return f"ckpt-{step:07d}.pt"


def kept_checkpoints(out_dir):
    """The names of the kept earlier checkpoints in out_dir, oldest first."""
    kept = {m.group(0): int(m.group(1)) for m in map(KEPT_NAME.fullmatch, os.listdir(out_dir)) if m}
    return sorted(kept, key=kept.get)


# what a checkpoint's numbers depend on: resuming with any of these changed would silently load
# mismatched geometry, optimizer state or residuals
RESUME_MUST_MATCH = ("preset", "optimizer", "comm", "fmt", "block", "collective", "geo_rank",
                     "whiten_factor", "whiten_rank", "whiten_sides", "hadamard_block", "hadamard_sides",
                     "error_feedback", "feedback_stages", "stage2_fmt", "bucket_mb")


def open_checkpoint(cfg, world_size, device, master, restarted=False):
    """(cfg, checkpoint, its path) to resume from, after checking that it is this run's; (cfg,
    None, None) for a fresh run. `restarted`: torchrun --max-restarts brought the ranks back, and
    the run resumes (cfg.resume set) if out_dir holds a checkpoint - as rank 0 sees it: every
    rank takes rank 0's decision. A fresh run with --overwrite first moves the checkpoints there
    aside (ckpt.pt to ckpt.pt.old, ckpt-STEP.pt to ckpt-STEP.pt.old), so that neither an elastic
    restart before its first save nor a fallback from a damaged ckpt.pt resumes the replaced
    run, and no save of this run removes the replaced run's files."""
    names = on_every_rank(resume_candidates(cfg.out_dir) if master else None)
    if restarted and names:
        cfg = replace(cfg, resume=True)
    if not cfg.resume:
        if names and not cfg.overwrite:
            raise ConfigError(f"{cfg.out_dir} already holds another run's checkpoint; pass --resume "
                              "to continue it, --overwrite=true to replace it, or choose another "
                              "--out_dir")
        if names and master:
            for name in names:
                moved = os.path.join(cfg.out_dir, name)
                os.replace(moved, moved + ".old")
            for name in os.listdir(cfg.out_dir):
                if name.startswith("residuals-rank"):
                    os.remove(os.path.join(cfg.out_dir, name))
        if dist.is_initialized():
            dist.barrier()          # no rank looks for a checkpoint before it is moved
        return cfg, None, None
    require_shared(cfg.out_dir, names)
    path = ckpt_path(cfg)
    if not names:
        raise ConfigError(f"--resume but {path} does not exist; drop --resume to start fresh")
    chosen, ckpt, unreadable = first_intact([os.path.join(cfg.out_dir, n) for n in names], device)
    if ckpt is None:
        raise ConfigError(f"--resume but no checkpoint in {cfg.out_dir} loads: "
                          + "; ".join(f"{p} ({why})" for p, why in unreadable)
                          + "; restore one of them, or start a new run with --overwrite=true")
    check_resumable(ckpt, chosen, cfg, world_size)
    if master:      # only now: a refused resume leaves every file where it was
        if names[0] != "ckpt.pt":
            print(f"train.py: warning: {path} is missing; resuming from {chosen}", flush=True)
        for bad, why in unreadable:
            print(f"train.py: warning: {bad} does not load ({why}); kept as {keep_damaged(bad)}; "
                  f"resuming from {chosen}", flush=True)
    return cfg, ckpt, chosen


def resume_candidates(out_dir):
    """The checkpoints in out_dir in the order a resume tries them: ckpt.pt, then the kept
    ckpt-STEP.pt newest first (names; empty if there are none)."""
    if not os.path.isdir(out_dir):
        return []
    latest = ["ckpt.pt"] if os.path.exists(os.path.join(out_dir, "ckpt.pt")) else []
    return latest + kept_checkpoints(out_dir)[::-1]


def on_every_rank(value):
    """Rank 0's value on every rank (a broadcast; the value itself without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_every_rank_gathered(value):
    """[each rank's value], on every rank (an all-gather; [value] without a process group)."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


SHARED = ("a resume needs --out_dir on a filesystem that every rank shares (on several nodes: a "
          "shared mount; docs/guide.md)")


def require_shared(out_dir, names):
    """Every rank sees the checkpoints rank 0 found in out_dir (`names`), or every rank stops
    with one line naming the ranks that do not and the shared-filesystem requirement."""
    paths = [os.path.join(out_dir, n) for n in names]
    missing = [p for p in paths if not os.path.exists(p)]
    blind = [(r, m) for r, m in enumerate(on_every_rank_gathered(missing)) if m]
    if blind:
        ranks = ("rank " if len(blind) == 1 else "ranks ") + ", ".join(str(r) for r, _ in blind)
        raise ConfigError(f"{ranks} cannot see {blind[0][1][0]}, which rank 0 resumes from: "
                          f"{SHARED}")


def first_intact(paths, device):
    """(path, checkpoint, [(path, why)] of those tried before it) for the first of `paths` that
    loads on every rank; (None, None, every path with why) if none does. Every rank tries the
    same paths in the same order and one all-reduce per file tells them all whether it loaded
    everywhere, so every rank returns the same path."""
    unreadable = []
    for path in paths:
        ckpt, why = load_checkpoint(path, device)
        if loads_on_every_rank(ckpt is not None, device):
            return path, ckpt, unreadable
        unreadable.append((path, why or "does not load on another rank"))
    return None, None, unreadable


def load_checkpoint(path, device):
    """(checkpoint, None), or (None, why) for a file that does not load or is no train.py
    checkpoint; why is one line."""
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:      # whatever the damage: a truncated zip, a bad pickle, an I/O error
        return None, first_sentence(e)
    if not isinstance(ckpt, dict) or not {"model", "step", "config"} <= ckpt.keys():
        return None, "not a train.py checkpoint"
    return ckpt, None


def first_sentence(error):
    """What went wrong, short: torch's messages go on for lines about how to load anyway."""
    return str(error).strip().split("\n")[0].split(". ")[0].rstrip(".") or type(error).__name__


def loads_on_every_rank(loaded, device):
    """True on every rank iff `loaded` is True on every rank (one 1-element all-reduce)."""
    if not dist.is_initialized():
        return loaded
    failed = torch.tensor([0.0 if loaded else 1.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return failed.item() == 0


def keep_damaged(path):
    """Rename a checkpoint that does not load to PATH.damaged (PATH.damaged.2, ... if an
    earlier one is there: none is ever overwritten); returns the new name. Kept, not deleted:
    it is the user's, and may be worth a look. Not ckpt-*.pt, so no later save removes it."""
    kept, n = path + ".damaged", 1
    while os.path.exists(kept):
        n += 1
        kept = f"{path}.damaged.{n}"
    os.replace(path, kept)
    return kept


def stage2_format(config):
    """The format stage 2 sends in ("" and --fmt's own name mean the same)."""
    return config.get("stage2_fmt") or config.get("fmt", "e4m3")


def check_resumable(ckpt, path, cfg, world_size):
    """Refuse, naming the fix, a checkpoint whose numerics differ from this run's."""
    # (older checkpoints: AdamW, stage 2 in --fmt, the model as one bucket)
    saved = {"optimizer": "adamw", "stage2_fmt": "", "bucket_mb": 0.0, **ckpt["config"]}
    for flag in (f for f in RESUME_MUST_MATCH if f in saved):
        ours, theirs = (stage2_format(c) if flag == "stage2_fmt" else c[flag]
                        for c in (vars(cfg), saved))
        if theirs != ours:
            shown = saved[flag] if saved[flag] != "" else "''"
            raise ConfigError(f"{path} is a --{flag}={shown} run; resume it with that "
                              f"setting or use another --out_dir")
    saved_world = ckpt.get("world_size", world_size)
    if cfg.error_feedback and saved_world != world_size:
        raise ConfigError(f"{path} keeps error-feedback residuals for {saved_world} ranks; "
                          f"resume on {saved_world} ranks or start a new run")
    if cfg.error_feedback and ckpt.get("simulated", False) != bool(cfg.simulate_workers):
        was = "simulated ranks (--simulate_workers)" if ckpt.get("simulated") else "real ranks"
        raise ConfigError(f"{path} keeps error-feedback residuals of {was}; resume it the "
                          "same way or start a new run")
    if cfg.error_feedback and dist.is_initialized() and dist.get_world_size() > 1:
        # every rank resumes its own residual: each looks for its own file, all learn of any gap
        mine = residuals_path(cfg.out_dir, dist.get_rank(), ckpt["step"])
        missing = [p for p in on_every_rank_gathered(None if os.path.exists(mine) else mine) if p]
        if missing:
            raise ConfigError(f"{missing[0]} is missing: with --error_feedback every rank resumes "
                              "its own residual; restore the file or start a new run")


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
    """This rank's residual (check_resumable has seen that every rank's file is there)."""
    path = residuals_path(out_dir, rank, step)
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ConfigError(f"{path} does not load ({first_sentence(e)}); restore the file or "
                          "start a new run") from e


def atomic_save(obj, path):
    """Write to a temp file, fsync, rename: a crash never leaves a half-written checkpoint."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def keep_copy(path, kept):
    """Make `kept` a second name of the file `path` (a hard link: nothing is copied, and `path`
    stays where it is until a new file replaces it); a copy on filesystems without hard links.
    Through a temp name, so `kept` is never half there."""
    tmp = kept + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)          # left over by a crash
    try:
        os.link(path, tmp)
    except OSError:
        shutil.copyfile(path, tmp)
    os.replace(tmp, kept)


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
        self.last_step = last_step          # the step of the ckpt.pt in out_dir, if there is one

    def save(self, step, model, optimizers, communicator):
        cfg = self.cfg
        if communicator is not None and cfg.error_feedback and self.world_size > 1:
            save_residuals(communicator.residuals.get(self.rank, {}), cfg.out_dir, self.rank, step)
            dist.barrier()      # every rank's residual is on disk before ckpt.pt names the step
        if self.rank != 0:
            return
        if self.last_step is not None and cfg.keep_ckpts > 1:   # keep the previous ones too
            keep_copy(self.path, os.path.join(cfg.out_dir, kept_name(self.last_step)))
            kept = kept_checkpoints(cfg.out_dir)
            for name in kept[: max(0, len(kept) - (cfg.keep_ckpts - 1))]:
                os.remove(os.path.join(cfg.out_dir, name))
        atomic_save({"model": model.state_dict(), **optimizer_states(optimizers),
                     "step": step, "config": asdict(cfg), "model_config": asdict(self.model_config),
                     "world_size": self.data_parallel, "simulated": bool(cfg.simulate_workers),
                     "communicator": communicator.state_dict() if communicator else {},
                     "rng": {"torch": torch.get_rng_state()}}, self.path)
        self.last_step = step
