"""
Benchmarks of the collective and of GeoFP8's compute cost. Not tests: numbers for BENCHMARKS.md.

    torchrun --standalone --nproc_per_node=2 -m nanogeo.lab.bench collective [--sizes 1,4,16] [--iters 5] [--compile]
    python -m nanogeo.lab.bench overhead [--steps 10 --batch_size 8 --block_size 128]
    python -m nanogeo.lab.bench flops [--preset llama-600m --tokens 8192 --geo_rank 16 --refresh 1,4]
    torchrun --standalone --nproc_per_node=2 -m nanogeo.lab.bench fsdp [--checkpoint out/ablate/fp32/adamw/ranks2/seed1337/ckpt.pt]
    python -m nanogeo.lab.bench codec [--preset llama-600m --world 8 --iters 5]
    torchrun --standalone --nproc_per_node=2 -m nanogeo.lab.bench accumulation [--seeds 0,1,2 --steps 30]
    OMP_NUM_THREADS=1 python -m nanogeo.lab.bench step [--preset cpu-tiny --steps 10 --batch_size 8 --block_size 128]

collective: each method on one bucket of N million fp32 gradient elements, shaped as square-ish
  matrices (so GeoFP8 has something to rotate), timed with a per-stage breakdown (quantize,
  reduce and decode: the codec's three stages; collectives: the all_to_all and all_gather, the
  rest of the step; rotate = geometry-aware encode + decode, geometry = the basis refresh) and
  the bytes each rank sent.
  Methods are compared as ratios within one run: this machine is noisy.
overhead: GeoFP8's extra compute per step (encode, decode, basis refresh) over Euclidean FP8, on
  the real gradients of the cpu-tiny preset, relative to that preset's forward + backward.
flops: the same overhead, analytically, at a preset's shapes: 16 m n r flops per rotated matrix
  per step (encode + decode, both sides) plus the refresh, versus ~6 T N training flops.
fsdp: the cpu-tiny Llama under FSDP2 (every block and the root fully_shard-ed) with fp32, Euclidean
  FP8 and GeoFP8 reduce-scatter (nanogeo.parallel.fsdp), from a checkpoint, on real batches: the gradient
  error of each against fp32 over the last --last of --steps steps (transformer matrices and all
  tensors), bytes sent, and the backward time (which includes the reduce-scatters).
accumulation: gradient accumulation through the DDP hook, with and without DDP's no_sync() on
  the first micro-step, on a plateau-escape task (a fixed permutation chain over 64 tokens that
  restarts with probability 1/8) with a byte-level GPT-2 (nanogeo.lab.bytegpt, hidden 128, 2 layers),
  AdamW lr 2e-3, 2 micro-steps per step: final loss per seed and the largest step-to-step rise.
step: where one rank's training step goes on the CPU, without communication: forward, backward
  and a plain AdamW step of a preset (default cpu-tiny) on 8 x 128 random tokens (--batch_size x
  --block_size), timed, then profiled: its time per step by torch op (the profiler's self time;
  matrix products, the loss's log-softmax, the optimizer's elementwise ops).
codec: the two-stage collective's codec work on one rank, per DDP bucket (25 MB, the preset's
  parameters in reverse order), packed (one encode / decode call per bucket and stage) against
  one call per piece: codec calls per step (counted), torch ops that do work (about the kernel
  launches on a GPU, from the profiler) for one bucket, and its time, eager and compiled, as a
  fraction of the memory-copy roofline: fused, the three stages must move at least 11 + 1/W
  bytes per element (stage 1 reads 4 and writes 1, stage 2 reads 1 and writes 1/W, stage 3
  reads 1 and writes 4), where a copy of the fp32 bucket moves 8.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import compress
from nanogeo.parallel import hooks
import model as model_lib
from nanogeo.wire import collective, kernels
from nanogeo.lab import perfmodel
from nanogeo.run import runtime
from nanogeo.run.steps import batch_rng, get_batch
from prepare_data import load_splits
from nanogeo.parallel.communicator import Options, ProductionCommunicator


def timed(fn, iters):
    """Median seconds of fn() over iters runs, after one warm-up run (compiles happen there),
    the device synchronized around each (the smoke test times with it too)."""
    fn()
    device, seconds = bench_device(), []
    for _ in range(iters):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
    return sorted(seconds)[len(seconds) // 2]


def synchronize(device):
    """Wait until the device has run everything queued: a CUDA call returns once its kernel is
    queued, so a clock read without this times the launches, not the work (a CPU computes as it
    is called: nothing to wait for)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
        torch.device("cpu")


class StageTimer:
    """Wall time per stage, for benchmarks: timer.stage("name") is a context manager. The
    default (no timer) costs nothing; with one, the device is synchronized at each boundary."""

    def __init__(self, device=None):
        self.seconds = {}
        self.device = bench_device() if device is None else torch.device(device)

    @contextlib.contextmanager
    def stage(self, name):
        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def bucket_shapes(million_elements, width=1024):
    """Matrices of width x 4*width up to the requested size (the last one shorter)."""
    total = int(million_elements * 1e6)
    shapes, rows = [], 4 * width
    while total > 0:
        n = min(total, rows * width)
        shapes.append((n // width, width) if n >= width else (n,))
        total -= n
    return shapes


def planted_gradients(shapes, step, rank, world):
    """LLM-like anisotropy: a dominant rank-8 part whose subspaces persist across steps (its 8
    strengths vary by +-20 % from step to step), shared by all ranks, plus per-rank noise."""
    out = []
    for k, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(1000 * k)
        if len(shape) == 1:
            out.append(torch.randn(shape, generator=torch.Generator().manual_seed(1000 * k + step)))
            continue
        m, n = shape
        left, right = torch.randn(m, 8, generator=g), torch.randn(8, n, generator=g)
        strengths = 1 + 0.2 * torch.randn(8, generator=torch.Generator().manual_seed(1000 * k + step))
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(7 + 1000 * k + step * 31 + rank))
        out.append(left @ (strengths[:, None] * right) / 8 + 0.3 * noise)
    return out


METHODS = {
    "fp32": None, "bf16": None,
    "fp8": Options(geometry="euclidean"),
    "subspace": Options(geometry="subspace", min_numel=4096),
    "nvfp4": Options(geometry="euclidean", fmt="nvfp4"),
}


def baseline_allreduce(grads, dtype, world):
    """The fp32 and bf16 baselines as train.py's reduce_gradients sends them: every gradient in
    one flat bucket of `dtype`, one all-reduce SUM, the mean copied back in fp32. Returns the
    bytes each rank sent."""
    flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat = flat.float().div_(world)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return collective.ring_allreduce_bytes(flat.numel(), dtype.itemsize, world)


def time_collective(sizes, iters, methods, device=None):
    """Each method's mean step on each size; every time is read with the device synchronized
    (the fp32 and bf16 baselines too: unsynchronized, they would time kernel launches while the
    FP8 methods' StageTimer waits for their work)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = bench_device() if device is None else torch.device(device)
    rows = []
    for size in sizes:
        shapes = bucket_shapes(size)
        numel = sum(math.prod(s) for s in shapes)
        bf16_bytes = collective.ring_allreduce_bytes(numel, 2, world)
        for method in methods:
            opts = METHODS[method]
            timer = StageTimer(device)
            comm = (ProductionCommunicator([(f"m{k}.weight", s) for k, s in enumerate(shapes)],
                                           opts, timer=timer) if opts else None)
            seconds, nbytes = [], 0
            warm = 5  # the first bases (step 0), the first refresh (step 4), compiles in both
            for step in range(warm + iters):
                grads = [g.to(device) for g in planted_gradients(shapes, step, rank, world)]
                synchronize(device)         # the copies above done before the clock starts
                dist.barrier()
                if step == warm:
                    timer.seconds.clear()
                t0 = time.perf_counter()
                if comm is None:
                    dtype = torch.float32 if method == "fp32" else torch.bfloat16
                    nbytes = baseline_allreduce(grads, dtype, world)
                else:
                    nbytes = comm.reduce(grads)
                synchronize(device)         # the step's kernels done before the clock stops
                if step >= warm:
                    seconds.append(time.perf_counter() - t0)
            per_step = sorted(seconds)[len(seconds) // 2]  # median
            breakdown = {k: v / iters * 1000 for k, v in timer.seconds.items()}
            if comm is not None:    # the all_to_all and all_gather: the rest of a mean step
                breakdown["collectives"] = 1000 * sum(seconds) / iters - sum(breakdown.values())
            rows.append({"million_elements": size, "method": method, "world": world,
                         "ms": per_step * 1000, "bytes_sent": nbytes,
                         "bytes_vs_bf16": nbytes / bf16_bytes, "breakdown_ms": breakdown})
    return rows


def print_collective(rows):
    print(f"{'size':>6s} {'method':>8s} {'ms':>9s} {'vs fp32':>8s} {'MB sent':>9s} {'vs bf16':>8s}  breakdown (ms)")
    base = {r["million_elements"]: r["ms"] for r in rows if r["method"] == "fp32"}
    for r in rows:
        parts = " ".join(f"{k}={v:.1f}" for k, v in r["breakdown_ms"].items())
        rel = r["ms"] / base[r["million_elements"]] if r["million_elements"] in base else float("nan")
        print(f"{r['million_elements']:5g}M {r['method']:>8s} {r['ms']:9.1f} {rel:8.2f} "
              f"{r['bytes_sent'] / 1e6:9.2f} {r['bytes_vs_bf16']:8.3f}  {parts}")


def measure_overhead(steps, preset="cpu-tiny", batch_size=8, block_size=128, refresh=1,
                     geo_rank=16):
    """GeoFP8 extra compute per step on one rank, against forward + backward of the preset."""
    torch.manual_seed(0)
    cfg = model_lib.model_config(preset, block_size=block_size)
    net = model_lib.Llama(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch_size, block_size))
    named = [(n, p.shape) for n, p in net.named_parameters()]

    def fwd_bwd():
        net.zero_grad(set_to_none=True)
        net(x, x)[1].backward()
        return [p.grad.clone() for p in net.parameters()]

    fwd_bwd()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        grads = fwd_bwd()
    fwd_bwd_s = (time.perf_counter() - t0) / steps

    results = {}
    for name, opts in (("fp8", Options(geometry="euclidean", vocab_size=cfg.vocab_size)),
                       ("subspace", Options(geometry="subspace", vocab_size=cfg.vocab_size,
                                            geo_refresh=refresh, geo_rank=geo_rank))):
        comm = ProductionCommunicator(named, opts, linear=set(hooks.linear_layers(net)))
        comm.reduce_workers([grads])  # first bases
        t0 = time.perf_counter()
        for _ in range(steps):
            comm.reduce_workers([grads])
        results[name] = (time.perf_counter() - t0) / steps
        geo_layers = sum(comm.coords(n) == "geo" for n, _ in named)
    overhead = results["subspace"] - results["fp8"]
    return {"preset": preset, "geo_refresh": refresh, "geo_rank": geo_rank,
            "tokens": batch_size * block_size, "fwd_bwd_ms": fwd_bwd_s * 1000,
            "fp8_codec_ms": results["fp8"] * 1000, "subspace_codec_ms": results["subspace"] * 1000,
            "geo_overhead_ms": overhead * 1000, "overhead_vs_fwd_bwd": overhead / fwd_bwd_s,
            "geo_layers": geo_layers}


def fsdp_fidelity(checkpoint, steps, last, geo_rank, sides="auto", data_dir="data/shakespeare",
                  batch_size=8, block_size=128):
    """Three FSDP2 copies of one checkpoint, each step the same batches: fp32 / fp8 / subspace.
    Sequences of block_size tokens, or of the checkpoint's context length if shorter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from nanogeo.parallel.fsdp import use_compressed_reduce_scatter
    me, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world,))
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    mcfg = model_lib.ModelConfig(**ckpt["model_config"])
    block_size = min(block_size, mcfg.block_size)
    data = load_splits(data_dir, block_size, mcfg.vocab_size)
    nets, comms = {}, {}
    for method in ("fp32", "fp8", "subspace"):
        net = model_lib.Llama(mcfg).to(device)
        net.load_state_dict(ckpt["model"])
        for block in net.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        if method != "fp32":
            geometry = "subspace" if method == "subspace" else "euclidean"
            comms[method] = use_compressed_reduce_scatter(net, geometry=geometry, geo_rank=geo_rank,
                                                          sides=sides, vocab_size=mcfg.vocab_size)
        nets[method] = net
    candidates = {n for c in comms["subspace"] for n in c.comm.layers}
    sq = {m: torch.zeros(4, dtype=torch.float64) for m in comms}   # err, ref; matrices' err, ref
    seconds = {m: 0.0 for m in nets}
    for step in range(steps):
        x, y = get_batch(data["train"], batch_size, block_size, batch_rng(0, me, step, 0),
                         device)
        for method, net in nets.items():
            net.zero_grad(set_to_none=True)
            loss = net(x, y)[1]
            synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            loss.backward()
            synchronize(device)         # the reduce-scatters run on their own streams
            if step >= steps - last:
                seconds[method] += time.perf_counter() - t0
        if step < steps - last:
            continue
        ref = dict(nets["fp32"].named_parameters())
        for method in sq:
            for name, p in nets[method].named_parameters():
                r = ref[name].grad.to_local().double().cpu()
                err = (p.grad.to_local().double().cpu() - r).pow(2).sum()
                norm = r.pow(2).sum()
                matrix = float(name in candidates)
                sq[method] += torch.stack([err, norm, err * matrix, norm * matrix])
    for v in sq.values():
        total = v.to(device)
        dist.all_reduce(total)
        v.copy_(total.cpu())
    out = {"world": world, "steps": steps, "last": last, "geo_rank": geo_rank, "sides": sides,
           "geo_matrices": sum(c.comm.coords(n) == "geo" for c in comms["subspace"] for n in c.names),
           "candidate_matrices": len(candidates)}
    for method, v in sq.items():
        out[method] = {"rel_err_all": math.sqrt(v[0] / v[1]),
                       "rel_err_matrices": math.sqrt(v[2] / v[3]),
                       "bytes_per_step": sum(c.bytes_sent for c in comms[method]) / steps,
                       "geometry_bytes_per_step": sum(c.geometry_bytes for c in comms[method]) / steps}
    for method, s in seconds.items():
        out.setdefault(method, {})["backward_ms"] = s / last * 1000
    out["subspace_vs_fp8_matrix_error"] = (out["subspace"]["rel_err_matrices"]
                                         / out["fp8"]["rel_err_matrices"])
    # the decode's all-reduces carry r x n fp32 numbers per matrix whose rows are rotated, twice
    # (ring), against ~m x n FP8 bytes of its reduce-scatter: about 8 r / m of that matrix's
    # bytes, whatever W
    rotated = [(layer.r, layer.shape) for c in comms["subspace"]
               for n, layer in c.comm.layers.items()
               if c.comm.sent_in_geometry(n) and layer.transform[0] is not None]
    out["geometry_bytes_predicted"] = sum(8 * r / m for r, (m, n) in rotated) / max(1, len(rotated))
    out["geometry_bytes_vs_rotated_matrices"] = (
        out["subspace"]["geometry_bytes_per_step"]
        / max(1.0, sum(m * n * (world - 1) / world for _, (m, n) in rotated)))
    return out


def ddp_buckets(preset, cap_bytes=25 * 2 ** 20, first_cap_bytes=2 ** 20):
    """The preset's parameter shapes in DDP's bucket order (reverse registration), cut at DDP's
    defaults: 1 MiB for the first bucket, 25 MiB for the others."""
    with torch.device("meta"):
        net = model_lib.Llama(model_lib.model_config(preset))
    buckets, size = [[]], 0
    for p in reversed(list(net.parameters())):
        cap = first_cap_bytes if len(buckets) == 1 else cap_bytes
        if size and size + 4 * p.numel() > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(tuple(p.shape))
        size += 4 * p.numel()
    return buckets


def one_rank_collective(tensors, layout):
    """What rank 0's codec does for one bucket (the exchanges replaced by copies of its own
    bytes): stage 1 encode, stage 2 decode-sum-encode of its shard, stage 3 decode of W shards."""
    shards = compress.quantize_bucket(tensors, layout).split(layout.nbytes)
    averaged = layout.average_shard(shards[0].repeat(layout.world_size), 0)
    slots = averaged.new_zeros(layout.world_size, max(layout.nbytes))
    for j, n in enumerate(layout.nbytes):
        slots[j, :n] = shards[j] if j != 0 else averaged
    return compress.dequantize_bucket(slots.view(-1), layout, stride=slots.shape[1])


NO_KERNEL_OPS = {"aten::" + name for name in (
    "view", "slice", "as_strided", "select", "split", "unsqueeze", "reshape", "expand", "alias",
    "_reshape_alias", "narrow", "detach", "empty", "empty_strided", "t", "transpose", "unbind",
    "split_with_sizes", "lift_fresh", "resolve_conj", "resolve_neg", "result_type")}


def step_profile(preset, steps, batch_size=8, block_size=128, top=8):
    """ms per forward + backward + AdamW step of `preset` on one CPU rank (after one warm-up
    step, without the profiler), and the top ops' ms per step in `steps` more, profiled (self
    time)."""
    torch.manual_seed(0)
    cfg = model_lib.model_config(preset, block_size=block_size)
    net = model_lib.Llama(cfg)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randint(0, cfg.vocab_size, (2, batch_size, block_size))

    def train_step():
        net(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step()
    ms = (time.perf_counter() - t0) / steps * 1000
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            train_step()
    profiled_ms = (time.perf_counter() - t0) / steps * 1000
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {"preset": preset, "parameters": sum(p.numel() for p in net.parameters()),
            "tokens": batch_size * block_size, "threads": torch.get_num_threads(),
            "ms_per_step": ms, "profiled_ms_per_step": profiled_ms,
            "ops_ms_per_step": {e.key: e.self_cpu_time_total / 1000 / steps for e in ops}}


def kernel_ops(fn):
    """Torch ops with no child op that do work (views and allocations left out): on a GPU,
    about one kernel launch each, during fn()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and not e.cpu_children
               and e.name not in NO_KERNEL_OPS)


def codec_launches(preset, world, iters, fmt="e4m3", block=128):
    buckets = ddp_buckets(preset)
    rows = {"preset": preset, "world": world, "buckets": len(buckets), "fmt": fmt, "block": block}
    layouts = {}
    timed_bucket = max(buckets, key=len)             # the bucket with the most tensors
    for packed in (True, False):
        layout = collective.layout(timed_bucket, fmt, block, world, packed=packed)
        layouts[packed] = layout
    # calls per step by the stages' rule (below); times and ops
    # of the bucket with the most tensors (DDP's first bucket holds the output head alone)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in timed_bucket]
    for packed, layout in layouts.items():
        name = "packed" if packed else "per_piece"
        pieces = sum(len(p) for p in layout.pieces)
        rows[name] = {"pieces_bucket": pieces,
                      "kernel_ops_bucket": kernel_ops(lambda: one_rank_collective(tensors, layout))}
    # per step for the whole model: per piece = W T (stage 1) + W T_j + T_j (stage 2) + W T
    # (stage 3) on rank 0; packed = 4 per bucket
    per_piece = 0
    for shapes in buckets:
        layout = collective.layout(shapes, fmt, block, world)
        total, mine = sum(len(p) for p in layout.pieces), len(layout.pieces[0])
        per_piece += 2 * total + (world + 1) * mine
    rows["per_piece"]["codec_calls_per_step"] = per_piece
    rows["packed"]["codec_calls_per_step"] = 4 * len(buckets)
    # time against the memory-copy roofline
    numel = sum(t.numel() for t in tensors)
    src, dst = torch.cat([t.reshape(-1) for t in tensors]), torch.empty(numel)
    copy_s = timed(lambda: dst.copy_(src), iters)
    rows["copy_gb_per_s"] = 8 * numel / copy_s / 1e9
    for compiled in (False, True):
        kernels.compile_hot_path(compiled)
        for packed, layout in layouts.items():
            if compiled and not packed:         # compiling touches only the packed kernels
                continue
            name = "packed" if packed else "per_piece"
            seconds = timed(lambda: one_rank_collective(tensors, layout), iters)
            rows[name]["compiled_ms" if compiled else "eager_ms"] = seconds * 1000
            rows[name]["compiled_vs_roofline" if compiled else "eager_vs_roofline"] = (
                (11 + 1 / world) / 8 * copy_s / seconds)
    kernels.compile_hot_path(False)
    rows["bucket_numel"], rows["bucket_tensors"] = numel, len(timed_bucket)
    return rows


def chain_batch(generator, batch, length, vocab=64):
    """A fixed random permutation chain over `vocab` tokens (the same on every rank and seed):
    each next token is perm[token], except that with probability 1/8 the chain restarts at a
    random token. Next-token targets."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(12345))
    x = torch.empty(batch, length + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    for t in range(length):
        restart = torch.rand(batch, generator=generator) < 1 / 8
        x[:, t + 1] = torch.where(restart, torch.randint(0, vocab, (batch,), generator=generator),
                                  perm[x[:, t]])
    return x[:, :-1], x[:, 1:]


def accumulation_runs(seeds, steps, methods=("fp32", "fp8", "subspace")):
    """Final loss and largest loss rise of each (method, no_sync?, seed) on the chain task."""
    from contextlib import nullcontext
    from torch.nn.parallel import DistributedDataParallel as DDP
    from nanogeo.lab.bytegpt import ByteGPT, ByteGPTConfig
    from nanogeo.parallel.ddp import CompressHookState, compress_hook
    rank = dist.get_rank()
    rows = []
    for seed in seeds:
        for method in methods:
            for no_sync in (False, True):
                torch.manual_seed(seed)
                net = DDP(ByteGPT(ByteGPTConfig(block_size=32, n_layer=2, n_embd=128)))
                if method != "fp32":
                    state = CompressHookState(net, geometry="euclidean" if method == "fp8"
                                            else "subspace", geo_warmup=2, geo_judge="l2")
                    net.register_comm_hook(state, compress_hook)
                opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
                data = torch.Generator().manual_seed(1000 * seed + rank)
                losses = []
                for _ in range(steps):
                    opt.zero_grad()
                    total = 0.0
                    for micro in range(2):
                        x, y = chain_batch(data, 8, 32)
                        with net.no_sync() if no_sync and micro == 0 else nullcontext():
                            loss = net(x, y)[1]
                            (loss / 2).backward()
                        total += loss.item() / 2
                    opt.step()
                    losses.append(total)
                rise = max((b - a for a, b in zip(losses, losses[1:])), default=float("nan"))
                rows.append({"seed": seed, "method": method, "no_sync": no_sync,
                             "final_loss": losses[-1], "largest_rise": rise, "losses": losses})
    return rows


def print_accumulation(rows):
    print(f"{'method':>9s} {'no_sync':>8s}  final loss per seed          largest rise per seed")
    for method in dict.fromkeys(r["method"] for r in rows):
        for no_sync in (False, True):
            sel = [r for r in rows if r["method"] == method and r["no_sync"] == no_sync]
            final = " ".join(f"{r['final_loss']:.3f}" for r in sel)
            rise = " ".join(f"{r['largest_rise']:+.3f}" for r in sel)
            print(f"{method:>9s} {str(no_sync):>8s}  {final:28s} {rise}")


def analytic_flops(preset, tokens, geo_rank, refresh=4):
    """GeoFP8 flops per step / training flops per step, at a preset's shapes."""
    geo, net = perfmodel.geo_flops(preset, geo_rank, refresh)
    train_flops = net.flops_per_token(net.config.block_size) * tokens
    return {"preset": preset, "tokens_per_rank": tokens, "geo_rank": geo_rank,
            "geo_refresh": refresh, "geo_gflops": geo / 1e9, "train_gflops": train_flops / 1e9,
            "fraction": geo / train_flops}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("mode", choices=["collective", "overhead", "flops", "fsdp", "codec",
                                         "accumulation", "step"])
    parser.add_argument("--sizes", default="1,4,16", help="million elements per bucket")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--methods", default="fp32,bf16,fp8,subspace,nvfp4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--refresh", default="1,4", help="basis refresh intervals to try")
    parser.add_argument("--preset", default=None,
                        help="default: llama-600m (step and overhead: cpu-tiny)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch_size", type=int, default=8, help="step, overhead and fsdp modes")
    parser.add_argument("--block_size", type=int, default=128,
                        help="step, overhead and fsdp modes (fsdp: at most the checkpoint's)")
    parser.add_argument("--geo_rank", type=int, default=16, help="r (the GeoOptions default)")
    parser.add_argument("--world", type=int, default=8, help="codec mode: W")
    parser.add_argument("--seeds", default="0,1,2", help="accumulation mode")
    parser.add_argument("--checkpoint", default="out/ablate/fp32/adamw/ranks2/seed1337/ckpt.pt", help="fsdp mode")
    parser.add_argument("--last", type=int, default=8, help="fsdp mode: steps measured")
    parser.add_argument("--sides", default="auto", choices=["auto", "both", "left", "right"],
                        help="fsdp mode: which sides the subspace rotation rotates (GeoOptions)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the codec and transform (kernels.compile_hot_path)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    kernels.compile_hot_path(args.compile)
    if args.mode in ("collective", "fsdp", "accumulation"):
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # the accumulation study's small models stay on the CPU: gloo
        gpu = torch.cuda.is_available() and args.mode != "accumulation"
        dist.init_process_group("nccl" if gpu else "gloo")
        if args.mode == "accumulation":
            result = accumulation_runs([int(s) for s in args.seeds.split(",")], args.steps)
            if dist.get_rank() == 0:
                print_accumulation(result)
        elif args.mode == "collective":
            result = time_collective([float(s) for s in args.sizes.split(",")], args.iters,
                                     args.methods.split(","))
            if dist.get_rank() == 0:
                print_collective(result)
        else:
            result = fsdp_fidelity(args.checkpoint, args.steps, args.last, args.geo_rank, args.sides,
                                   batch_size=args.batch_size, block_size=args.block_size)
            if dist.get_rank() == 0:
                print(json.dumps(result, indent=1))
        dist.destroy_process_group()
    elif args.mode == "codec":
        result = codec_launches(args.preset or "llama-600m", args.world, args.iters)
        print(json.dumps(result, indent=1))
    elif args.mode == "step":
        result = step_profile(args.preset or "cpu-tiny", args.steps, args.batch_size, args.block_size)
        print(json.dumps(result, indent=1))
    elif args.mode == "overhead":
        result = [measure_overhead(args.steps, args.preset or "cpu-tiny", args.batch_size,
                                   args.block_size, refresh=r, geo_rank=args.geo_rank)
                  for r in (int(x) for x in args.refresh.split(","))]
        print(json.dumps(result, indent=1))
    else:
        result = [analytic_flops(args.preset or "llama-600m", args.tokens, args.geo_rank, int(r))
                  for r in args.refresh.split(",")]
        print(json.dumps(result, indent=1))
    if args.json and int(os.environ.get("RANK", 0)) == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
    runtime.leave_if_distributed()  # as train.py: gloo's teardown may abort a finished rank
