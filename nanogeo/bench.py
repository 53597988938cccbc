"""
Benchmarks of the collective and of GeoFP8's compute cost. Not tests: numbers for BENCHMARKS.md.

    torchrun --standalone --nproc_per_node=2 -m nanogeo.bench collective [--sizes 1,4,16] [--iters 5]
    python -m nanogeo.bench overhead [--steps 10]
    python -m nanogeo.bench flops [--preset llama-600m --tokens 8192 --rank 16 --refresh 1,4]

collective: each method on one bucket of N million fp32 gradient elements, shaped as square-ish
  matrices (so GeoFP8 has something to rotate), timed with a per-stage breakdown (rotate =
  geometry-aware encode + decode, geometry = the basis refresh) and the bytes each rank sent.
  Methods are compared as ratios within one run: this machine is noisy.
overhead: GeoFP8's extra compute per step (encode, decode, basis refresh) over Euclidean FP8, on
  the real gradients of the cpu-tiny preset, relative to that preset's forward + backward.
flops: the same overhead, analytically, at a preset's shapes: 16 m n r flops per rotated matrix
  per step (encode + decode, both sides) plus the refresh, versus ~6 T N training flops.
"""

import argparse
import json
import math
import os
import time
import types

import torch
import torch.distributed as dist

import compress
import model as model_lib
import train
from nanogeo import perfmodel


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
    """A dominant low-rank part shared by all ranks plus per-rank noise: LLM-like anisotropy."""
    out = []
    for k, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(1000 * k + step)
        if len(shape) == 1:
            out.append(torch.randn(shape, generator=g))
            continue
        m, n = shape
        left, right = torch.randn(m, 8, generator=g), torch.randn(8, n, generator=g)
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(7 + 1000 * k + step * 31 + rank))
        out.append(left @ right / 8 + 0.3 * noise)
    return out


METHODS = {
    "fp32": None, "bf16": None,
    "fp8": compress.GeoOptions(geo=False),
    "geofp8": compress.GeoOptions(geo=True, min_numel=4096),
    "nvfp4": compress.GeoOptions(geo=False, fmt="nvfp4"),
}


def time_collective(sizes, iters, methods):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    rows = []
    for size in sizes:
        shapes = bucket_shapes(size)
        numel = sum(math.prod(s) for s in shapes)
        bf16_bytes = train.ring_allreduce_bytes(numel, 2, world)
        for method in methods:
            opts = METHODS[method]
            timer = compress.StageTimer()
            comm = (compress.GeoFP8Communicator([(f"m{k}.weight", s) for k, s in enumerate(shapes)],
                                                opts, timer=timer) if opts else None)
            seconds, sent = [], 0
            for step in range(iters + 1):  # step 0 warms up (and gives GeoFP8 its first bases)
                grads = [g.to(device) for g in planted_gradients(shapes, step, rank, world)]
                dist.barrier()
                if step == 1:
                    timer.seconds.clear()
                t0 = time.perf_counter()
                if comm is None:
                    cfg = train.TrainConfig(comm=method)
                    holders = [types.SimpleNamespace(grad=g) for g in grads]
                    sent = train.reduce_gradients(holders, cfg, None, world)
                else:
                    sent = comm.reduce(grads)
                if step:
                    seconds.append(time.perf_counter() - t0)
            per_step = sorted(seconds)[len(seconds) // 2]  # median
            breakdown = {k: v / iters * 1000 for k, v in timer.seconds.items()}
            rows.append({"million_elements": size, "method": method, "world": world,
                         "ms": per_step * 1000, "bytes_sent": sent,
                         "bytes_vs_bf16": sent / bf16_bytes, "breakdown_ms": breakdown})
    return rows


def print_collective(rows):
    print(f"{'size':>6s} {'method':>8s} {'ms':>9s} {'vs fp32':>8s} {'MB sent':>9s} {'vs bf16':>8s}  breakdown (ms)")
    base = {r["million_elements"]: r["ms"] for r in rows if r["method"] == "fp32"}
    for r in rows:
        parts = " ".join(f"{k}={v:.1f}" for k, v in r["breakdown_ms"].items())
        rel = r["ms"] / base[r["million_elements"]] if r["million_elements"] in base else float("nan")
        print(f"{r['million_elements']:5g}M {r['method']:>8s} {r['ms']:9.1f} {rel:8.2f} "
              f"{r['bytes_sent'] / 1e6:9.2f} {r['bytes_vs_bf16']:8.3f}  {parts}")


def measure_overhead(steps, preset="cpu-tiny", batch_size=8, block_size=128, refresh=1, rank=16):
    """GeoFP8 extra compute per step on one rank, against forward + backward of the preset."""
    torch.manual_seed(0)
    cfg = model_lib.model_config(preset, block_size=block_size)
    net = model_lib.Llama(cfg)
    x = torch.randint(0, 50257, (batch_size, block_size))
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
    for name, opts in (("fp8", compress.GeoOptions(geo=False, vocab_size=cfg.vocab_size)),
                       ("geofp8", compress.GeoOptions(geo=True, vocab_size=cfg.vocab_size,
                                                      refresh=refresh, rank=rank))):
        comm = compress.GeoFP8Communicator(named, opts)
        comm.reduce_workers([grads])  # first bases
        t0 = time.perf_counter()
        for _ in range(steps):
            comm.reduce_workers([grads])
        results[name] = (time.perf_counter() - t0) / steps
        geo_layers = sum(comm.coords(n) == "geo" for n, _ in named)
    overhead = results["geofp8"] - results["fp8"]
    return {"preset": preset, "refresh": refresh, "rank": rank,
            "tokens": batch_size * block_size, "fwd_bwd_ms": fwd_bwd_s * 1000,
            "fp8_codec_ms": results["fp8"] * 1000, "geofp8_codec_ms": results["geofp8"] * 1000,
            "geo_overhead_ms": overhead * 1000, "overhead_vs_fwd_bwd": overhead / fwd_bwd_s,
            "geo_layers": geo_layers}


def analytic_flops(preset, tokens, rank, refresh=4):
    """GeoFP8 flops per step / training flops per step, at a preset's shapes."""
    geo, net = perfmodel.geo_flops(preset, rank, refresh)
    train_flops = net.flops_per_token(net.config.block_size) * tokens
    return {"preset": preset, "tokens_per_rank": tokens, "rank": rank,
            "refresh": refresh, "geo_gflops": geo / 1e9, "train_gflops": train_flops / 1e9,
            "fraction": geo / train_flops}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("mode", choices=["collective", "overhead", "flops"])
    parser.add_argument("--sizes", default="1,4,16", help="million elements per bucket")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--methods", default="fp32,bf16,fp8,geofp8,nvfp4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--refresh", default="1,4", help="basis refresh intervals to try")
    parser.add_argument("--preset", default="llama-600m")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16, help="r (the GeoOptions default)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.mode == "collective":
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rows = time_collective([float(s) for s in args.sizes.split(",")], args.iters,
                               args.methods.split(","))
        if dist.get_rank() == 0:
            print_collective(rows)
        dist.destroy_process_group()
        result = rows
    elif args.mode == "overhead":
        result = [measure_overhead(args.steps, refresh=r, rank=args.rank)
                  for r in (int(x) for x in args.refresh.split(","))]
        print(json.dumps(result, indent=1))
    else:
        result = [analytic_flops(args.preset, args.tokens, args.rank, int(r))
                  for r in args.refresh.split(",")]
        print(json.dumps(result, indent=1))
    if args.json and (args.mode != "collective" or not dist.is_initialized() or dist.get_rank() == 0):
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
