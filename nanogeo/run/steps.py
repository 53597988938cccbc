"""
The pieces of a training step that train.py and the tools share: batches, optimizers, the
learning-rate schedule. train.py imports them from here (so `train.get_batch` and the others
still name them), and so do nanogeo.lab.capture and nanogeo.lab.bench: the tools replay
train.py's steps without importing train.py.

    get_batch, batch_rng           which token windows a rank reads at a step (a pure function
                                   of seed, rank, step and micro-step: a resumed run reads the
                                   batches the uninterrupted one would have)
    make_optimizers                [AdamW], or [Muon, AdamW] with optimizer="muon"
    warmup_cosine                  linear warm-up, then cosine decay to a floor
    peak_lrs, set_learning_rates   one schedule for every param group, scaled to its own peak
"""

import math

import numpy as np
import torch


# -----------------------------------------------------------------------------
# data

def get_batch(tokens, batch_size, block_size, rng, device):
    """batch_size random windows of block_size + 1 tokens: inputs x and next-token targets y.

    On a GPU the batch is copied from page-locked (pinned) host memory, non_blocking: a copy
    from ordinary (pageable) memory goes through a staging buffer and makes the host wait for
    it, every step; from pinned memory the GPU's copy engine reads it while the host goes on
    (the step's kernels queue behind it on the stream, so nothing reads it early, and torch's
    pinned-memory cache keeps the buffer until the copy is done). On the CPU: a plain copy."""
    starts = rng.integers(0, len(tokens) - block_size - 1, size=batch_size)
    window = np.stack([tokens[s: s + block_size + 1] for s in starts]).astype(np.int64)
    window = torch.from_numpy(window)                                         # (B, T + 1)
    if torch.device(device).type == "cuda":
        window = window.pin_memory().to(device, non_blocking=True)
    else:
        window = window.to(device)
    return window[:, :-1], window[:, 1:]                                     # (B, T) each


def batch_rng(seed, rank, step, micro, split="train"):
    """The random stream for one micro-batch, a pure function of where we are in training, so a
    resumed run reads exactly the batches the uninterrupted run would have read."""
    return np.random.default_rng([seed, rank, step, micro, split == "val"])


# -----------------------------------------------------------------------------
# optimizers and the learning-rate schedule

def make_optimizers(cfg, model, fused=False):
    """[AdamW], or [Muon, AdamW] with --optimizer=muon (Muon on the transformer blocks'
    matrices, AdamW on the rest), stepped together. AdamW is always the last one.

    cfg: any config with the optimizer's fields (optimizer, learning_rate, weight_decay, beta1,
    beta2, muon_lr, muon_momentum, muon_ns_steps, muon_adjust_lr): train.py's TrainConfig, or a
    tool's own (nanogeo.lab.capture's CaptureConfig)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        return list(model.configure_muon(cfg.weight_decay, cfg.learning_rate, betas, cfg.muon_lr,
                                         cfg.muon_momentum, cfg.muon_ns_steps,
                                         cfg.muon_adjust_lr, fused=fused))
    return [model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, fused=fused)]


def warmup_cosine(step, peak_lr, min_lr, warmup_iters, max_iters):
    """Linear warm-up to peak_lr over warmup_iters steps, then cosine decay from peak_lr to
    min_lr at max_iters (and min_lr after it)."""
    if step < warmup_iters:
        return peak_lr * (step + 1) / warmup_iters
    progress = min(1.0, (step - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (peak_lr - min_lr)


def peak_lrs(optimizers):
    """Each param group's peak learning rate, as the optimizers were built."""
    return [[group["lr"] for group in o.param_groups] for o in optimizers]


def set_learning_rates(optimizers, peaks, lr, base_lr):
    """One warm-up and cosine for every group, scaled to the group's own peak (lr / base_lr is
    the schedule's factor; peak / base_lr is exactly 1.0 for AdamW's groups)."""
    for o, group_peaks in zip(optimizers, peaks):
        for group, peak in zip(o.param_groups, group_peaks):
            group["lr"] = lr * (peak / base_lr)
