"""
An analytic step-time model: what does each gradient-communication method cost end to end, and
which machine parameters reproduce the paper's reported timings?

    python -m nanogeo.tools.perfmodel paper                       # calibrate to the paper's cluster
    python -m nanogeo.tools.perfmodel                             # llama-600m, 4 GPUs per node, scan
    python -m nanogeo.tools.perfmodel --preset llama-300m --nodes 1,2,4,8,16 --inter_gbps 25

The step
--------
A data-parallel step is

    step    = compute + codec + transform + exposed communication
    compute = training flops per GPU (6 N T + attention) / (MFU x peak)      T = tokens per GPU
    codec   = quantize / dequantize passes over the gradient (memory bound: bytes / HBM bandwidth)
    comm    = alpha-beta model of the collective on the slowest link a GPU uses
    exposed = comm - min(comm, overlap x backward)          backward = 2/3 of compute
              (or, overlap_model="fraction": (1 - overlap) x comm)

The transform (whitening, rotation) runs on the GPU between backward and the collective, so it is
added, never hidden. All numbers are assumptions, printed with every result.

Collectives (bytes per GPU, gradient of N elements, P GPUs, g per node)
-----------------------------------------------------------------------
  ring all-reduce (fp32: 4 B, bf16: 2 B per element): 2 (P-1)/P N b, at the NIC's bandwidth once
      the ring leaves a node; 2 (P-1) latency steps.
  fp8-sum (the paper's): an all-reduce MAX of one fp32 scale per tensor (latency only), then one
      ring all-reduce SUM on e5m2 codes, 1 B per element.
  fp8 / nvfp4 (this project's two-stage): all_to_all + all_gather, (P-1)/P N (1 + 4/block) bytes
      each; of the all_to_all, the (P-g)/P that leaves the node runs at the NIC's bandwidth and
      the rest over NVLink in parallel; the all_gather is a ring.

Transforms (per step; "refresh" work happens every K steps and is spread over them)
---------------------------------------------------------------------------------
A whitened layer has a weight gradient W (m x n = d_out x d_in) and a factor F, F F^T = A^ of the
layer's input second moment A (n x n). Encode W F^-T, decode W~ F^T.

  dense (published): F = L, a dense Cholesky factor. Encode is a triangular solve (m n^2 flops),
      decode a triangular multiply (m n^2). Error feedback in whitened coordinates adds a few
      streaming passes over W. Refresh: the forward pre-hook accumulates a^T a (2 T n^2 flops),
      A is all-reduced (n^2 fp32), eigendecomposed (9 n^3: symmetric QR with eigenvectors,
      Golub & Van Loan) and factored (Cholesky, n^3 / 3).
  lowrank (this project): the symmetric factor of A^ = D + U Lambda U^T applied as
      (W + (W Q) diag(c) Q^T) D^-1/2: 4 m n r flops each way. Refresh as above, with either the
      full eigendecomposition (what compress.whitening_factor does today) or ("lowrank-rand") a
      randomized top-r eigensolver, (q + 1) 2 n^2 r flops for q power iterations.
  subspace (this project's two-sided rotation): 16 m n r flops per rotated matrix plus a basis
      refresh every few steps (subspace_flops).

Dense linear algebra of the whitening (triangular kernels, a^T a, Cholesky, thin GEMMs) runs in
fp32 at `linalg_efficiency` x the fp32 peak; the eigensolver at its own `eigh_tflops` (cuSOLVER's
symmetric eigensolver is memory bound and reaches a few percent of peak).

Calibration to the paper
------------------------
The paper reports, for its 600M model on 64 nodes with one GH200 each (NDR InfiniBand, 50 GB/s
per node), end-to-end time against FP32 gradient communication: Euclidean FP8 (fp8-sum) -10.79 %,
GeoFP8 (fp8-sum + dense whitening of 13 MLP down-projections) -7.6 %. Two figures pin two
unknowns. `calibrate` fixes every other parameter at a stated value, solves for one parameter
from the FP8 figure (e.g. overlap) and one from the GeoFP8 - FP8 gap (e.g. MFU or the kernels'
efficiency), and `paper_report` checks that both are physically plausible. Read the figures this
way: the 3.19-point gap is the transform's cost as a share of the fp32 step, so the transform's
milliseconds fix the length of the fp32 step; the 10.79 % then fixes how much of the fp32
all-reduce was exposed. And since FP8 can save at most the whole difference between the two
collectives, the FP8 figure caps the fp32 step and with it the transform (`transform_budget`).
"""

import argparse
import math
from dataclasses import dataclass, asdict, replace

import torch

import compress
from nanogeo.parallel import hooks
from nanogeo.wire import nvfp4
import model as model_lib
from nanogeo.parallel.communicator import Options

# ----------------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    gpus_per_node: int = 4            # GH200: 4 superchips per node (Alps, JUPITER)
    nodes: int = 16
    peak_tflops: float = 989.0        # H100/GH200 dense bf16
    mfu: float = 0.40
    hbm_gbps: float = 4000.0          # GH200 HBM3 ~4 TB/s
    intra_gbps: float = 150.0         # NVLink per GPU per direction
    inter_gbps: float = 25.0          # achieved bandwidth of the NIC per GPU (one 200 Gb/s NIC)
    alpha_us: float = 5.0             # latency per collective step
    overlap: float = 0.5              # fraction of the backward pass that can hide communication
    overlap_model: str = "capacity"   # "capacity": hidden = min(comm, overlap x backward);
                                      # "fraction": hidden = overlap x comm (a fixed share of it)
    geo_gemm_efficiency: float = 0.3  # thin (r-wide) GEMMs of the rotation run far below peak
    fp32_tflops: float = 67.0         # H100/GH200 fp32 without tensor cores: the whitening's kernels
    linalg_efficiency: float = 0.5    # fraction of fp32_tflops the whitening's dense kernels reach
    eigh_tflops: float = 2.0          # sustained rate of a dense symmetric eigendecomposition

    @property
    def gpus(self):
        return self.gpus_per_node * self.nodes


PAPER_LINE_GBPS = 50.0   # NDR InfiniBand, 400 Gb/s per node = 50 GB/s each way


def paper_cluster(**overrides) -> Cluster:
    """The paper's cluster: 64 nodes, one GH200 each, so every byte of a collective crosses the
    NIC. Assumed: the achieved bus bandwidth at 90 % of the 50 GB/s line rate (NCCL's ring
    all-reduce over one 400 Gb/s NIC, the same for the all_to_all / all_gather); the whitening's
    fp32 triangular kernels at 70 % of the fp32 peak (cuBLAS trsm / trmm on matrices this large
    run near SGEMM speed); the eigensolver at 2 TFLOP/s (~3 % of the fp32 peak: cuSOLVER's
    symmetric eigensolver is memory bound). MFU and overlap are starting values that
    `calibrate` replaces when it solves for them."""
    return replace(Cluster(gpus_per_node=1, nodes=64, inter_gbps=0.9 * PAPER_LINE_GBPS,
                           intra_gbps=PAPER_LINE_GBPS, linalg_efficiency=0.7, eigh_tflops=2.0),
                   **overrides)


# ----------------------------------------------------------------------------------------------
# What runs: the model's shapes, tokens per GPU and the methods' settings
# ----------------------------------------------------------------------------------------------


def paper_600m_config() -> model_lib.ModelConfig:
    """The paper's 600M model: Llama style, 32 layers, d 1280, ffn 3456, 20 heads (no GQA),
    seq 2048, tied embeddings, Llama-2 tokenizer (vocabulary 32000). Built here rather than from
    a model.py preset so the vocabulary is the paper's (a 50304-vocabulary preset would add
    ~23M parameters to the gradient)."""
    return model_lib.ModelConfig(vocab_size=32000, block_size=2048, n_layer=32, n_embd=1280,
                                 n_head=20, n_kv_head=20, ffn_hidden=3456, tie_embeddings=True)


@dataclass
class Workload:
    """One GPU's share of a training step, and the settings of the transforms."""
    name: str
    numel: int                    # gradient elements (a tied weight counted once)
    tensors: int                  # gradient tensors (one fp32 scale each in fp8-sum)
    train_flops: float            # forward + backward flops per GPU per step
    tokens: int                   # tokens per GPU per step
    whitened: list                # [(m, n)] of the whitened layers (d_out, d_in)
    rotated: list                 # [(m, n)] of the subspace rotation's candidate matrices
    whiten_rank: int = 32         # r of the low-rank factor
    whiten_refresh: int = 50      # K: steps between refreshes of A and its factor
    power_iters: int = 4          # q of the randomized top-r eigensolver ("lowrank-rand")
    geo_rank: int = 16            # r of the subspace rotation
    geo_refresh: int = 4          # steps between subspace basis refreshes
    block: int = 128              # scaling block of the two-stage collective
    eigh_in_step: bool = True     # False: the refresh's eigendecompositions run off the critical
                                  # path (asynchronously, or the timing left refresh steps out)


def workload(model="llama-600m", tokens_per_gpu=8192, whitened_layers=13, **settings) -> Workload:
    """Shapes of a model (a preset name or a ModelConfig) on the meta device: no memory used.
    The whitened layers are `whitened_layers` MLP down-projections (d_out = n_embd, d_in =
    ffn_hidden), the paper's selection at 600M."""
    cfg = model_lib.model_config(model) if isinstance(model, str) else model
    with torch.device("meta"):
        net = model_lib.Llama(cfg)
    opts = Options(vocab_size=cfg.vocab_size)
    linear = set(hooks.linear_layers(net))
    rotated = [tuple(p.shape) for name, p in net.named_parameters()
               if compress.exemption(name, tuple(p.shape), opts, linear) is None]
    name = model if isinstance(model, str) else f"{net.num_params() / 1e6:.0f}M"
    return Workload(name=name, numel=net.num_params(), tensors=len(list(net.parameters())),
                    train_flops=net.flops_per_token(cfg.block_size) * tokens_per_gpu,
                    tokens=tokens_per_gpu, whitened=[(cfg.n_embd, cfg.ffn_hidden)] * whitened_layers,
                    rotated=rotated, **settings)


def paper_workload(**settings) -> Workload:
    """The paper's 600M run: global batch 512 x 2048 tokens over 64 GPUs = 16384 per GPU.
    The refresh's eigendecompositions are off the critical path unless settings say otherwise:
    with them in the step no plausible machine reproduces the published figures (see
    BENCHMARKS.md, "Performance model calibrated to the paper's cluster")."""
    settings.setdefault("eigh_in_step", False)
    return workload(paper_600m_config(), tokens_per_gpu=512 * 2048 // 64, **settings)


# ----------------------------------------------------------------------------------------------
# Collectives and codecs
# ----------------------------------------------------------------------------------------------

RING_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8-sum": 1.0}   # bytes per element on the wire
FP8_SUM_CODEC_BYTES = 14   # amax read (4), encode read 4 + write 1, decode read 1 + write 4
TWO_STAGE_CODEC_BYTES = 24  # two quantize + two dequantize passes of ~6 bytes per element


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
    """Bytes per element of the two-stage collective: codes plus one fp32 scale per block."""
    if fmt == "nvfp4":
        return 0.5 + 1 / nvfp4.NVFP4_BLOCK  # + 4 bytes per tensor piece, negligible
    return 1 + 4 / block


def collective_seconds(collective, w: Workload, c: Cluster):
    """(communication seconds, codec seconds) of one collective over the whole gradient."""
    if collective in ("fp32", "bf16"):
        return ring_allreduce_seconds(w.numel, RING_BYTES[collective], c), 0.0
    if collective == "fp8-sum":
        scales = ring_allreduce_seconds(w.tensors, 4, c)       # all-reduce MAX: latency only
        comm = scales + ring_allreduce_seconds(w.numel, RING_BYTES["fp8-sum"], c)
        return comm, w.numel * FP8_SUM_CODEC_BYTES / (c.hbm_gbps * 1e9)
    comm = fp8_collective_seconds(w.numel, wire_bytes_per_element(
        "nvfp4" if collective == "nvfp4" else "e4m3", w.block), c)
    return comm, w.numel * TWO_STAGE_CODEC_BYTES / (c.hbm_gbps * 1e9)


# ----------------------------------------------------------------------------------------------
# Transforms: per-step work plus refresh work amortised over the refresh interval
# ----------------------------------------------------------------------------------------------

EIGH_FLOPS = 9       # x n^3: symmetric QR with eigenvectors (Golub & Van Loan, 4th ed., 8.3)
APPLY_BYTES = 24     # per element: encode and decode each stream W about three times (4 B)
EF_BYTES = 29        # error feedback: U + R (12), local decode (5), new residual (12)


def linalg_seconds(flops, c: Cluster):
    return flops / (c.linalg_efficiency * c.fp32_tflops * 1e12)


def whitening_flops(kind, m, n, r, tokens, power_iters=4):
    """Flops of one whitened layer (m x n): {"apply": per step, encode + decode;
    "refresh": the dense kernels of one refresh; "eigh": the eigensolver of one refresh}."""
    accumulate = 2 * tokens * n * n                          # a^T a over this GPU's tokens
    if kind == "dense":
        return {"apply": 2 * m * n * n,                      # triangular solve + multiply
                "refresh": accumulate + n ** 3 / 3 + 2 * n * n * r,   # + Cholesky + A^
                "eigh": EIGH_FLOPS * n ** 3}
    apply = 8 * m * n * r                                    # two thin GEMMs each way
    if kind == "lowrank":
        return {"apply": apply, "refresh": accumulate + 4 * n * r * r, "eigh": EIGH_FLOPS * n ** 3}
    if kind == "lowrank-rand":                               # (q + 1) passes of A over n x r
        return {"apply": apply, "refresh": accumulate + (power_iters + 1) * (2 * n * n * r + 4 * n * r * r),
                "eigh": 0.0}
    raise ValueError(f"unknown whitening {kind!r}; choose dense, lowrank or lowrank-rand")


def whitening_seconds(kind, w: Workload, c: Cluster):
    """{"apply", "refresh", "eigh"} seconds per step of whitening w.whitened with factors of
    `kind`. The refresh (a^T a, the all-reduce of A, the factor) and its eigendecompositions run
    every w.whiten_refresh steps; their seconds are divided by that interval."""
    apply = refresh = eigh = 0.0
    for m, n in w.whitened:
        f = whitening_flops(kind, m, n, w.whiten_rank, w.tokens, w.power_iters)
        apply += linalg_seconds(f["apply"], c) + m * n * (APPLY_BYTES + EF_BYTES) / (c.hbm_gbps * 1e9)
        refresh += linalg_seconds(f["refresh"], c)
        eigh += f["eigh"] / (c.eigh_tflops * 1e12)
    moments = sum(n * n for _, n in w.whitened)
    refresh += ring_allreduce_seconds(moments, 4, c) if w.whitened else 0.0
    return {"apply": apply, "refresh": refresh / w.whiten_refresh, "eigh": eigh / w.whiten_refresh}


def subspace_flops(w: Workload, iters=1):
    """The subspace rotation's flops per step: encode + decode (16 m n r per rotated matrix)
    plus, every w.geo_refresh steps, a basis refresh: subspace iteration (8 m n r per
    iteration), the gain check (8 m n r), QR and Householder (4 (m+n) r^2)."""
    total = 0.0
    for m, n in w.rotated:
        r = min(w.geo_rank, min(m, n) // 2)
        update = iters * 8 * m * n * r + 8 * m * n * r + 4 * (m + n) * r * r
        total += 16 * m * n * r + update / w.geo_refresh
    return total


def geo_flops(preset, geo_rank, refresh=4, iters=1):
    """(subspace rotation flops per step, meta model) at a preset's shapes (nanogeo.tools.bench)."""
    with torch.device("meta"):
        net = model_lib.Llama(model_lib.model_config(preset))
    return subspace_flops(workload(preset, geo_rank=geo_rank, geo_refresh=refresh), iters), net


def transform_seconds(transform, w: Workload, c: Cluster):
    if transform is None:
        return {"apply": 0.0, "refresh": 0.0, "eigh": 0.0}
    if transform == "subspace":   # its basis refresh is inside subspace_flops, amortised
        return {"apply": subspace_flops(w) / (c.geo_gemm_efficiency * c.peak_tflops * 1e12),
                "refresh": 0.0, "eigh": 0.0}
    return whitening_seconds(transform, w, c)


# ----------------------------------------------------------------------------------------------
# Methods: a collective plus an optional transform
# ----------------------------------------------------------------------------------------------

COLLECTIVES = ("fp32", "bf16", "fp8-sum", "fp8", "nvfp4")
TRANSFORMS = ("dense", "lowrank", "lowrank-rand", "subspace")
METHODS = {   # named methods; any "collective+transform" spec works too
    "geofp8-dense": "fp8-sum+dense",          # the published GeoFP8
    "geofp8": "fp8-sum+dense",
    "geofp8-lowrank": "fp8-sum+lowrank",      # this project's low-rank factor, paper's collective
    "geofp8-lowrank-rand": "fp8-sum+lowrank-rand",
    "subspace": "fp8+subspace",               # this project's two-sided rotation
    "subspace-nvfp4": "nvfp4+subspace",
    "geo-nvfp4": "nvfp4+subspace",            # older name
}


def parse_method(spec):
    """'geofp8-dense' -> ('fp8-sum', 'dense'); 'fp8+lowrank' -> ('fp8', 'lowrank'); 'bf16' ->
    ('bf16', None)."""
    collective, _, transform = METHODS.get(spec, spec).partition("+")
    if collective not in COLLECTIVES or (transform and transform not in TRANSFORMS):
        raise ValueError(f"unknown method {spec!r}: use one of {', '.join(COLLECTIVES + tuple(METHODS))} "
                         f"or collective+transform with a transform in {', '.join(TRANSFORMS)}")
    return collective, transform or None


def exposed_seconds(comm, backward, c: Cluster):
    """The part of the communication the backward pass does not hide. "capacity": buckets are
    sent while backward runs, so up to overlap x backward of it is hidden and the rest waits;
    "fraction": a fixed share (1 - overlap) of every collective is exposed, as when the last
    buckets always wait whatever their size."""
    if c.overlap_model == "fraction":
        return (1 - c.overlap) * comm
    if c.overlap_model != "capacity":
        raise ValueError(f"overlap_model must be 'capacity' or 'fraction', not {c.overlap_model!r}")
    return comm - min(comm, c.overlap * backward)


def step_time(w: Workload, method, c: Cluster):
    """Seconds per step and its parts for one method on one cluster."""
    collective, transform = parse_method(method)
    compute = w.train_flops / (c.mfu * c.peak_tflops * 1e12)
    comm, codec = collective_seconds(collective, w, c)
    t = transform_seconds(transform, w, c)
    transform_s = t["apply"] + t["refresh"] + (t["eigh"] if w.eigh_in_step else 0.0)
    exposed = exposed_seconds(comm, compute * 2 / 3, c)
    return {"comm": method, "compute_s": compute, "codec_s": codec, "comm_s": comm,
            "exposed_comm_s": exposed, "apply_s": t["apply"], "refresh_s": t["refresh"],
            "eigh_s": t["eigh"], "transform_s": transform_s,
            "step_s": compute + codec + transform_s + exposed}


def compare(w: Workload, c: Cluster, comms=("bf16", "fp8", "subspace")):
    """step_time for each method, with each step's change against the first and (if listed) bf16."""
    rows = [step_time(w, m, c) for m in comms]
    for r in rows:
        r["vs_first"] = r["step_s"] / rows[0]["step_s"] - 1
    bf16 = next((r["step_s"] for r in rows if r["comm"] == "bf16"), None)
    for r in rows:
        r["vs_bf16"] = None if bf16 is None else r["step_s"] / bf16 - 1
    return rows


# ----------------------------------------------------------------------------------------------
# Solving for parameters
# ----------------------------------------------------------------------------------------------

SEARCH_RANGE = {"mfu": (0.01, 1.0), "overlap": (0.0, 1.0), "inter_gbps": (0.5, 5000.0),
                "linalg_efficiency": (1e-4, 100.0), "eigh_tflops": (1e-3, 1e4)}


def plausible_range(name, c: Cluster):
    """The range a solved parameter must fall in to be physically believable."""
    return {"mfu": (0.2, 0.6), "overlap": (0.0, 1.0), "inter_gbps": (0.5 * PAPER_LINE_GBPS, PAPER_LINE_GBPS),
            "linalg_efficiency": (0.0, 1.0), "eigh_tflops": (0.0, c.fp32_tflops)}[name]


def solve_1d(f, lo, hi, points=64, iters=80):
    """A root of f in [lo, hi]: the first sign change on a grid (log-spaced when lo > 0), then
    bisection. f may return None where it is undefined. None if f has no sign change."""
    grid = [lo * (hi / lo) ** (i / (points - 1)) if lo > 0 else lo + (hi - lo) * i / (points - 1)
            for i in range(points)]
    values = [f(x) for x in grid]
    for a, b, fa, fb in zip(grid, grid[1:], values, values[1:]):
        if fa is None or fb is None or (fa > 0) == (fb > 0):
            continue
        for _ in range(iters):
            mid = math.sqrt(a * b) if a > 0 else (a + b) / 2
            fm = f(mid)
            if fm is None:
                return None
            a, b, fa = (mid, b, fm) if (fm > 0) == (fa > 0) else (a, mid, fa)
        return (a + b) / 2
    return None


PAPER_TARGETS = {"fp8-sum": -0.1079, "geofp8-dense": -0.076}   # end-to-end time vs fp32


def change_vs(w, c, method, baseline="fp32"):
    return step_time(w, method, c)["step_s"] / step_time(w, baseline, c)["step_s"] - 1


def calibrate(w: Workload, c: Cluster, fp8_unknown="overlap", geo_unknown="mfu",
              targets=PAPER_TARGETS):
    """Solve two parameters of `c` so that both published figures come out of the model.

    The FP8 figure (fp8-sum vs fp32) does not involve the transform; the GeoFP8 figure adds the
    transform's cost. So for each trial value of `geo_unknown` we solve `fp8_unknown` from the
    FP8 figure (inner solve), and pick the `geo_unknown` at which the GeoFP8 figure is met (outer
    solve). Returns the calibrated Cluster, or None when no values in SEARCH_RANGE do it."""
    (fp8_method, fp8_target), (geo_method, geo_target) = targets.items()

    def inner(cluster):
        x = solve_1d(lambda v: change_vs(w, replace(cluster, **{fp8_unknown: v}), fp8_method) - fp8_target,
                     *SEARCH_RANGE[fp8_unknown])
        return None if x is None else replace(cluster, **{fp8_unknown: x})

    def geo_residual(v):
        cluster = inner(replace(c, **{geo_unknown: v}))
        return None if cluster is None else change_vs(w, cluster, geo_method) - geo_target

    if fp8_unknown == geo_unknown:
        raise ValueError("solve for two different parameters")
    v = solve_1d(geo_residual, *SEARCH_RANGE[geo_unknown])
    return None if v is None else inner(replace(c, **{geo_unknown: v}))


def transform_budget(w: Workload, c: Cluster, targets=PAPER_TARGETS):
    """(longest fp32 step, most transform seconds per step) the two figures allow at c's
    bandwidth, whatever MFU and overlap are. FP8 can save at most the whole difference of the two
    collectives less its codec (when nothing is hidden), and that saving is -target_fp8 of the
    fp32 step; the GeoFP8 - FP8 gap is then the transform's share of that same step."""
    (fp8_method, fp8_target), (_, geo_target) = targets.items()
    fp32, _ = collective_seconds("fp32", w, c)
    fp8, codec = collective_seconds(parse_method(fp8_method)[0], w, c)
    longest = (fp32 - fp8 - codec) / -fp8_target
    return longest, (geo_target - fp8_target) * longest


def solve_inter_bandwidth(w: Workload, c: Cluster, target, method="subspace", baseline="bf16"):
    """The NIC bandwidth per GPU (GB/s) at which `method`'s step time is `target` (e.g. -0.076)
    relative to `baseline`. None if no bandwidth in [0.1, 100000] GB/s gives it."""
    return solve_1d(lambda gbps: change_vs(w, replace(c, inter_gbps=gbps), method, baseline) - target,
                    0.1, 100000.0)


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------


def print_rows(rows, title):
    print(title)
    bf16 = rows[0]["vs_bf16"] is not None and rows[0]["comm"] != "bf16"
    print(f"  {'comm':>19s} {'compute':>9s} {'codec':>8s} {'transform':>10s} {'comm':>8s} "
          f"{'exposed':>8s} {'step':>8s} {'vs ' + rows[0]['comm']:>9s}" + (f" {'vs bf16':>8s}" if bf16 else ""))
    for r in rows:
        print(f"  {r['comm']:>19s} {1e3 * r['compute_s']:7.1f}ms {1e3 * r['codec_s']:6.1f}ms "
              f"{1e3 * r['transform_s']:8.1f}ms {1e3 * r['comm_s']:6.1f}ms "
              f"{1e3 * r['exposed_comm_s']:6.1f}ms {1e3 * r['step_s']:6.1f}ms {100 * r['vs_first']:+8.2f}%"
              + (f" {100 * r['vs_bf16']:+7.2f}%" if bf16 else ""))


def settings_text(c: Cluster, leave_out=()):
    return ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}"
                     for k, v in asdict(c).items() if k not in leave_out)


def verdicts(solved: Cluster, unknowns):
    """{name: (value, plausible)} for the solved parameters."""
    out = {}
    for name in unknowns:
        lo, hi = plausible_range(name, solved)
        value = getattr(solved, name)
        out[name] = (value, lo <= value <= hi)
    return out


def describe_calibration(w: Workload, start: Cluster, solved: Cluster, unknowns):
    """Print what was assumed, what was solved (with a plausibility verdict) and what it implies.
    Returns True when every solved parameter is plausible."""
    skip = set(unknowns) | {"geo_gemm_efficiency", "intra_gbps"}
    print("  assumed: " + settings_text(start, skip) + f" (line rate {PAPER_LINE_GBPS:g} GB/s); {w.tokens} tokens/GPU/step; {len(w.whitened)} "
          f"whitened layers {w.whitened[0][0]}x{w.whitened[0][1]}, refresh every {w.whiten_refresh} "
          f"steps, eigendecompositions {'in' if w.eigh_in_step else 'off'} the critical path")
    checks = verdicts(solved, unknowns)
    for name, (value, good) in checks.items():
        lo, hi = plausible_range(name, solved)
        print(f"  solved:  {name} = {value:.4g}  ({'plausible' if good else 'NOT plausible'}: "
              f"expected {lo:g}..{hi:g})")
    base, fp8, geo = (step_time(w, m, solved) for m in ("fp32", "fp8-sum", "geofp8-dense"))
    print(f"  check:   fp8-sum vs fp32 {100 * (fp8['step_s'] / base['step_s'] - 1):+.3f} %, "
          f"geofp8-dense vs fp32 {100 * (geo['step_s'] / base['step_s'] - 1):+.3f} %")
    print(f"  implied: fp32 step {1e3 * base['step_s']:.1f} ms (compute {1e3 * base['compute_s']:.1f} ms); "
          f"its all-reduce {1e3 * base['comm_s']:.1f} ms = {100 * base['comm_s'] / base['step_s']:.1f} % "
          f"of the step, exposed {1e3 * base['exposed_comm_s']:.1f} ms = "
          f"{100 * base['exposed_comm_s'] / base['step_s']:.1f} %")
    print(f"  implied: dense whitening {1e3 * geo['transform_s']:.2f} ms per step = "
          f"{100 * geo['transform_s'] / base['step_s']:.2f} % of the fp32 step (apply + error feedback "
          f"{1e3 * geo['apply_s']:.2f} ms, refresh {1e3 * geo['refresh_s']:.2f} ms amortised"
          + (f", eigendecompositions {1e3 * geo['eigh_s']:.2f} ms amortised)" if w.eigh_in_step else
             f"; eigendecompositions off the path, {1e3 * geo['eigh_s']:.2f} ms amortised if they were on it)"))
    return all(good for _, good in checks.values())


PAPER_SCENARIOS = (   # (what is assumed, workload settings, cluster overrides, the two unknowns)
    ("eigh in step", {"eigh_in_step": True}, {}, ("overlap", "mfu")),
    ("eigh in step", {"eigh_in_step": True}, {}, ("inter_gbps", "mfu")),
    ("eigh in step, MFU 0.3, kernels at 100 %", {"eigh_in_step": True},
     {"mfu": 0.3, "linalg_efficiency": 1.0}, ("overlap", "eigh_tflops")),
    ("eigh off path", {}, {}, ("overlap", "mfu")),
    ("eigh off path, MFU 0.4", {}, {"mfu": 0.4}, ("overlap", "linalg_efficiency")),
    ("eigh off path, MFU 0.3", {}, {"mfu": 0.3}, ("overlap", "linalg_efficiency")),
    ("eigh off path, overlap 0.5", {}, {"overlap": 0.5}, ("inter_gbps", "mfu")),
    ("eigh off path, MFU 0.4, overlap 0.5", {}, {"mfu": 0.4, "overlap": 0.5},
     ("inter_gbps", "linalg_efficiency")),
    ("eigh off path, fraction overlap model", {}, {"overlap_model": "fraction"}, ("overlap", "mfu")),
)


def scenario_table(w: Workload, start: Cluster):
    """One line per alternative set of assumptions: what the two figures then require."""
    print("other assumptions (each row changes the assumed values above as stated, solves two):")
    for label, settings, overrides, unknowns in PAPER_SCENARIOS:
        solved = calibrate(replace(w, **settings), replace(start, **overrides), *unknowns)
        if solved is None:
            print(f"  {label:40s} solve {'+'.join(unknowns):28s} -> no solution in the search range")
            continue
        checks = verdicts(solved, unknowns)
        text = ", ".join(f"{k} {v:.3g}" for k, (v, _) in checks.items())
        print(f"  {label:40s} solve {'+'.join(unknowns):28s} -> {text:38s} "
              + ("plausible" if all(g for _, g in checks.values()) else
                 "NOT plausible (" + ", ".join(k for k, (_, g) in checks.items() if not g) + ")"))


def paper_report(start: Cluster, w: Workload, fp8_unknown, geo_unknown, comms):
    """Calibrate to the paper's two figures, show alternatives, project `comms`. Returns
    (calibrated cluster, projection rows), or None when there is no calibration."""
    print(f"GeoFP8 paper setup: {w.name} model ({w.numel / 1e6:.1f}M gradient elements, "
          f"{w.train_flops / 1e12:.1f} TFLOP per GPU per step) on {start.gpus} GPUs "
          f"({start.nodes} nodes x {start.gpus_per_node})")
    print("targets vs fp32: " + ", ".join(f"{m} {100 * t:+.2f} %" for m, t in PAPER_TARGETS.items()))
    longest, budget = transform_budget(w, start)
    dense = step_time(w, "geofp8-dense", start)
    print(f"bound: at {start.inter_gbps:g} GB/s the FP8 figure allows an fp32 step of at most "
          f"{1e3 * longest:.0f} ms (any MFU, any overlap), so the GeoFP8 figure allows at most "
          f"{1e3 * budget:.1f} ms of whitening per step; the refresh's eigendecompositions alone "
          f"cost {1e3 * dense['eigh_s']:.1f} ms amortised at {start.eigh_tflops:g} TFLOP/s")
    solved = calibrate(w, start, fp8_unknown, geo_unknown)
    if solved is None:
        print(f"no {fp8_unknown} in {SEARCH_RANGE[fp8_unknown]} with {geo_unknown} in "
              f"{SEARCH_RANGE[geo_unknown]} reproduces both figures under these assumptions:")
        print("  assumed: " + settings_text(start, (fp8_unknown, geo_unknown))
              + f"; eigendecompositions {'in' if w.eigh_in_step else 'off'} the critical path")
        scenario_table(w, start)
        return None
    print(f"calibration (solve {fp8_unknown} from the FP8 figure, {geo_unknown} from the GeoFP8 figure):")
    ok = describe_calibration(w, start, solved, (fp8_unknown, geo_unknown))
    print("  verdict: " + ("physically plausible" if ok else "NOT physically plausible"))
    scenario_table(w, start)
    rows = compare(w, solved, comms)
    print_rows(rows, "projection on the calibrated cluster (transform = apply + amortised refresh):")
    eigh = {r["comm"]: r["eigh_s"] for r in rows if r["eigh_s"] > 0}
    if eigh and not w.eigh_in_step:
        print(f"  with the full eigendecompositions in the step ({solved.eigh_tflops:g} TFLOP/s) add "
              + ", ".join(f"{1e3 * s:.1f} ms to {m}" for m, s in eigh.items())
              + " (the -rand rows have none)")
    other = "fraction" if start.overlap_model == "capacity" else "capacity"
    alt = calibrate(w, replace(start, overlap_model=other), fp8_unknown, geo_unknown)
    if alt is not None:
        print(f"the same calibrated with the {other!r} overlap model ({fp8_unknown} "
              f"{getattr(alt, fp8_unknown):.3g}, {geo_unknown} {getattr(alt, geo_unknown):.3g}): "
              "change vs fp32 / vs bf16")
        print("  " + ", ".join(f"{r['comm']} {100 * r['vs_first']:+.2f}/{100 * r['vs_bf16']:+.2f} %"
                               for r in compare(w, alt, comms) if r["comm"] not in ("fp32", "bf16")))
    return solved, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("mode", nargs="?", default="scan", choices=["scan", "paper"],
                        help="scan: node counts on a 4-GPU-per-node cluster; paper: calibrate to "
                             "the paper's 64 x GH200 cluster and project the methods there")
    parser.add_argument("--preset", default="llama-600m", help="scan mode's model")
    parser.add_argument("--nodes", default=None, help="comma-separated node counts (scan; default 16)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per GPU per step (scan default 8192, paper 16384)")
    parser.add_argument("--geo_rank", type=int, default=16, help="r of the subspace rotation")
    parser.add_argument("--whiten_rank", type=int, default=32, help="r of the low-rank whitening")
    parser.add_argument("--whiten_refresh", type=int, default=50, help="K: steps between refreshes")
    parser.add_argument("--eigh_in_step", type=int, choices=[0, 1], default=0,
                        help="paper: 1 counts the refresh's eigendecompositions in the step time")
    parser.add_argument("--comms", default=None, help="methods to compare: a collective "
                        f"({', '.join(COLLECTIVES)}), collective+transform ({', '.join(TRANSFORMS)}) "
                        f"or one of {', '.join(METHODS)}")
    parser.add_argument("--target", type=float, default=-0.076,
                        help="scan: solve for the NIC bandwidth that gives this subspace vs bf16 change")
    parser.add_argument("--solve", default="overlap,mfu",
                        help="paper: the parameter the FP8 figure pins, then the one the GeoFP8 "
                             f"figure pins; two of {', '.join(SEARCH_RANGE)}")
    for name, value in asdict(Cluster()).items():
        if name != "nodes":
            parser.add_argument(f"--{name}", type=type(value), default=None,
                                help=f"scan default {value}; paper mode prints its own")
    args = parser.parse_args(argv)
    overrides = {k: getattr(args, k) for k in asdict(Cluster())
                 if k != "nodes" and getattr(args, k) is not None}
    settings = dict(geo_rank=args.geo_rank, whiten_rank=args.whiten_rank, whiten_refresh=args.whiten_refresh)

    if args.mode == "paper":
        unknowns = args.solve.split(",")
        if len(unknowns) != 2 or len(set(unknowns)) != 2 or not set(unknowns) <= set(SEARCH_RANGE):
            parser.error(f"--solve takes two different names of {', '.join(SEARCH_RANGE)}, "
                         "e.g. --solve=overlap,mfu")
        start = paper_cluster(**({"nodes": int(args.nodes)} if args.nodes else {}), **overrides)
        settings["eigh_in_step"] = bool(args.eigh_in_step)
        w = paper_workload(**settings) if args.tokens is None else workload(
            paper_600m_config(), args.tokens, **settings)
        comms = (args.comms or "fp32,bf16,fp8-sum,geofp8-dense,geofp8-lowrank,geofp8-lowrank-rand,"
                 "fp8,fp8+lowrank,fp8+lowrank-rand,subspace").split(",")
        return paper_report(start, w, *unknowns, comms)

    cluster_settings = {**asdict(Cluster()), **overrides}
    tokens = args.tokens or 8192
    print("assumptions: " + ", ".join(f"{k}={v}" for k, v in cluster_settings.items() if k != "nodes")
          + f", tokens/GPU/step={tokens}, r={args.geo_rank}")
    w = workload(args.preset, tokens, **settings)
    comms = (args.comms or "bf16,fp8,subspace,nvfp4").split(",")
    for nodes in (int(n) for n in (args.nodes or "16").split(",")):
        cluster = Cluster(**{**cluster_settings, "nodes": nodes})
        rows = compare(w, cluster, comms)
        print_rows(rows, f"{args.preset} on {cluster.gpus} GPUs ({nodes} nodes):")
        gbps = solve_inter_bandwidth(w, cluster, args.target)
        if gbps is None:
            print(f"  no NIC bandwidth gives subspace vs bf16 {100 * args.target:+.1f}% here")
        else:
            at = compare(w, replace(cluster, inter_gbps=gbps), ("bf16", "subspace"))
            print(f"  subspace vs bf16 = {100 * args.target:+.1f}% at a NIC bandwidth of {gbps:.1f} GB/s "
                  f"per GPU (bf16 exposed comm then {100 * at[0]['exposed_comm_s'] / at[0]['step_s']:.1f}% "
                  "of its step)")
    return rows


if __name__ == "__main__":
    main()
