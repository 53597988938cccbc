"""The model itself: the machine (Cluster), the workload, the collectives, the transforms and
one step's time (see the package's docstring for the formulas)."""

from dataclasses import dataclass, replace

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
    opts = Options(geometry="geofp8", vocab_size=cfg.vocab_size)
    linear = set(hooks.linear_layers(net))
    rotated = [tuple(p.shape) for name, p in net.named_parameters()
               if compress.why_euclidean(name, tuple(p.shape), opts, linear) is None]
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
    iteration, and its bases' Cholesky QR, three passes: 9 (m+n) r^2), the gain check (8 m n r)
    and the Householder completion (3 (m+n) r^2)."""
    total = 0.0
    for m, n in w.rotated:
        r = min(w.geo_rank, min(m, n) // 2)
        update = (iters * (8 * m * n * r + 9 * (m + n) * r * r) + 8 * m * n * r
                  + 3 * (m + n) * r * r)
        total += 16 * m * n * r + update / w.geo_refresh
    return total


def geo_flops(preset, geo_rank, refresh=4, iters=1):
    """(subspace rotation flops per step, meta model) at a preset's shapes (nanogeo.lab.bench)."""
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

