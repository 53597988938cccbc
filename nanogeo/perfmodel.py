"""
An analytic step-time model: where can GeoFP8's end-to-end gain come from, and how does it scale?

    python -m nanogeo.perfmodel                                  # Llama-600M on 64 GH200
    python -m nanogeo.perfmodel --preset llama-300m --nodes 1,2,4,8,16 --inter_gbps 25

A data-parallel step is

    step = compute + codec + exposed communication
    compute  = 6 N T (+ attention) flops / (MFU x peak)           T = tokens per GPU per step
    codec    = quantize/dequantize passes over the gradient (memory bound, HBM bandwidth)
               + GeoFP8's rotations, 16 m n r flops per rotated matrix (+ the basis refresh)
    comm     = alpha-beta model of the collective on the slowest link a GPU uses
    exposed  = comm - the part hidden behind the backward pass (`overlap` x backward time)

Collectives (bytes per GPU, gradient of N elements, P GPUs, g per node):
  bf16/fp32 ring all-reduce: 2 (P-1)/P N b, every byte crosses the ring's inter-node hops, so at
      the NIC bandwidth per GPU; 2 (P-1) latency steps.
  FP8 all_to_all + all_gather: (P-1)/P N (1 + 4/block) each stage; of the all_to_all, the
      (P-g)/P that leaves the node runs at the NIC bandwidth and the rest over NVLink in parallel;
      the all_gather is a ring; P-1 latency steps each.
All numbers are assumptions, printed with the result; change them with flags.
"""

import argparse
import math
from dataclasses import dataclass, asdict

import torch

import compress
import model as model_lib

BYTES_PER_ELEMENT = {"fp32": 4.0, "bf16": 2.0}


@dataclass
class Cluster:
    gpus_per_node: int = 4            # GH200: 4 superchips per node (Alps, JUPITER)
    nodes: int = 16
    peak_tflops: float = 989.0        # H100/GH200 dense bf16
    mfu: float = 0.40
    hbm_gbps: float = 4000.0          # GH200 HBM3 ~4 TB/s
    intra_gbps: float = 150.0         # NVLink per GPU per direction
    inter_gbps: float = 25.0          # one 200 Gb/s NIC per GPU
    alpha_us: float = 5.0             # latency per collective step
    overlap: float = 0.5              # fraction of the backward pass that can hide communication
    geo_gemm_efficiency: float = 0.3  # thin (r-wide) GEMMs of the rotation run far below peak

    @property
    def gpus(self):
        return self.gpus_per_node * self.nodes


def ring_allreduce_seconds(numel, bytes_per_element, c: Cluster):
    """Ring all-reduce: 2 (P-1)/P of the buffer per GPU through the NIC (or NVLink in one node)."""
    p = c.gpus
    if p == 1:
        return 0.0
    link = c.inter_gbps if c.nodes > 1 else c.intra_gbps
    return 2 * (p - 1) / p * numel * bytes_per_element / (link * 1e9) + 2 * (p - 1) * c.alpha_us * 1e-6


def fp8_collective_seconds(numel, bytes_per_element, c: Cluster):
    """all_to_all (inter-node part at NIC speed, intra-node part over NVLink, concurrently) then
    a ring all_gather of the re-quantized shards."""
    p, g = c.gpus, c.gpus_per_node
    if p == 1:
        return 0.0
    stage = (p - 1) / p * numel * bytes_per_element
    inter = (p - g) / max(p - 1, 1) * stage
    intra = stage - inter
    a2a = max(inter / (c.inter_gbps * 1e9), intra / (c.intra_gbps * 1e9))
    gather = stage / ((c.inter_gbps if c.nodes > 1 else c.intra_gbps) * 1e9)
    return a2a + gather + 2 * (p - 1) * c.alpha_us * 1e-6


def wire_bytes_per_element(fmt, block=128):
    if fmt == "nvfp4":
        return 0.5 + 1 / compress.NVFP4_BLOCK  # + 4 bytes per tensor piece, negligible
    return 1 + 4 / block


def geo_flops(preset, rank, refresh=4, iters=1):
    """GeoFP8 flops per step on one GPU at a preset's shapes: encode + decode (16 m n r per
    rotated matrix) plus, every `refresh` steps, a basis refresh: subspace iteration
    (8 m n r per iteration), the gain check (8 m n r), QR and Householder (4 (m+n) r^2)."""
    cfg = model_lib.model_config(preset)
    with torch.device("meta"):
        net = model_lib.Llama(cfg)
    opts = compress.GeoOptions(rank=rank, vocab_size=cfg.vocab_size)
    total = 0.0
    for name, p in net.named_parameters():
        if compress.exemption(name, tuple(p.shape), opts) is None:
            m, n = p.shape
            r = min(rank, min(m, n) // 2)
            update = iters * 8 * m * n * r + 8 * m * n * r + 4 * (m + n) * r * r
            total += 16 * m * n * r + update / refresh
    return total, net


def step_time(preset, comm, c: Cluster, tokens_per_gpu=8192, rank=16, block=128):
    """Seconds per step and its parts for one method ('fp32', 'bf16', 'fp8', 'geofp8', 'nvfp4',
    'geo-nvfp4')."""
    geo_total, net = geo_flops(preset, rank)
    cfg = net.config
    numel = net.num_params()
    train_flops = net.flops_per_token(cfg.block_size) * tokens_per_gpu
    compute = train_flops / (c.mfu * c.peak_tflops * 1e12)
    backward = compute * 2 / 3
    codec = 0.0
    if comm in BYTES_PER_ELEMENT:
        comm_s = ring_allreduce_seconds(numel, BYTES_PER_ELEMENT[comm], c)
    else:
        fmt = "nvfp4" if "nvfp4" in comm else "e4m3"
        comm_s = fp8_collective_seconds(numel, wire_bytes_per_element(fmt, block), c)
        # two quantize + two dequantize passes, each reading/writing ~5-8 bytes per element
        codec = 4 * numel * 6 / (c.hbm_gbps * 1e9)
        if comm.startswith("geo"):
            codec += geo_total / (c.geo_gemm_efficiency * c.peak_tflops * 1e12)
    exposed = comm_s - min(comm_s, c.overlap * backward)
    return {"comm": comm, "compute_s": compute, "codec_s": codec, "comm_s": comm_s,
            "exposed_comm_s": exposed, "step_s": compute + codec + exposed,
            "geo_flops_fraction": geo_total / train_flops}


def compare(preset, c: Cluster, tokens_per_gpu=8192, rank=16, comms=("bf16", "fp8", "geofp8")):
    rows = [step_time(preset, m, c, tokens_per_gpu, rank) for m in comms]
    base = rows[0]["step_s"]
    for r in rows:
        r["vs_first"] = r["step_s"] / base - 1
    return rows


def solve_inter_bandwidth(preset, c: Cluster, target, tokens_per_gpu=8192, rank=16):
    """The NIC bandwidth per GPU (GB/s) at which GeoFP8's step time is `target` (e.g. -0.076)
    relative to bf16, by bisection on a log scale (the gain shrinks as links get faster).
    None if no bandwidth in [0.1, 100000] GB/s gives it."""
    def gain(gbps):
        cluster = Cluster(**{**asdict(c), "inter_gbps": gbps})
        return compare(preset, cluster, tokens_per_gpu, rank, ("bf16", "geofp8"))[1]["vs_first"]
    lo, hi = 0.1, 100000.0
    if not (gain(lo) <= target <= gain(hi)):
        return None
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gain(mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def print_rows(rows, title):
    print(title)
    print(f"  {'comm':>9s} {'compute':>9s} {'codec':>8s} {'comm':>8s} {'exposed':>8s} {'step':>8s} {'vs ' + rows[0]['comm']:>9s}")
    for r in rows:
        print(f"  {r['comm']:>9s} {1e3 * r['compute_s']:8.1f}ms {1e3 * r['codec_s']:6.1f}ms "
              f"{1e3 * r['comm_s']:6.1f}ms {1e3 * r['exposed_comm_s']:6.1f}ms "
              f"{1e3 * r['step_s']:6.1f}ms {100 * r['vs_first']:+8.1f}%")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", default="llama-600m")
    parser.add_argument("--nodes", default="16", help="comma-separated node counts to scan")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--comms", default="bf16,fp8,geofp8,nvfp4")
    parser.add_argument("--target", type=float, default=-0.076,
                        help="solve for the NIC bandwidth that gives this GeoFP8 vs bf16 change")
    for field, value in asdict(Cluster()).items():
        if field != "nodes":
            parser.add_argument(f"--{field}", type=type(value), default=value)
    args = parser.parse_args(argv)
    settings = {k: getattr(args, k) for k in asdict(Cluster()) if k != "nodes"}
    print("assumptions: " + ", ".join(f"{k}={v}" for k, v in settings.items())
          + f", tokens/GPU/step={args.tokens}, r={args.rank}")
    for nodes in (int(n) for n in args.nodes.split(",")):
        cluster = Cluster(nodes=nodes, **settings)
        rows = compare(args.preset, cluster, args.tokens, args.rank, tuple(args.comms.split(",")))
        print_rows(rows, f"{args.preset} on {cluster.gpus} GPUs ({nodes} nodes):")
        gbps = solve_inter_bandwidth(args.preset, cluster, args.target, args.tokens, args.rank)
        if gbps is None:
            print(f"  no NIC bandwidth gives {100 * args.target:+.1f}% here")
        else:
            at = compare(args.preset, Cluster(**{**asdict(cluster), "inter_gbps": gbps}),
                         args.tokens, args.rank, ("bf16", "geofp8"))
            print(f"  GeoFP8 vs bf16 = {100 * args.target:+.1f}% at a NIC bandwidth of {gbps:.1f} GB/s "
                  f"per GPU (bf16 exposed comm then {100 * at[0]['exposed_comm_s'] / at[0]['step_s']:.1f}% "
                  "of its step)")
    return rows


if __name__ == "__main__":
    main()
