"""
The numbers a first GPU run should bring home. Not checks: nothing here can PASS or FAIL.
On CUDA, `make gpu-smoke`'s ranks run them after the checks; the launcher prints them as
markdown rows that BENCHMARKS.md §9 can take as they are, and smoke.json keeps them.

    time_exchanges  the two-stage FP8 (e4m3, blocks of 128) and NVFP4 collectives against
                    NCCL's bf16 all_reduce (cast, sum, mean back in fp32, as train.py's
                    --comm=bf16), per bucket size: ms, time vs bf16, bus bandwidth
    time_steps      one training step of a preset - forward and backward in bf16 autocast,
                    the gradients' exchange, AdamW - with --comm=bf16, fp8 and subspace: ms,
                    time vs bf16, peak device memory
    markdown        both as markdown table rows
    gpu_figures     what the smoke runs on a GPU: 16M and 64M elements, one llama-300m step

Bus bandwidth is the bytes one rank put on the wire per second: for the bf16 all_reduce
2 (W - 1) / W x 2 bytes an element, NCCL-tests' "busbw"; for the FP8 and NVFP4 collectives the
bytes they send (~0.52x and ~0.28x bf16's). Every time is the median over `iters` steps after
warm-up ones, each started together (a barrier) and read with the device synchronized; the
ranks' inputs are random (the codec's cost does not depend on the values, and the subspace
rotation's per-step cost not on what it finds). tests/test_smoke.py runs these at toy size on
gloo, so that they cannot break unseen.
"""

import time

import torch
import torch.distributed as dist

import model as model_lib
from nanogeo.lab import bench
from nanogeo.parallel import hooks
from nanogeo.parallel.communicator import Options, ProductionCommunicator

EXCHANGE_SIZES = (16, 64)                   # million elements (BENCHMARKS §9's GPU rows)
STEP_PRESET, STEP_BATCH, STEP_BLOCK = "llama-300m", 4, 2048     # tokens per rank: 4 x 2048


def timed_together(fn, iters, device, warm=2):
    """Median seconds of fn() over `iters` calls after `warm` untimed ones; every rank starts
    each call together and reads the clock with the device synchronized."""
    seconds = []
    for k in range(warm + iters):
        bench.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        bench.synchronize(device)
        if k >= warm:
            seconds.append(time.perf_counter() - t0)
    return sorted(seconds)[len(seconds) // 2]


def time_exchanges(device, sizes=EXCHANGE_SIZES, iters=5):
    """[{million_elements, method, ms, vs_bf16, bytes_sent, bus_gb_per_s}] for bf16 (NCCL's
    all_reduce), fp8 and nvfp4 (the two-stage collectives, as training runs them) on a bucket
    of square-ish matrices of each size (nanogeo.lab.bench's)."""
    world, rows = dist.get_world_size(), []
    for million in sizes:
        shapes = bench.bucket_shapes(million)
        rng = torch.Generator(device=device).manual_seed(dist.get_rank())
        grads = [torch.randn(s, generator=rng, device=device) for s in shapes]
        named = [(f"m{k}.weight", s) for k, s in enumerate(shapes)]
        bf16_ms = None
        for method in ("bf16", "fp8", "nvfp4"):
            if method == "bf16":
                sent = bench.baseline_allreduce(grads, torch.bfloat16, world)
                seconds = timed_together(
                    lambda: bench.baseline_allreduce(grads, torch.bfloat16, world), iters, device)
            else:
                comm = ProductionCommunicator(named, bench.METHODS[method])
                sent = comm.reduce(grads)
                seconds = timed_together(lambda: comm.reduce(grads), iters, device)
            ms = 1000 * seconds
            bf16_ms = ms if method == "bf16" else bf16_ms
            rows.append({"million_elements": million, "method": method, "world": world,
                         "ms": ms, "vs_bf16": ms / bf16_ms, "bytes_sent": sent,
                         "bus_gb_per_s": sent / seconds / 1e9})
        del grads
    return rows


def time_steps(device, preset=STEP_PRESET, batch_size=STEP_BATCH, block_size=STEP_BLOCK,
               iters=5, comms=("bf16", "fp8", "subspace")):
    """[{preset, comm, tokens_per_rank, ms, vs_bf16, peak_memory_gib, geo_matrices}]: a step of
    the preset with each gradient exchange (fp8: Euclidean e4m3 two-stage; subspace: the
    rotation, from step 1, its bases refreshed every 4 steps: the warm-up steps build them).
    One model for all three, a fresh AdamW for each (its state counts in the peak memory, which
    is None off CUDA)."""
    world = dist.get_world_size()
    cuda = device.type == "cuda"
    cfg = model_lib.model_config(preset, block_size=block_size)
    torch.manual_seed(0)
    net = model_lib.Llama(cfg).to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    named = [(n, p.shape) for n, p in net.named_parameters() if p.requires_grad]
    rng = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (batch_size, block_size), generator=rng, device=device)
    rows, bf16_ms = [], None
    for comm in comms:
        optimizer = net.configure_optimizers(0.1, 3e-4, (0.9, 0.95), fused=cuda)
        communicator = None
        if comm != "bf16":
            options = Options(geometry="euclidean" if comm == "fp8" else "subspace",
                              vocab_size=cfg.vocab_size, geo_warmup=1)
            communicator = ProductionCommunicator(named, options,
                                                  linear=set(hooks.linear_layers(net)))
            communicator.watch(hooks.optimizer_views([optimizer], net))

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = net(x, x)[1]
            loss.backward()
            grads = [p.grad for p in params]
            if communicator is None:
                bench.baseline_allreduce(grads, torch.bfloat16, world)
            else:
                communicator.reduce(grads)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        ms = 1000 * timed_together(step, iters, device, warm=6)
        bf16_ms = ms if comm == "bf16" else bf16_ms
        rows.append({"preset": preset, "comm": comm, "world": world,
                     "tokens_per_rank": batch_size * block_size, "ms": ms, "vs_bf16": ms / bf16_ms,
                     "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30
                                         if cuda else None),
                     # the matrices sent in rotated coordinates by the end (the gain check
                     # chooses them, as in train.py; 0 would mean the rotation was not timed)
                     "geo_matrices": (sum(communicator.sent_in_geometry(n)
                                          for n in communicator.layers)
                                      if communicator else 0)})
        del optimizer, communicator
    return rows


def markdown(exchanges, steps, where):
    """Markdown rows of both tables, headed by `where` (the node, versions, iterations)."""
    lines = [f"{where}; medians, not checked:", "",
             "| collective | elements | ms | time vs bf16 | bus GB/s |", "|---|---|---|---|---|"]
    names = {"bf16": "NCCL bf16 all_reduce", "fp8": "two-stage e4m3", "nvfp4": "two-stage NVFP4"}
    for r in exchanges:
        lines.append(f"| {names[r['method']]} | {r['million_elements']:g}M | {r['ms']:.2f} | "
                     f"{r['vs_bf16']:.2f} | {r['bus_gb_per_s']:.1f} |")
    lines += ["", "| step | comm | ms | time vs bf16 | peak GiB | rotated matrices |",
              "|---|---|---|---|---|---|"]
    for r in steps:
        peak = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        lines.append(f"| {r['preset']}, {r['tokens_per_rank']} tokens/rank | {r['comm']} | "
                     f"{r['ms']:.1f} | {r['vs_bf16']:.2f} | {peak} | {r['geo_matrices']} |")
    return lines


def gpu_figures(device, iters, sizes=EXCHANGE_SIZES, preset=STEP_PRESET,
                batch_size=STEP_BATCH, block_size=STEP_BLOCK):
    """Everything above, as smoke.json keeps it: {"exchange", "step", "markdown"}. With one
    rank nothing is exchanged: no collective rows (their times would be a local copy's)."""
    world = dist.get_world_size()
    exchanges = time_exchanges(device, sizes, iters) if world > 1 else []
    steps = time_steps(device, preset, batch_size, block_size, iters)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    where = (f"make gpu-smoke on {world} x {name}, torch {torch.__version__}, CUDA "
             f"{torch.version.cuda}, {iters} iterations")
    return {"exchange": exchanges, "step": steps, "markdown": markdown(exchanges, steps, where)}
