"""
Train a Llama on token shards, one process or many, with the gradient communication written out.

    python train.py                                    # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node=4 train.py  # data parallel on one node
    torchrun --standalone --nproc_per_node=2 train.py --comm=geofp8 --whiten_rank=16

How data parallelism works here (no DistributedDataParallel wrapper, on purpose):
  1. Every rank builds the same model from the same seed, so the parameters start identical.
  2. Every rank runs forward/backward on its own micro-batches. With --grad_accum > 1 the
     gradients just accumulate in .grad: nothing is communicated on non-final micro-steps.
  3. After the last micro-step, `reduce_gradients` averages the gradients across ranks with
     explicit torch.distributed collectives. This is THE place where GeoFP8 plugs in:
       --comm=fp32    all-reduce in fp32 (the reference)
       --comm=bf16    cast to bf16, all-reduce, cast back (what most clusters send today)
       --comm=fp8     Euclidean FP8: quantize, all_to_all, reduce, re-quantize, all_gather
       --comm=geofp8  the same collective in the whitened coordinates of each layer's K-FAC
                      input factor (the published GeoFP8; see compress.py)
       --comm=subspace  ... in coordinates rotated toward the dominant subspaces (ours)
     --collective=fp8-sum swaps the two-stage collective for the paper's one FP8 all_reduce SUM.
  4. Every rank now holds bit-identical averaged gradients, clips them and takes the same
     optimizer step (AdamW; or with --optimizer=muon, Muon on the transformer blocks' matrices
     and AdamW on the rest), so the parameters stay bit-identical without ever being broadcast
     again.

Configuration: one dataclass, `TrainConfig`; every field is a flag `--name=value`. `--preset`
picks a model size and sensible defaults for it; explicit flags win. Unknown flags are an error.
One log line per step, pipe-separated; the same numbers go to out_dir/log.jsonl.
"""

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist

import compress
import model as model_lib
from prepare_data import ShardError, read_header, read_shard


# -----------------------------------------------------------------------------
# configuration

@dataclass
class TrainConfig:
    preset: str = "cpu-tiny"          # cpu-tiny | char-study | llama-300m | llama-600m | paper-*
    data_dir: str = "data/shakespeare"
    out_dir: str = "out"
    # schedule
    max_iters: int = 200
    batch_size: int = 8               # sequences per rank per micro-step
    block_size: int = 128             # tokens per sequence
    grad_accum: int = 1               # micro-steps per optimizer step
    learning_rate: float = 3e-3
    min_lr: float = 3e-4              # cosine decay floor
    warmup_iters: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0            # 0 disables clipping
    # optimizer
    optimizer: str = "adamw"          # adamw | muon (Muon on the block matrices, AdamW on the rest)
    muon_lr: float = 5e-4             # Muon's peak lr; follows learning_rate's warm-up and cosine
    muon_momentum: float = 0.9
    muon_ns_steps: int = 5            # Newton-Schulz iterations per update
    muon_adjust_lr: str = "match_rms_adamw"  # torch.optim.Muon's per-shape lr scaling
    # evaluation, logging, checkpoints
    eval_interval: int = 100          # validation loss every N steps (and at the end)
    eval_iters: int = 10              # validation batches per rank
    eval_every: int = 0               # downstream zero-shot eval (nanogeo.eval) every N steps
    eval_limit: int = 200             # ... on the first N documents of each task
    eval_tasks: str = "hellaswag,piqa,arc_easy"
    log_interval: int = 1
    ckpt_interval: int = 0            # save every N steps; 0 = only at the end
    resume: bool = False              # continue from out_dir/ckpt.pt
    overwrite: bool = False           # allow replacing another run's checkpoint in out_dir
    keep_ckpts: int = 2               # ckpt.pt plus the K-1 previous ones (ckpt-STEP.pt)
    # gradient communication
    comm: str = "fp32"                # fp32 | bf16 | fp8 | geofp8 (published) | subspace (ours)
    fmt: str = "e4m3"                 # FP8 wire format: e4m3 | e5m2 | nvfp4
    block: str = "128"                # scale granularity: elements per block, row or tensor
    collective: str = "two-stage"     # two-stage | fp8-sum (the paper's: one FP8 all_reduce SUM)
    sum_order: str = "ring"           # fp8-sum: the order the FP8 partial sums are added in
    scale_sync_every: int = 1         # fp8-sum: >1 = the published local-scale defect (ablation)
    geo_layers: str = "gain"          # gain | all | fragile:K | FILE (a list from nanogeo.profile)
    geo_refresh: int = 0              # re-estimate the geometry every N steps (0: 50 geofp8, 4 subspace)
    geo_warmup: int = 10              # steps in Euclidean coordinates before GeoFP8 starts
    geo_judge: str = "optimizer"      # a layer's coordinates by the error its optimizer sees | l2
    geo_enter_gain: float = 1.10      # a layer goes geometry-aware when its error drops this much
    geo_exit_gain: float = 1.00       # ... and leaves below this (0 and 0: the paper's fixed choice)
    whiten_factor: str = "lowrank"    # geofp8: lowrank | lowrank-dense | full | diag | block
    whiten_rank: int = 32             # geofp8: r of the low-rank input factor
    whiten_sides: str = "input"       # geofp8: input (published) | output | both
    factor_decay: float = 0.0         # geofp8: EMA of the triangular factor (published: 0.95)
    geo_rank: int = 16                # subspace: r, dominant directions per side (<= min(m,n)/2)
    error_feedback: bool = False      # add back each rank's own quantization error next step
    feedback_geo_only: bool = False   # ... on the geometry-aware matrices only (as published)
    stochastic_round: bool = False    # unbiased stochastic rounding instead of nearest
    # system
    simulate_workers: int = 0         # play W data-parallel ranks in this one process (0: off)
    device: str = "auto"              # auto | cpu | cuda
    compile: bool = False             # torch.compile the model, the codec and the transform
    seed: int = 1337
    check_every: int = 100            # all-rank parameter checksum every N steps (0 = never)


# Per-preset defaults for the training loop (the model shapes live in model.PRESETS).
TRAIN_PRESETS = {
    "cpu-tiny": dict(batch_size=8, block_size=128, learning_rate=3e-3, max_iters=200,
                     warmup_iters=20),
    # many simulated ranks on one CPU: train.py --preset=char-study --simulate_workers=32
    "char-study": dict(data_dir="data/shakespeare_char", batch_size=4, block_size=64,
                       learning_rate=3e-3, min_lr=3e-4, max_iters=2000, warmup_iters=100,
                       eval_interval=250, eval_iters=4, log_interval=50),
    "llama-300m": dict(batch_size=4, block_size=2048, grad_accum=2, learning_rate=1.5e-3,
                       min_lr=1.5e-4, max_iters=20000, warmup_iters=1000, eval_interval=500,
                       eval_iters=20, ckpt_interval=1000),
    "llama-600m": dict(batch_size=4, block_size=2048, grad_accum=2, learning_rate=1e-3,
                       min_lr=1e-4, max_iters=20000, warmup_iters=1000, eval_interval=500,
                       eval_iters=20, ckpt_interval=1000),
    # the paper's recipe: Muon (lr 5e-4 -> 5e-5, momentum 0.9, 5 Newton-Schulz steps, weight
    # decay 0.1) with AdamW (0.9, 0.95) on embeddings and gains, clip 1.0; 16K tokens per rank-step
    "paper-300m": dict(batch_size=2, block_size=4096, grad_accum=2, optimizer="muon",
                       learning_rate=5e-4, min_lr=5e-5, max_iters=20000, warmup_iters=1000,
                       eval_interval=500, eval_iters=20, ckpt_interval=1000),
    "paper-600m": dict(batch_size=4, block_size=2048, grad_accum=2, optimizer="muon",
                       learning_rate=5e-4, min_lr=5e-5, max_iters=20000, warmup_iters=1000,
                       eval_interval=500, eval_iters=20, ckpt_interval=1000),
}

CHOICES = {"comm": ("fp32", "bf16", "fp8", "geofp8", "subspace"),
           "device": ("auto", "cpu", "cuda"), "fmt": compress.FORMATS,
           "collective": compress.COLLECTIVES, "sum_order": compress.SUM_ORDERS,
           "whiten_factor": compress.WHITEN_FACTORS, "whiten_sides": compress.WHITEN_SIDES,
           "geo_judge": compress.JUDGES, "preset": tuple(model_lib.PRESETS),
           "optimizer": ("adamw", "muon"), "muon_adjust_lr": ("original", "match_rms_adamw")}


class ConfigError(ValueError):
    """A bad flag or flag combination; the message names the fix."""


def parse_value(field, text):
    kind = field.type
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{field.name} expects true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{field.name} expects {kind.__name__}, got {text!r}") from None


BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")


def parse_config(argv, config_class=TrainConfig, presets=TRAIN_PRESETS, choices=CHOICES,
                 doc=None):
    """--key=value (or --key value) flags -> config. The preset fills defaults, explicit flags
    override them. `doc` is what --help prints above the flags (the calling module's docstring)."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    given = {}
    argv = list(argv)
    while argv:
        arg = argv.pop(0)
        if arg in ("-h", "--help"):
            print(doc or __doc__)
            print("flags (default):")
            for f in fields.values():
                print(f"  --{f.name}={f.default}")
            sys.exit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; flags look like --key=value")
        key, has_value, value = arg[2:].partition("=")
        if key not in fields:
            close = [k for k in fields if k.startswith(key[:3])]
            hint = f" (did you mean --{close[0]}?)" if close else ""
            raise ConfigError(f"unknown flag --{key}{hint}; see --help for the list")
        if not has_value:   # --key value, or a bare boolean --key
            is_bool = fields[key].type is bool
            if argv and not argv[0].startswith("--") and (not is_bool or argv[0].lower() in BOOL_WORDS):
                value = argv.pop(0)
            elif is_bool:
                value = "true"
            else:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE or --{key} VALUE")
        given[key] = parse_value(fields[key], value)
    preset = given.get("preset", config_class.preset)
    if preset not in presets:
        raise ConfigError(f"unknown --preset={preset}; choose one of {', '.join(presets)}")
    config = config_class(**{**presets[preset], **given})
    for key, allowed in choices.items():
        if getattr(config, key) not in allowed:
            raise ConfigError(f"--{key}={getattr(config, key)} is not one of {', '.join(allowed)}")
    positive = ("max_iters", "batch_size", "block_size", "grad_accum", "eval_interval",
                "eval_iters", "log_interval", "geo_rank", "whiten_rank", "scale_sync_every",
                "muon_ns_steps")
    for key in positive:
        if hasattr(config, key) and getattr(config, key) < 1:
            raise ConfigError(f"--{key} must be >= 1, got {getattr(config, key)}")
    if getattr(config, "learning_rate", 1) <= 0:  # every group's lr is a multiple of it
        raise ConfigError(f"--learning_rate must be > 0, got {config.learning_rate}")
    stray = [k for k in given if k.startswith("muon_")]
    if stray and getattr(config, "optimizer", None) != "muon":
        raise ConfigError(f"--{stray[0]} applies only with --optimizer=muon")
    if hasattr(config, "block"):
        parse_block(config.block)
    return config


def parse_block(text):
    """--block: an element count, 'row' or 'tensor'."""
    if text in ("row", "tensor"):
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ConfigError(f"--block={text} must be a positive integer, row or tensor")


# -----------------------------------------------------------------------------
# data

def get_batch(tokens, batch_size, block_size, rng, device):
    """batch_size random windows of block_size + 1 tokens: inputs x and next-token targets y."""
    starts = rng.integers(0, len(tokens) - block_size - 1, size=batch_size)
    window = np.stack([tokens[s: s + block_size + 1] for s in starts]).astype(np.int64)
    window = torch.from_numpy(window).to(device)
    return window[:, :-1], window[:, 1:]                                     # (B, T) each


def batch_rng(seed, rank, step, micro, split="train"):
    """The random stream for one micro-batch, a pure function of where we are in training, so a
    resumed run reads exactly the batches the uninterrupted run would have read."""
    return np.random.default_rng([seed, rank, step, micro, split == "val"])


def load_data(cfg, vocab_size):
    shards = {}
    if not os.path.isdir(cfg.data_dir):
        raise ConfigError(f"--data_dir={cfg.data_dir} does not exist; run `python prepare_data.py` "
                          "for the bundled corpus or point --data_dir at your shards")
    for split in ("train", "val"):
        path = os.path.join(cfg.data_dir, f"{split}.bin")
        count, tokenizer_name, tokenizer_vocab = read_header(path)
        if tokenizer_vocab > vocab_size:
            raise ConfigError(f"{path} was tokenized with {tokenizer_name} ({tokenizer_vocab} ids) "
                              f"but the model has vocab_size {vocab_size}; use a matching preset "
                              "or re-tokenize")
        if count < cfg.block_size + 2:
            raise ConfigError(f"{path} has {count} tokens, fewer than --block_size + 2; "
                              "use more data or a smaller --block_size")
        shards[split] = read_shard(path)
    return shards


# -----------------------------------------------------------------------------
# gradient communication: the one seam

ring_allreduce_bytes = compress.ring_allreduce_bytes   # 2 (W - 1) / W of the buffer per rank


GEOMETRY = {"fp8": "euclidean", "geofp8": "whiten", "subspace": "subspace"}


def parse_geo_layers(text):
    """--geo_layers -> GeoOptions fields: 'gain', 'all', 'fragile:K' (the K matrices whose FP8
    sums saturate most during the warm-up) or a file listing weight names (nanogeo.profile)."""
    if text in ("gain", "all"):
        return {"select": text}
    if text.startswith("fragile:"):
        k = text.partition(":")[2]
        if not k.isdigit() or int(k) < 1:
            raise ConfigError(f"--geo_layers={text}: use fragile:K with K >= 1, e.g. fragile:4")
        return {"select": "fragile", "top_k": int(k)}
    if not os.path.isfile(text):
        raise ConfigError(f"--geo_layers={text}: not gain, all, fragile:K or an existing file; "
                          "write one with `python -m nanogeo.profile`")
    with open(text) as f:
        names = json.load(f)["selected"] if text.endswith(".json") else f.read().split()
    return {"select": "list", "geo_layers": tuple(names)}


def geo_options(cfg, vocab_size):
    """compress.GeoOptions from the training flags (shared with the DDP hook and tools)."""
    try:
        return compress.GeoOptions(
            geometry=GEOMETRY[cfg.comm], fmt=cfg.fmt, block=parse_block(cfg.block),
            collective=cfg.collective, sum_order=cfg.sum_order,
            scale_sync_every=cfg.scale_sync_every, refresh=cfg.geo_refresh, warmup=cfg.geo_warmup,
            judge=cfg.geo_judge, enter_gain=cfg.geo_enter_gain, exit_gain=cfg.geo_exit_gain,
            factor=cfg.whiten_factor, whiten_rank=cfg.whiten_rank, whiten_sides=cfg.whiten_sides,
            factor_decay=cfg.factor_decay, rank=cfg.geo_rank, error_feedback=cfg.error_feedback,
            feedback_geo_only=cfg.feedback_geo_only,
            stochastic=cfg.stochastic_round, seed=cfg.seed, vocab_size=vocab_size,
            **parse_geo_layers(cfg.geo_layers))
    except ValueError as e:     # a combination GeoOptions rejects; its message names the fix
        raise ConfigError(str(e)) from None


def make_communicator(cfg, model, optimizers):
    """State that survives between steps for the compressed collectives (geometry, residuals),
    and for the published GeoFP8 the hooks that collect its layers' input statistics.
    (None, None) for fp32 and bf16, which are stateless. The candidates for GeoFP8 are the
    nn.Linear weights (by module type), each judged by the error its optimizer sees."""
    if cfg.comm in ("fp32", "bf16"):
        return None, None
    named = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
    communicator = compress.GeoFP8Communicator(named, geo_options(cfg, model.config.vocab_size),
                                               linear=set(compress.linear_layers(model)))
    communicator.watch(compress.optimizer_views(optimizers, model))
    moments = None
    if communicator.moment_layers():
        layers = compress.linear_layers(model, communicator.moment_layers())
        # its hooks are attached in train() for the forwards of refresh steps only
        moments = compress.KroneckerMoments(layers, sides=communicator.whitened_sides())
    return communicator, moments


@torch.no_grad()
def reduce_simulated(params, worker_grads, cfg, communicator, worker_moments=None):
    """--simulate_workers: set each param's .grad to the mean of the W simulated ranks'
    gradients (worker_grads[i]: rank i's, in params order), through exactly the numerics of the
    collective a W-rank run uses: the same sum in the wire's dtype for fp32 / bf16 (equal, bit
    for bit, to a 2-rank gloo run), the collective's simulator for the compressed methods.
    Returns the bytes each rank would send."""
    world = len(worker_grads)
    if cfg.comm in ("fp32", "bf16"):
        dtype = torch.float32 if cfg.comm == "fp32" else torch.bfloat16
        means = []
        for grads in zip(*worker_grads):
            total = grads[0].to(dtype)
            for g in grads[1:]:
                total = total + g.to(dtype)         # the all_reduce SUM, in the wire's dtype
            means.append(total.float() / world)
        numel = sum(g.numel() for g in worker_grads[0])
        sent = ring_allreduce_bytes(numel, dtype.itemsize, world) if world > 1 else 0
    else:   # worker_moments: each rank's whitening statistics, on the steps that collect them
        means, sent = communicator.reduce_workers(worker_grads, worker_moments or None)
    for p, mean in zip(params, means):
        p.grad = mean
    return sent


@torch.no_grad()
def reduce_gradients(params, cfg, communicator, world_size, moments=None):
    """Average the .grad of params across all ranks, in place. Returns the bytes this rank sent.

    Called once per optimizer step, after the last micro-step's backward."""
    grads = [p.grad for p in params]
    if cfg.comm in ("fp32", "bf16"):
        if world_size == 1:
            if cfg.comm == "bf16":  # one process still sees the bf16 rounding, for ablations
                for g in grads:
                    g.copy_(g.bfloat16())
            return 0
        dtype = torch.float32 if cfg.comm == "fp32" else torch.bfloat16
        flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype)  # one bucket, one collective
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat = flat.float().div_(world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        return ring_allreduce_bytes(flat.numel(), flat.new_empty((), dtype=dtype).element_size(),
                                    world_size)
    # The published GeoFP8 refreshes its factors from its layers' input statistics, which
    # forward pre-hooks (`moments`) collected during this step's forward passes on refresh steps.
    stats = moments.take() if moments is not None and communicator.wants_moments() else None
    return communicator.reduce(grads, stats)


# -----------------------------------------------------------------------------
# helpers

def learning_rate(cfg, step):
    """Linear warm-up, then cosine decay from learning_rate to min_lr at max_iters."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizers(cfg, model, fused=False):
    """[AdamW], or [Muon, AdamW] with --optimizer=muon (Muon on the transformer blocks'
    matrices, AdamW on the rest), stepped together. AdamW is always the last one."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        return list(model.configure_muon(cfg.weight_decay, cfg.learning_rate, betas, cfg.muon_lr,
                                         cfg.muon_momentum, cfg.muon_ns_steps,
                                         cfg.muon_adjust_lr, fused=fused))
    return [model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, fused=fused)]


def optimizer_states(optimizers):
    """The checkpoint's optimizer entries: AdamW under "optimizer", Muon under "muon"."""
    *muon, adamw = optimizers
    return {"optimizer": adamw.state_dict(), "muon": muon[0].state_dict() if muon else {}}


def load_optimizers(optimizers, ckpt):
    *muon, adamw = optimizers
    adamw.load_state_dict(ckpt["optimizer"])
    if muon:
        muon[0].load_state_dict(ckpt["muon"])


def peak_lrs(optimizers):
    """Each param group's peak learning rate, as the optimizers were built."""
    return [[group["lr"] for group in o.param_groups] for o in optimizers]


def set_learning_rates(optimizers, peaks, lr, base_lr):
    """One warm-up and cosine for every group, scaled to the group's own peak (lr / base_lr is
    the schedule's factor; peak / base_lr is exactly 1.0 for AdamW's groups)."""
    for o, group_peaks in zip(optimizers, peaks):
        for group, peak in zip(o.param_groups, group_peaks):
            group["lr"] = lr * (peak / base_lr)


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12,
                   "L40S": 362e12, "A10": 125e12, "4090": 165e12}


def peak_flops(device):
    """Dense bf16 peak of the GPU, for MFU; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return flops
    return None


def parameter_checksum(params):
    """sha256 of every parameter's bytes: equal on two ranks iff their parameters are bitwise equal."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def gradients_finite(grads, world_size):
    """True on every rank iff no rank has a NaN/inf gradient: one 1-element all-reduce and one
    transfer to the host (the flags of all tensors are combined on the device)."""
    bad = torch.stack([~torch.isfinite(g).all() for g in grads]).any().float().reshape(1)
    if world_size > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


class RankMismatch(RuntimeError):
    """Parameters differ across ranks: the run cannot continue meaningfully."""


def check_ranks_agree(params, step, device):
    """All ranks must hold bitwise-identical parameters. One all-reduce of a checksum (MAX of
    c and of -c: equal on every rank iff every rank's c is the same) checks it."""
    checksum = torch.zeros((), dtype=torch.float64, device=device)
    for i, p in enumerate(params):
        checksum += p.detach().double().sum() * (1 + (i % 7) / 7)
    both = torch.stack([checksum, -checksum])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if both[0].item() != checksum.item() or -both[1].item() != checksum.item():
        raise RankMismatch(f"parameters differ across ranks at step {step}; a rank diverged "
                           "(nondeterministic kernel, bad hardware or a code change on one node): "
                           "restart from the last checkpoint")


# what a checkpoint's numbers depend on: resuming with any of these changed would silently load
# mismatched geometry, optimizer state or residuals
RESUME_MUST_MATCH = ("preset", "optimizer", "comm", "fmt", "block", "collective", "geo_rank",
                     "whiten_factor", "whiten_rank", "whiten_sides", "error_feedback")


def open_checkpoint(cfg, ckpt_path, world_size, device, master):
    """The checkpoint to resume from (None for a fresh run), after checking that it is this
    run's. A fresh run with --overwrite first moves an existing one aside (to ckpt.pt.old), so
    that an elastic restart before its first save cannot resume the replaced run."""
    if not cfg.resume:
        if os.path.exists(ckpt_path) and not cfg.overwrite:
            raise ConfigError(f"{cfg.out_dir} already holds another run's checkpoint; pass --resume "
                              "to continue it, --overwrite=true to replace it, or choose another "
                              "--out_dir")
        if os.path.exists(ckpt_path) and master:
            os.replace(ckpt_path, ckpt_path + ".old")
            for name in os.listdir(cfg.out_dir):
                if name.startswith("residuals-rank"):
                    os.remove(os.path.join(cfg.out_dir, name))
        if dist.is_initialized():
            dist.barrier()          # no rank looks for a checkpoint before it is moved
        return None
    if not os.path.exists(ckpt_path):
        raise ConfigError(f"--resume but {ckpt_path} does not exist; drop --resume to start fresh")
    ckpt = torch.load(ckpt_path, map_location=device, weights_only=True)
    saved = {"optimizer": "adamw", **ckpt["config"]}
    for flag in RESUME_MUST_MATCH:
        if flag in saved and saved[flag] != getattr(cfg, flag):
            raise ConfigError(f"{ckpt_path} is a --{flag}={saved[flag]} run; resume it with that "
                              f"setting or use another --out_dir")
    saved_world = ckpt.get("world_size", world_size)
    if cfg.error_feedback and saved_world != world_size:
        raise ConfigError(f"{ckpt_path} keeps error-feedback residuals for {saved_world} ranks; "
                          f"resume on {saved_world} ranks or start a new run")
    if cfg.error_feedback and ckpt.get("simulated", False) != bool(cfg.simulate_workers):
        was = "simulated ranks (--simulate_workers)" if ckpt.get("simulated") else "real ranks"
        raise ConfigError(f"{ckpt_path} keeps error-feedback residuals of {was}; resume it the "
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


def setup_distributed(cfg):
    """(rank, world_size, local_rank, device). torchrun sets RANK/WORLD_SIZE/LOCAL_RANK."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but no GPU is visible; use --device=cpu")
    if "RANK" not in os.environ:
        return 0, 1, 0, torch.device("cuda" if use_cuda else "cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # After an elastic restart (torchrun --max-restarts) the new workers meet in the same agent
    # store as the dead ones; a key space per attempt keeps a restarted rank from reading a dead
    # peer's address (gloo then fails with "Connection refused").
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                            store=dist.PrefixStore(f"nanogeo/attempt{attempt}", store),
                            rank=rank, world_size=world_size,
                            device_id=device if use_cuda else None)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


# -----------------------------------------------------------------------------
# training

def train(cfg):
    rank, world_size, _, device = setup_distributed(cfg)
    master = rank == 0
    # the data-parallel ranks whose batches this process computes: its own, or all W simulated
    if cfg.simulate_workers < 0:
        raise ConfigError("--simulate_workers must be >= 0 (0: off)")
    if cfg.simulate_workers and world_size > 1:
        raise ConfigError("--simulate_workers plays every rank in one process; run it with "
                          "python, not torchrun")
    my_ranks = list(range(cfg.simulate_workers)) if cfg.simulate_workers else [rank]
    data_parallel = cfg.simulate_workers or world_size
    log = print if master else (lambda *a, **k: None)
    torch.manual_seed(cfg.seed)  # same seed on every rank: identical initial parameters
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts and os.path.exists(ckpt_path):  # torchrun --max-restarts brought us back
        cfg = dataclasses.replace(cfg, resume=True)
    # checked before anything is built: fail in a second, not after a minute
    ckpt = open_checkpoint(cfg, ckpt_path, data_parallel, device, master)

    mcfg = model_lib.model_config(cfg.preset, block_size=cfg.block_size)
    data = load_data(cfg, mcfg.vocab_size)
    raw_model = model_lib.Llama(mcfg).to(device)
    model = torch.compile(raw_model, dynamic=False) if cfg.compile else raw_model
    compress.compile_hot_path(cfg.compile)      # the codec and transform kernels too
    params = [p for p in raw_model.parameters() if p.requires_grad]
    optimizers = make_optimizers(cfg, raw_model, fused=device.type == "cuda")
    peaks = peak_lrs(optimizers)    # read before a checkpoint overwrites "lr" with its last value
    communicator, moments = make_communicator(cfg, raw_model, optimizers)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    start_step = 0
    if ckpt is not None:
        raw_model.load_state_dict(ckpt["model"])
        load_optimizers(optimizers, ckpt)
        if communicator is not None and ckpt.get("communicator"):
            communicator.load_state_dict(ckpt["communicator"])
            if cfg.error_feedback and world_size > 1:   # every rank's own residual
                communicator.residuals = {rank: load_residuals(cfg.out_dir, rank, ckpt["step"],
                                                               device)}
        start_step = ckpt["step"]
        if "rng" in ckpt:
            torch.set_rng_state(ckpt["rng"]["torch"].cpu())
        log(f"resumed from {ckpt_path} at step {start_step}"
            + (f" (elastic restart {restarts})" if restarts else ""))

    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)

    log(f"config: {json.dumps(asdict(cfg))}")
    log(f"model: {cfg.preset}, {raw_model.num_params() / 1e6:.2f}M parameters | world_size "
        f"{world_size} | device {device} | backend {dist.get_backend() if world_size > 1 else '-'}"
        + (f" | simulating {data_parallel} data-parallel ranks" if cfg.simulate_workers else ""))
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * data_parallel
    flops_per_step = raw_model.flops_per_token(cfg.block_size) * tokens_per_step
    peak = peak_flops(device)
    n_grad = sum(p.numel() for p in params)
    bf16_ring_bytes = ring_allreduce_bytes(n_grad, 2, data_parallel)

    @torch.no_grad()
    def evaluate():
        model.eval()
        per_rank = []
        for r in my_ranks:
            losses = []
            for k in range(cfg.eval_iters):
                # fixed validation batches: the same windows at every evaluation
                x, y = get_batch(data["val"], cfg.batch_size, cfg.block_size,
                                 batch_rng(cfg.seed, r, 0, k, "val"), device)
                with autocast:
                    losses.append(model(x, y)[1].float())
            per_rank.append(torch.stack(losses).mean())
        loss = torch.stack(per_rank).sum()
        if world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss /= data_parallel
        model.train()
        return loss.item()

    saved = {"step": start_step if ckpt is not None else None}  # this run's latest ckpt.pt

    def save(step):
        if communicator is not None and cfg.error_feedback and world_size > 1:
            save_residuals(communicator.residuals.get(rank, {}), cfg.out_dir, rank, step)
            dist.barrier()      # every rank's residual is on disk before ckpt.pt names the step
        if not master:
            return
        if saved["step"] is not None and cfg.keep_ckpts > 1:  # keep the previous ones too
            os.replace(ckpt_path, os.path.join(cfg.out_dir, f"ckpt-{saved['step']:07d}.pt"))
            old = sorted(f for f in os.listdir(cfg.out_dir) if f.startswith("ckpt-"))
            for name in old[: max(0, len(old) - (cfg.keep_ckpts - 1))]:
                os.remove(os.path.join(cfg.out_dir, name))
        atomic_save({"model": raw_model.state_dict(), **optimizer_states(optimizers),
                     "step": step, "config": asdict(cfg), "model_config": asdict(mcfg),
                     "world_size": data_parallel, "simulated": bool(cfg.simulate_workers),
                     "communicator": communicator.state_dict() if communicator else {},
                     "rng": {"torch": torch.get_rng_state()}}, ckpt_path)
        saved["step"] = step

    # a resumed run continues its log; a fresh one starts it anew
    jsonl = open(os.path.join(cfg.out_dir, "log.jsonl"), "a" if cfg.resume else "w") if master else None
    first_val = evaluate() if start_step == 0 else None
    if first_val is not None:
        log(f"step {start_step} | val loss {first_val:.4f}")
    val_loss = first_val if first_val is not None else float("nan")  # resumed: not yet measured
    train_loss = float("nan")
    t_start = time.time()
    local = delivered = None        # the last step's gradients, kept for the summary
    for step in range(start_step, cfg.max_iters):
        t0 = time.time()
        lr = learning_rate(cfg, step)
        set_learning_rates(optimizers, peaks, lr, cfg.learning_rate)
        loss_sum = 0.0
        # on the published GeoFP8's refresh steps, hooks collect the whitened layers' input
        # statistics; those forwards run eagerly, so a compiled graph never contains the hooks
        collect = moments is not None and communicator.wants_moments()
        if collect:
            moments.attach()
        forward = raw_model if collect else model
        worker_grads, worker_moments = [], []   # --simulate_workers: each simulated rank's
        for r in my_ranks:
            for micro in range(cfg.grad_accum):
                x, y = get_batch(data["train"], cfg.batch_size, cfg.block_size,
                                 batch_rng(cfg.seed, r, step, micro), device)
                with autocast:
                    _, loss = forward(x, y)
                # .grad accumulates locally; no communication until the last micro-step
                (loss / cfg.grad_accum).backward()
                if r == my_ranks[0]:
                    loss_sum += loss.item()
            if cfg.simulate_workers:        # take this rank's gradients; the next starts at 0
                worker_grads.append([p.grad for p in params])
                for p in params:
                    p.grad = None
                if collect:
                    worker_moments.append(moments.take())
        if collect:
            moments.detach()
        grads = [g for w in worker_grads for g in w] or [p.grad for p in params]
        if not gradients_finite(grads, world_size):
            # skipped on every rank alike; geometry and error-feedback state stay untouched
            log(f"step {step + 1}: warning: non-finite gradient on some rank; step skipped")
            if collect:
                moments.take()      # this step's statistics go with it
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            continue
        last = communicator is not None and step + 1 == cfg.max_iters
        if last:        # kept for the end-of-run comparison with Euclidean FP8
            local = [[g.clone() for g in w] for w in worker_grads] or [g.clone() for g in grads]
            coords = [communicator.coords(n) for n in communicator.names]   # as sent
        if cfg.simulate_workers:
            wire_bytes = reduce_simulated(params, worker_grads, cfg, communicator, worker_moments)
        else:
            wire_bytes = reduce_gradients(params, cfg, communicator, world_size, moments)
        if last:
            delivered = [p.grad.clone() for p in params]
        grad_norm = (torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0
                     else torch.norm(torch.stack([p.grad.norm() for p in params])))
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        if cfg.check_every and world_size > 1 and (step + 1) % cfg.check_every == 0:
            check_ranks_agree(params, step + 1, device)
        train_loss = loss_sum / cfg.grad_accum  # this rank's loss; ranks differ by their data
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0

        done = step + 1
        if done % cfg.eval_interval == 0 or done == cfg.max_iters:
            val_loss = evaluate()
            if cfg.comm in ("geofp8", "subspace") and done > cfg.geo_warmup:
                log(f"GeoFP8 layers at step {done}:\n{communicator.table()}")
        if done % cfg.log_interval == 0 or done == cfg.max_iters:
            record = {"step": done, "loss": train_loss, "val_loss": val_loss, "lr": lr,
                      "grad_norm": float(grad_norm), "dt_ms": 1000 * dt,
                      "tok_per_s": tokens_per_step / dt,
                      "mfu": flops_per_step / dt / (peak * world_size) if peak else None,
                      "wire_bytes": wire_bytes,
                      "wire_vs_bf16": wire_bytes / bf16_ring_bytes if data_parallel > 1 else None}
            mfu = f"{100 * record['mfu']:.1f}%" if peak else "-"
            ratio = f"{record['wire_vs_bf16']:.3f}" if data_parallel > 1 else "-"
            log(f"step {done} | loss {train_loss:.4f} | val {val_loss:.4f} | lr {lr:.2e} | "
                f"dt {1000 * dt:.0f}ms | tok/s {record['tok_per_s']:.0f} | mfu {mfu} | "
                f"wire {wire_bytes / 1e6:.2f}MB ({ratio}x bf16)")
            if jsonl:
                jsonl.write(json.dumps(record) + "\n")
                jsonl.flush()
        if cfg.eval_every and done % cfg.eval_every == 0:
            # every rank scores its share of the requests (no rank waits on another's evaluation
            # in a collective, which a long one would time out); rank 0 logs the result
            from nanogeo import eval as downstream
            scores = downstream.evaluate_model(raw_model, cfg.eval_tasks.split(","), cfg.eval_limit,
                                               cfg.batch_size, device, quiet=True)
            log(f"step {done} | downstream | " + " | ".join(
                f"{t} {r.get('acc_norm', r['acc']):.4f}" for t, r in scores.items()))
            if jsonl:
                jsonl.write(json.dumps({"step": done, "downstream": {
                    t: {k: v for k, v in r.items() if not isinstance(v, list)}
                    for t, r in scores.items()}}) + "\n")
        if cfg.ckpt_interval and done % cfg.ckpt_interval == 0 and done < cfg.max_iters:
            save(done)
    save(cfg.max_iters)
    elapsed = time.time() - t_start
    if delivered is not None:       # the last step, measured against Euclidean FP8
        from nanogeo import summary as comm_summary
        log(comm_summary.last_step_report(communicator, local, delivered, coords, data_parallel,
                                          simulated=bool(cfg.simulate_workers)))
    steps_run = cfg.max_iters - start_step
    summary = {"final_train_loss": train_loss, "final_val_loss": val_loss,
               "initial_val_loss": first_val, "steps": steps_run,
               "tokens_seen": steps_run * tokens_per_step, "time_s": elapsed,
               "ms_per_step": 1000 * elapsed / max(1, steps_run),
               "param_sha256": parameter_checksum(params)}
    log(f"summary | train loss {train_loss:.4f} | val loss {val_loss:.4f}"
        + (f" (from {first_val:.4f})" if first_val is not None else "")
        + f" | {summary['tokens_seen']:,} tokens | {elapsed:.1f}s ({summary['ms_per_step']:.0f}ms/step)"
        + f" | checkpoint {ckpt_path}")
    if jsonl:
        jsonl.write(json.dumps({"summary": summary}) + "\n")
        jsonl.close()
    if world_size > 1:
        dist.destroy_process_group()
    return summary


def main(argv=None):
    try:
        cfg = parse_config(sys.argv[1:] if argv is None else argv)
        return train(cfg)
    except (ConfigError, ShardError, RankMismatch) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


if __name__ == "__main__":
    main()
