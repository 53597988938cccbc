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
     explicit torch.distributed collectives, a bucket of --bucket_mb MiB at a time (as DDP
     does: nanogeo/wire/buckets.py), each mean written back into .grad before the next bucket.
     This is THE place where the compressed, geometry-aware communication plugs in:
       --comm=auto    (the default) what the study recommends for the optimizer in force:
                      Muon -> subspace (fp8 from 46 ranks: W = 64's row), AdamW -> fp8
                      (nanogeo/run/recommend.py); fp32 on one rank
       --comm=fp32    all-reduce in fp32 (the reference)
       --comm=bf16    cast to bf16, all-reduce, cast back (what most clusters send today)
       --comm=fp8     Euclidean FP8: quantize, all_to_all, reduce, re-quantize, all_gather
       --comm=geofp8  the same collective in the whitened coordinates of each layer's K-FAC
                      input factor (the published GeoFP8; see compress.py)
       --comm=subspace  ... in coordinates rotated toward the dominant subspaces (ours)
       --comm=hadamard  ... after a randomized Hadamard transform: the geometry-agnostic control
     --collective=fp8-sum swaps the two-stage collective for the paper's one FP8 all_reduce SUM.
  4. Every rank now holds bit-identical averaged gradients, clips them and takes the same
     optimizer step (AdamW; or with --optimizer=muon, Muon on the transformer blocks' matrices
     and AdamW on the rest), so the parameters stay bit-identical without ever being broadcast
     again.

Configuration: one dataclass, `TrainConfig`; every field is a flag `--name=value`. `--preset`
picks a model size and sensible defaults for it (nanogeo/run/config.py TRAIN_PRESETS); explicit
flags win. Unknown flags are an error.
One log line per step, pipe-separated; the same numbers go to out_dir/log.jsonl.
"""

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import compress
import model as model_lib
from nanogeo.run import checkpoint, config, recommend, reference, runlog, runtime, summary
from nanogeo.parallel import hooks, simulated
from nanogeo.wire import buckets, collective, kernels
from nanogeo.run.config import ConfigError
from nanogeo.run.runtime import RankMismatch
# the pieces of a step the tools share (nanogeo/run/steps.py): batches, optimizers, the schedule
from nanogeo.run.steps import (batch_rng, get_batch, make_optimizers, peak_lrs,
                               set_learning_rates, warmup_cosine)
from prepare_data import ShardError, load_splits
from nanogeo.parallel.communicator import ProductionCommunicator


# -----------------------------------------------------------------------------
# configuration

@dataclass
class TrainConfig:
    preset: str = "cpu-tiny"          # a model.PRESETS name: cpu-tiny, char-study, char-wide, llama-*, paper-*
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
    final_evals: int = 1              # final val loss: mean of N evals over the last 10 % of steps
    tail_evals: int = 0               # also the tail val loss: the mean of N evals over the last
                                      # 20 % of steps, each on its own batches (0 = off)
    eval_every: int = 0               # downstream zero-shot eval (nanogeo.run.eval) every N steps
    eval_limit: int = 200             # ... on the first N documents of each task
    eval_tasks: str = "hellaswag,piqa,arc_easy"
    log_interval: int = 1
    log_stages: bool = False          # on logged steps also the error of the mean by stage of
                                      # the collective, against its sampling noise (summary.py)
    ckpt_interval: int = 0            # save every N steps; 0 = only at the end
    resume: bool = False              # continue from out_dir/ckpt.pt
    overwrite: bool = False           # allow replacing another run's checkpoint in out_dir
    keep_ckpts: int = 2               # ckpt.pt plus the K-1 previous ones (ckpt-STEP.pt)
    # gradient communication
    comm: str = "auto"                # auto (the study's pick for the optimizer: README, What to
                                      # run) | fp32 | bf16 | fp8 | geofp8 (published) | subspace
                                      # (ours) | hadamard (the control)
    fmt: str = "e4m3"                 # FP8 wire format: e4m3 | e5m2 | nvfp4
    block: str = "128"                # scale granularity: elements per block, row or tensor
    stage2_fmt: str = ""              # two-stage: the all-gather's format ("" = --fmt), e.g. e4m3
                                      # after an NVFP4 all-to-all
    nvfp4_scale: str = "6"            # NVFP4 block scales: max at 6 | 4over6 (at 6 or 4, the
                                      # smaller error: Four Over Six)
    collective: str = "two-stage"     # two-stage | fp8-sum (the paper's: one FP8 all_reduce SUM)
    sum_order: str = "ring"           # fp8-sum: the order the FP8 partial sums are added in
    scale_sync_every: int = 1         # fp8-sum: >1 = the published local-scale defect (ablation)
    geo_layers: str = "gain"          # gain | all | fragile:K | FILE (a list from nanogeo.lab.profile)
    geo_refresh: int = 0              # re-estimate the geometry every N steps (0: 50 geofp8, 4 the
                                      # others; hadamard: re-judge it)
    geo_warmup: int = 10              # steps in Euclidean coordinates before any geometry
    geo_judge: str = "optimizer"      # a layer's coordinates by the error its optimizer sees | l2
    geo_enter_gain: float = 1.10      # a layer goes geometry-aware when its error drops this much
    geo_exit_gain: float = 1.00       # ... and leaves below this (0 and 0: the paper's fixed choice)
    whiten_factor: str = "lowrank"    # geofp8: lowrank | lowrank-dense | full | diag | block
    whiten_rank: int = 32             # geofp8: r of the low-rank input factor
    whiten_solver: str = "auto"       # geofp8: its top-r eigenpairs by subspace | eigh | auto
    whiten_sides: str = "input"       # geofp8: input (published) | output | both
    factor_decay: float = 0.0         # geofp8: EMA of the triangular factor (published: 0.95)
    geo_rank: int = 16                # subspace: r, dominant directions per side (<= min(m,n)/2)
    hadamard_block: int = 128         # hadamard: entries per Walsh-Hadamard block (a power of two)
    hadamard_sides: str = "right"     # hadamard: right (along each row) | both (the columns too)
    error_feedback: bool = False      # add back each rank's own quantization error next step
    feedback_stages: str = "1"        # ... of stage 1 | 2 (each averaged shard's re-quantization,
                                      # kept by its owner) | both
    feedback_geo_only: bool = False   # ... stage 1 on the geometry-aware matrices only (published)
    stochastic_round: bool = False    # unbiased stochastic rounding instead of nearest
    stochastic_stages: str = "both"   # ... in both stages, or only 1 (each rank's send) or 2
    bucket_mb: float = 25.0           # average the gradients a bucket of at most this many MiB
                                      # at a time, as DDP does (0: the whole model as one)
    impl: str = "fast"                # fast (nanogeo/: buckets, packing, stacks) | reference
                                      # (compress.py's Communicator: the spec, as it reads)
    # system
    simulate_workers: int = 0         # play W data-parallel ranks in this one process (0: off)
    device: str = "auto"              # auto | cpu | cuda
    compile: bool = False             # torch.compile the model and the packed FP8 codec
    sync_debug: bool = False          # CUDA: each reduce under torch.cuda's sync debug mode and
                                      # the profiler; its host waits and kernel launches logged
    seed: int = 1337
    check_every: int = 100            # all-rank parameter checksum every N steps (0 = never)


def parse_config(argv):
    """train.py's flags -> TrainConfig (nanogeo/run/config.py: --key=value or --key value; each
    --preset's defaults for the loop are config.TRAIN_PRESETS, its model model.PRESETS)."""
    return config.parse_config(argv, TrainConfig, config.TRAIN_PRESETS, config.TRAIN_CHOICES,
                               __doc__)


# -----------------------------------------------------------------------------
# gradient communication: the one seam

ring_allreduce_bytes = collective.ring_allreduce_bytes   # 2 (W - 1) / W of the buffer per rank
GEO_COMMS = ("geofp8", "subspace", "hadamard")          # --comm values with per-layer coordinates


def make_communicator(cfg, model, optimizers):
    """State that survives between steps for the compressed collectives (geometry, residuals),
    and for the published GeoFP8 the hooks that collect its layers' input moments.
    (None, None) for fp32 and bf16, which are stateless. The candidates for a geometry are
    the nn.Linear weights (by module type), each judged by the error its optimizer sees."""
    if cfg.comm in ("fp32", "bf16"):
        return None, None
    named = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
    # the embedding and the output head stay Euclidean, found by module type and one token's
    # forward (never by shape: char-wide's width equals its vocabulary size)
    one_token = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    options = config.geo_options(cfg, vocabulary=hooks.vocabulary_layers(model, one_token))
    linear = set(hooks.linear_layers(model))
    if cfg.impl == "reference":     # compress.py's own Communicator (nanogeo/run/reference.py)
        communicator = reference.Reference(named, options, linear)
    else:
        communicator = ProductionCommunicator(named, options, linear=linear)
    communicator.watch(hooks.optimizer_views(optimizers, model))
    moments = None
    if communicator.moment_layers():
        layers = hooks.linear_layers(model, communicator.moment_layers())
        # its hooks are attached in train() for the forwards of refresh steps only
        moments = hooks.KroneckerMoments(layers, sides=communicator.whitened_sides())
    return communicator, moments


@torch.no_grad()
def reduce_gradients(params, cfg, communicator, world_size, stats=None, workers=None):
    """Average the .grad of params across all ranks, in place. Returns the bytes this rank sent.

    Called once per optimizer step, after the last micro-step's backward. `stats`: the published
    GeoFP8's K-FAC moments of this step's forwards, on its refresh steps. With
    --simulate_workers, `workers` holds every simulated rank's gradients (and `stats` each rank's
    moments): this process plays them all, and simulated.average takes the collective's place
    with the same numerics."""
    if workers is not None:
        means, nbytes = simulated.average(workers, cfg.comm, communicator, stats)
        for p, mean in zip(params, means):
            p.grad = mean
        return nbytes
    grads = [p.grad for p in params]
    if cfg.comm in ("fp32", "bf16"):
        if world_size == 1:
            if cfg.comm == "bf16":  # one process still sees the bf16 rounding, for ablations
                for g in grads:
                    g.copy_(g.bfloat16())
            return 0
        dtype = torch.float32 if cfg.comm == "fp32" else torch.bfloat16
        for bucket in buckets.plan([g.shape for g in grads], cfg.bucket_mb, lambda shape: 1):
            pieces = [grads[s.index].view(-1)[s.start: s.end] for s in bucket]
            flat = torch.cat(pieces).to(dtype)          # (bucket numel,): one collective
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            mean = flat.float() / compress.count_divisor(world_size, flat)
            for piece, m in zip(pieces, mean.split([p.numel() for p in pieces])):
                piece.copy_(m)                          # into the gradient, in place
        numel = sum(g.numel() for g in grads)
        return ring_allreduce_bytes(numel, dtype.itemsize, world_size)
    # one step of the communicator (compress.Communicator.step states it) for this rank; the
    # published GeoFP8 refreshes its factors from its layers' input moments ...
    across = dist.is_initialized()
    rank = dist.get_rank(communicator.group) if across else 0
    means, nbytes = communicator.step({rank: grads}, stats, across_ranks=across)
    for g, mean in zip(grads, means):
        if mean is not g:           # (the fast path wrote its means into the gradients)
            g.copy_(mean)
    if stats is not None:       # ... averaged over the ranks by one more all-reduce
        nbytes += hooks.moments_bytes(communicator, world_size)
    return nbytes


# -----------------------------------------------------------------------------
# helpers

def final_eval_steps(cfg):
    """The steps whose validation losses the summary's final val loss averages: the last one,
    and with --final_evals=N N - 1 more, spaced evenly back over the last 10 % of the steps.
    The batches are the same each time, so the mean smooths the noise of the last few updates
    (which one evaluation carries in full), not the sampling of the batches."""
    gap = max(1, round(0.1 * cfg.max_iters / max(1, cfg.final_evals - 1)))
    return sorted({max(1, cfg.max_iters - k * gap) for k in range(cfg.final_evals)})


def tail_eval_steps(cfg):
    """The steps whose validation losses the tail val loss averages (--tail_evals=N): N steps
    spaced evenly back from the last over the last 20 % of the steps. Each of them evaluates its
    own eval_iters batches, none of them the final val loss's: a second end point that averages
    N times the tokens over a longer stretch of the run, to compare seeds with less noise."""
    if not cfg.tail_evals:
        return []
    gap = max(1, round(0.2 * cfg.max_iters / cfg.tail_evals))
    return sorted({max(1, cfg.max_iters - k * gap) for k in range(cfg.tail_evals)})


def learning_rate(cfg, step):
    """Linear warm-up, then cosine decay from learning_rate to min_lr at max_iters (the schedule
    itself is nanogeo/run/steps.py's warmup_cosine, which the tools share)."""
    return warmup_cosine(step, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.max_iters)


# -----------------------------------------------------------------------------
# training

def optimizer_step(params, optimizers, grad_clip):
    """Clip the averaged gradients (identical on every rank), step every optimizer, clear the
    gradients. Returns the gradient norm before clipping."""
    grad_norm = (torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip > 0
                 else torch.norm(torch.stack([p.grad.norm() for p in params])))
    for o in optimizers:
        o.step()
        o.zero_grad(set_to_none=True)
    return grad_norm


def data_parallel_ranks(cfg, rank, world_size):
    """The data-parallel ranks whose batches this process computes: its own, or with
    --simulate_workers=W all W of them (one process plays every rank)."""
    if cfg.simulate_workers < 0:
        raise ConfigError("--simulate_workers must be >= 0 (0: off)")
    if cfg.simulate_workers and world_size > 1:
        raise ConfigError("--simulate_workers plays every rank in one process; run it with "
                          "python, not torchrun")
    return list(range(cfg.simulate_workers)) if cfg.simulate_workers else [rank]


def forward_backward(model, batches, grad_accum, autocast=contextlib.nullcontext()):
    """One rank's micro-steps, forward and backward. .grad accumulates locally: nothing is
    communicated until the last micro-step. Returns the micro-steps' losses, on the device."""
    losses = []
    for x, y in batches:
        with autocast:
            _, loss = model(x, y)                   # x, y: (B, T)
        (loss / grad_accum).backward()
        losses.append(loss.detach())
    return losses


def mean_loss(losses):
    """The mean of a step's micro-step losses, read on the host (logged steps only: a sync)."""
    return sum(torch.stack(losses).tolist()) / len(losses)


def clock(device):
    """time.time() once the device has done the work queued so far. On a GPU a host sync: only
    the logged steps are timed, every other step runs without one."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


@torch.no_grad()
def evaluate(model, val, cfg, my_ranks, device, autocast, windows=0):
    """Mean validation loss over every data-parallel rank's fixed validation batches (the same
    windows at every evaluation; windows=j > 0: the j-th other set, for the tail val loss),
    identical on all ranks."""
    model.eval()
    per_rank = []
    for r in my_ranks:
        losses = []
        for k in range(cfg.eval_iters):
            x, y = get_batch(val, cfg.batch_size, cfg.block_size,
                             batch_rng(cfg.seed, r, windows, k, "val"), device)
            with autocast:
                losses.append(model(x, y)[1].float())
        per_rank.append(torch.stack(losses).mean())
    loss = torch.stack(per_rank).sum()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    model.train()
    return (loss / (len(my_ranks) * world_size)).item()


class Diagnostics:
    """What a step reports besides its loss, measured around its reduce (nanogeo/run/summary.py)
    and off on most steps: on logged steps the coordinates each candidate layer's gradient was
    sent in and, with --log_stages, the error of the mean by stage of the collective; with
    --sync_debug on a GPU, the host waits inside the reduce; on the last step its gradients, for
    the end-of-run comparison against Euclidean FP8.

        with diagnostics.around_reduce(done, logged, grads, workers, params):
            ... the reduce ...
        diagnostics.log(done, log)      # after the step's log line
    """

    def __init__(self, cfg, communicator, world_size, data_parallel, device):
        self.cfg, self.communicator, self.world_size = cfg, communicator, world_size
        self.count_syncs = cfg.sync_debug and device.type == "cuda"    # --sync_debug
        self.syncs = self.launches = None
        # the last step, kept to measure it against Euclidean FP8 at the end (compressed runs)
        self.last_step = (summary.LastStep(communicator, data_parallel, bool(cfg.simulate_workers))
                          if communicator is not None and cfg.impl == "fast" else None)
        self.as_sent = self.stages = None

    @contextlib.contextmanager
    def around_reduce(self, done, logged, grads, workers, params):
        cfg, communicator = self.cfg, self.communicator
        last = self.last_step if done == cfg.max_iters else None
        # the coordinates this step's gradients are sent in (the reduce may change them after)
        self.as_sent = ({n: communicator.coords(n) for n in communicator.layers}
                        if logged and cfg.comm in GEO_COMMS else None)
        if last is not None:
            last.keep_sent(workers or [], grads)
        decompose = logged and cfg.log_stages and communicator is not None
        if decompose:   # the error by stage: the gradients as they were (a reduce writes them)
            communicator.decompose, before = True, workers or [g.clone() for g in grads]
        # (the profiler on logged steps only: it costs a synchronize and its bookkeeping)
        with runtime.counting_launches(self.count_syncs and logged) as launches, \
                runtime.counting_syncs(self.count_syncs) as syncs:
            yield
        self.syncs = syncs[0] if syncs else None
        self.launches = launches[0] if launches else None
        self.stages = None
        if decompose:
            self.stages = summary.stage_errors(communicator, before, [p.grad for p in params],
                                               self.world_size, bool(cfg.simulate_workers))
            communicator.decompose = False
        if last is not None:
            last.keep_delivered(params)

    def log(self, done, log):
        """The logged step's records: its geometry (log.jsonl) and, with --log_stages, a line."""
        if self.as_sent is not None:
            log.geometry(done, self.communicator, self.as_sent)
        if self.stages:
            log.print(summary.stages_line(done, self.stages))
            log.write({"step": done, "stages": self.stages})
        if self.syncs is not None:
            log.write({"step": done, "reduce_syncs": self.syncs, "reduce_launches": self.launches})

    def finish(self, log):
        """The end of the run: the last step against Euclidean FP8, if it was taken."""
        if self.last_step is not None and self.last_step.taken():
            log.print(self.last_step.report())


def train(cfg):
    """Train as the flags say; returns the run's summary (nanogeo/run/runlog.py, RunLog.finish).
    First everything is built, then each step runs forward/backward, reduce_gradients (the
    communication), optimizer_step, and evaluates, logs and saves as the flags say."""
    rank, world_size, _, device = runtime.setup_distributed(cfg)
    my_ranks = data_parallel_ranks(cfg, rank, world_size)
    data_parallel = len(my_ranks) * world_size
    # --comm=auto: the study's pick for this optimizer; the run's first line says which and why
    no_flags = TrainConfig(**config.TRAIN_PRESETS[cfg.preset])     # to tell the flags set
    cfg, why = recommend.resolve(cfg, data_parallel, no_flags)
    if why and rank == 0:
        print(why, flush=True)
    torch.manual_seed(cfg.seed)  # same seed on every rank (and rank 0's bits: below)
    # torchrun --max-restarts brought us back: resume if rank 0 sees a checkpoint (cfg.resume)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # checked before anything is built: fail in a second, not after a minute
    cfg, ckpt, resumed_from = checkpoint.open_checkpoint(cfg, data_parallel, device,
                                                         master=rank == 0, restarted=restarts > 0)
    if cfg.impl == "reference" and cfg.comm not in ("fp32", "bf16"):
        reference.check(cfg)    # after open_checkpoint: a torchrun restart sets cfg.resume
    log = runlog.RunLog(cfg, master=rank == 0)

    mcfg = model_lib.model_config(cfg.preset, block_size=cfg.block_size)
    data = load_splits(cfg.data_dir, cfg.block_size, mcfg.vocab_size)
    raw_model = model_lib.Llama(mcfg).to(device)
    if world_size > 1:          # two hosts' CPUs need not draw the same initial bits
        runtime.broadcast_from_rank0(raw_model)
    model = torch.compile(raw_model, dynamic=False) if cfg.compile else raw_model
    kernels.compile_hot_path(cfg.compile)      # the packed codec's kernels too
    params = [p for p in raw_model.parameters() if p.requires_grad]
    optimizers = make_optimizers(cfg, raw_model, fused=device.type == "cuda")
    peaks = peak_lrs(optimizers)    # read before a checkpoint overwrites "lr" with its last value
    communicator, moments = make_communicator(cfg, raw_model, optimizers)
    # simulated ranks: one process plays them all (nanogeo/parallel/simulated.py); batched
    # through the model together on the CPU and eagerly (with --compile: one by one)
    ranks = (simulated.SimulatedRanks(raw_model, model, forward_backward, moments,
                                      batched=device.type == "cpu" and not cfg.compile)
             if cfg.simulate_workers else None)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    start_step = 0
    if ckpt is not None:
        start_step = checkpoint.restore(ckpt, raw_model, optimizers, communicator, cfg, rank,
                                        world_size, device)
        log.print(f"resumed from {resumed_from} at step {start_step}"
                  + (f" (elastic restart {restarts})" if restarts else ""))
    # the step of the ckpt.pt in out_dir (the next save keeps it as ckpt-STEP.pt); none after a
    # resume from a kept ckpt-STEP.pt, the damaged ckpt.pt having been moved aside
    in_place = resumed_from == checkpoint.ckpt_path(cfg)
    saver = checkpoint.Checkpointer(cfg, mcfg, data_parallel, rank, world_size,
                                    last_step=start_step if in_place else None)
    log.start(raw_model, params, world_size, device, data_parallel)

    def val_loss_now(windows=0):
        return evaluate(model, data["val"], cfg, my_ranks, device, autocast, windows)

    def batches(r, step):       # rank r's micro-batches: a pure function of (seed, r, step)
        return [get_batch(data["train"], cfg.batch_size, cfg.block_size,
                          batch_rng(cfg.seed, r, step, micro), device)
                for micro in range(cfg.grad_accum)]

    final_steps, final_vals = final_eval_steps(cfg), []     # final_vals: [(step, val loss)]
    tail_steps, tail_vals = tail_eval_steps(cfg), []        # ... of the tail val loss

    def tail_eval(done):        # the tail's val losses (mean of the last few: less noise)
        if done in tail_steps:
            tail_vals.append((done, val_loss_now(windows=1 + tail_steps.index(done))))

    def skip_step(done):
        """Some rank's gradient is not finite: the step is skipped on every rank alike (the
        model, the optimizer, the geometry and error feedback untouched); the val losses due
        still measure the model as it is."""
        log.print(f"step {done}: warning: non-finite gradient on some rank; step skipped")
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        tail_eval(done)
        if done in final_steps:
            final_vals.append((done, val_loss_now()))

    first_val = None if start_step else val_loss_now()
    log.first_eval(first_val)
    val_loss = float("nan") if first_val is None else first_val    # resumed: not yet measured
    losses, t_start = None, time.time()     # losses: the last step's, on the device
    diagnostics = Diagnostics(cfg, communicator, world_size, data_parallel, device)
    for step in range(start_step, cfg.max_iters):
        done = step + 1
        logged = done % cfg.log_interval == 0 or done == cfg.max_iters
        t0 = clock(device) if logged else None
        lr = learning_rate(cfg, step)
        set_learning_rates(optimizers, peaks, lr, cfg.learning_rate)

        # forward and backward on every micro-batch. On the published GeoFP8's refresh steps,
        # hooks collect the whitened layers' input moments (eagerly: raw_model).
        collect = moments is not None and communicator.moments_due()
        with moments.attached() if collect else contextlib.nullcontext():
            if ranks is None:   # .grad holds this rank's gradient
                step_losses = forward_backward(raw_model if collect else model,
                                               batches(rank, step), cfg.grad_accum, autocast)
                workers, stats = None, moments.take() if collect else None
            else:               # every simulated rank's gradients, apart
                step_losses, workers, stats = ranks.forward_backward(
                    [batches(r, step) for r in my_ranks], cfg.grad_accum, autocast, collect)
        grads = [g for w in workers for g in w] if workers else [p.grad for p in params]
        # the step's one host read: is every rank's gradient finite?
        if not runtime.gradients_finite(grads, world_size):
            skip_step(done)
            continue
        losses = step_losses
        with diagnostics.around_reduce(done, logged, grads, workers, params):
            wire_bytes = reduce_gradients(params, cfg, communicator, world_size, stats, workers)
        grad_norm = optimizer_step(params, optimizers, cfg.grad_clip)
        log.sent(wire_bytes)
        if cfg.check_every and world_size > 1 and done % cfg.check_every == 0:
            runtime.check_ranks_agree(params, done, device)
        dt = clock(device) - t0 if logged else None

        tail_eval(done)
        if done % cfg.eval_interval == 0 or done in final_steps:
            val_loss = val_loss_now()
            if done in final_steps:
                final_vals.append((done, val_loss))
            if cfg.comm in GEO_COMMS and done > cfg.geo_warmup:
                log.print(f"geometry-aware layers at step {done}:\n{summary.layer_table(communicator)}")
        if logged:
            log.step(done, mean_loss(losses), val_loss, lr, grad_norm, dt, wire_bytes)
            diagnostics.log(done, log)
        if cfg.eval_every and done % cfg.eval_every == 0:
            log.downstream(done, raw_model, device)
        if cfg.ckpt_interval and done % cfg.ckpt_interval == 0 and done < cfg.max_iters:
            saver.save(done, raw_model, optimizers, communicator)
    saver.save(cfg.max_iters, raw_model, optimizers, communicator)
    elapsed = time.time() - t_start     # the training, without the comparison below
    diagnostics.finish(log)
    train_loss = mean_loss(losses) if losses is not None else float("nan")
    result = log.finish(train_loss, final_vals or [(cfg.max_iters, val_loss)], first_val,
                        start_step, elapsed, runtime.parameter_checksum(params), saver.path,
                        tail_vals)
    if world_size > 1:
        dist.destroy_process_group()
    return result


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
    runtime.leave_if_distributed()  # a finished rank leaves at once: gloo's teardown may abort
