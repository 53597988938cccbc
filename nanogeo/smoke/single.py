"""
The one-process checks (`python -m nanogeo.smoke --out smoke.json`, no --nproc): one rank
of the backend train.py would pick, so no network is measured. Each check returns a dict of
figures, printed as one JSON line and kept in --out.

    timed            median seconds of a function, device synchronized (nanogeo.lab.bench's)
    check_env        device, torch, CUDA and NCCL versions
    check_nccl       the collective's calls on a 1-rank group, and NCCL's float8 sum
    check_codec      the packed codec's round trip in GB/s (e4m3, e5m2 eager and compiled; nvfp4)
    check_transform  the rotation's encode + decode of every rotated matrix of a preset, ms
    check_ddp        the DDP hook against plain DDP (make gpu-smoke's ddp check runs it too)
    check_step       a preset's forward + backward + AdamW step, ms and tokens/s
    one_process      all of them, the transform last (it is read as a fraction of the step)
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import compress
from nanogeo.parallel import hooks
import model as model_lib
from nanogeo.wire import kernels, packing
from nanogeo.parallel.communicator import Options
from nanogeo.run import runtime
from nanogeo.lab.bench import timed     # (here for its old name, smoke.timed, too)


def check_env(device):
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
    return info


def check_nccl(device):
    """The collective's calls on a 1-rank group of the backend train.py would pick."""
    x = torch.arange(1000, dtype=torch.uint8, device=device)
    recv = torch.empty_like(x)
    dist.all_to_all_single(recv, x, [1000], [1000])
    slots = list(torch.zeros(1, 1000, dtype=torch.uint8, device=device).unbind())
    dist.all_gather(slots, x)
    grads = [torch.randn(256, 512, device=device), torch.randn(300, device=device)]
    layout = compress.ShardLayout([g.shape for g in grads], "e4m3", 128, 1)
    means, _ = compress.all_reduce_mean(grads, layout)
    error = (sum((a - b).pow(2).sum() for a, b in zip(means, grads))
             / sum(g.pow(2).sum() for g in grads)).sqrt().item()
    # the paper's collective sums float8 codes in NCCL itself (needs NCCL >= 2.24, sm >= 90)
    codes = torch.full((1000,), 2.0, device=device).to(torch.float8_e5m2)
    try:
        dist.all_reduce(codes)
        float8_sum = bool((codes.float() == 2.0).all())   # one rank: the sum is the input
    except RuntimeError as e:
        float8_sum = f"unsupported: {str(e).splitlines()[0]}"
    return {"backend": dist.get_backend(), "uint8_all_to_all": torch.equal(recv, x),
            "uint8_all_gather": torch.equal(slots[0], x), "all_reduce_mean_rel_err": error,
            "float8_all_reduce_sum": float8_sum}


def check_codec(device, numel, iters, with_compiled=True):
    """One round trip of numel values in blocks of 128 through the packed codec (FP8: eager and,
    with_compiled, compiled) and NVFP4's."""
    x = torch.randn(numel, device=device)
    groups = compress.scale_groups(x, 128)
    rows = []
    for fmt in ("e4m3", "e5m2", "nvfp4"):
        for compiled in ((False, True) if fmt != "nvfp4" and with_compiled else (False,)):
            kernels.compile_hot_path(compiled)
            trip = ((lambda: packing.unpack_groups(packing.pack_groups(groups, fmt), 128, fmt))
                    if fmt != "nvfp4" else (lambda: compress.dequantize(compress.quantize(x, fmt, 128))))
            seconds = timed(trip, iters)
            rows.append({"fmt": fmt, "compiled": compiled, "ms": seconds * 1000,
                         "gb_per_s": 4 * numel / seconds / 1e9})
    kernels.compile_hot_path(False)
    return rows


def rotated_shapes(net):
    opts = Options(geometry="subspace", vocab_size=net.config.vocab_size)
    linear = set(hooks.linear_layers(net))
    return [tuple(p.shape) for n, p in net.named_parameters()
            if compress.why_euclidean(n, tuple(p.shape), opts, linear) is None]


def check_transform(device, net, iters, geo_rank=16):
    """encode_geo + decode_geo of every rotated matrix once: GeoFP8's per-step transform."""
    shapes = rotated_shapes(net)
    work = []
    for k, (m, n) in enumerate(shapes):
        g = torch.Generator().manual_seed(k)
        U = torch.linalg.qr(torch.randn(m, geo_rank, generator=g)).Q.to(device)
        V = torch.linalg.qr(torch.randn(n, geo_rank, generator=g)).Q.to(device)
        bases = (compress.HouseholderBasis.complete(U), compress.HouseholderBasis.complete(V))
        work.append((torch.randn(m, n, device=device), bases))

    def step():
        for G, bases in work:
            compress.decode_geo(compress.encode_geo(G, *bases), *bases)

    out = {"matrices": len(shapes), "elements": sum(m * n for m, n in shapes), "geo_rank": geo_rank,
           "state_mb": sum((m + n) * geo_rank * 4 for m, n in shapes) / 1e6}
    out["eager_ms"] = timed(step, iters) * 1000        # (the transforms are not compiled)
    return out


def check_ddp(device, width=256, tokens=64):
    """The hook on the GPU side stream against plain DDP, on every rank of the default group (each
    rank its own inputs): equal within FP8 error."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from nanogeo.parallel.ddp import CompressHookState, compress_hook
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
    nets = []
    for hooked in (False, True):
        torch.manual_seed(0)
        net = torch.nn.TransformerEncoder(layer, 2).to(device)
        ids = [device.index] if device.type == "cuda" else None
        net = DDP(net, device_ids=ids)
        if hooked:
            # (no optimizer in this check: the layers are judged in plain L2, said so)
            state = CompressHookState(net, geometry="subspace", geo_warmup=1, geo_rank=8,
                                    geo_judge="l2")
            net.register_comm_hook(state, compress_hook)
        nets.append(net)
    errors = []
    inputs = torch.Generator().manual_seed(1000 + dist.get_rank())
    for step in range(4):
        x = torch.randn(8, tokens, width, generator=inputs).to(device)
        for net in nets:
            net.zero_grad()
            net(x).pow(2).mean().backward()
        ref, got = ([p.grad for p in net.parameters()] for net in nets)
        errors.append((sum((a - b).pow(2).sum() for a, b in zip(ref, got))
                       / sum(a.pow(2).sum() for a in ref)).sqrt().item())
    coords = [c.coords(n) for c in state.communicators.values() for n in c.names]
    return {"rel_err_per_step": errors, "geo_matrices": coords.count("geo"),
            "side_stream": bool(state.streams), "bytes_sent": state.reset_bytes(),
            "grads_sha256": runtime.parameter_checksum([p.grad for p in nets[1].parameters()])}


def check_step(device, preset, batch_size, block_size, iters, with_compiled=True):
    cfg = model_lib.model_config(preset, block_size=block_size)
    raw = model_lib.Llama(cfg).to(device)
    optimizer = raw.configure_optimizers(0.1, 3e-4, (0.9, 0.95), fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (batch_size, block_size), device=device)
    out = {"preset": preset, "params_m": sum(p.numel() for p in raw.parameters()) / 1e6,
           "tokens": batch_size * block_size}
    for compiled in (False, True) if with_compiled else (False,):
        net = torch.compile(raw, dynamic=False) if compiled else raw

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = net(x, x)[1]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = timed(step, iters)
        key = "compiled" if compiled else "eager"
        out[f"{key}_ms"] = seconds * 1000
        out[f"{key}_tokens_per_s"] = batch_size * block_size / seconds
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return out, raw


def one_process(args):
    """The checks above on one rank (the command line without --nproc); --out keeps them."""
    if reason := runtime.cuda_build_missing():
        print(f"nanogeo.smoke: error: {reason}", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    results = {"env": check_env(device)}
    print(json.dumps(results["env"]), flush=True)
    checks = [("nccl", lambda: check_nccl(device)),
              ("codec", lambda: check_codec(device, int(args.numel), args.iters, args.compile)),
              ("ddp", lambda: check_ddp(device))]
    for name, fn in checks:
        results[name] = fn()
        print(name, json.dumps(results[name]), flush=True)
    results["step"], net = check_step(device, args.preset, args.batch_size, args.block_size,
                                      args.iters, args.compile)
    print("step", json.dumps(results["step"]), flush=True)
    results["transform"] = check_transform(device, net, args.iters)
    results["transform"]["fraction_of_step"] = (results["transform"]["eager_ms"]
                                                / results["step"]["eager_ms"])
    print("transform", json.dumps(results["transform"]), flush=True)
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results
