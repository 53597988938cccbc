"""
An analytic step-time model: what does each gradient-communication method cost end to end, and
which machine parameters reproduce the paper's reported timings?

    python -m nanogeo.lab.perfmodel paper                       # calibrate to the paper's cluster
    python -m nanogeo.lab.perfmodel                             # llama-600m, 4 GPUs per node, scan
    python -m nanogeo.lab.perfmodel --preset llama-300m --nodes 1,2,4,8,16 --inter_gbps 25

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

The package: model.py (the machine, the workload, collectives, transforms, a step's time),
calibrate.py (solving for unknown parameters), report.py (what is printed) and cli.py.
"""

from nanogeo.lab.perfmodel.model import (  # noqa: F401 - the model's names, as before
    APPLY_BYTES, COLLECTIVES, EF_BYTES, EIGH_FLOPS, FP8_SUM_CODEC_BYTES, METHODS,
    PAPER_LINE_GBPS, RING_BYTES, TRANSFORMS, TWO_STAGE_CODEC_BYTES, Cluster,
    collective_seconds, compare, exposed_seconds, fp8_collective_seconds, geo_flops,
    linalg_seconds, paper_600m_config, paper_cluster, paper_workload, parse_method,
    ring_allreduce_seconds, step_time, subspace_flops, transform_seconds, whitening_flops,
    whitening_seconds, wire_bytes_per_element, Workload, workload)
from nanogeo.lab.perfmodel.calibrate import (PAPER_TARGETS, SEARCH_RANGE, calibrate,  # noqa: F401
                                               change_vs, plausible_range, solve_1d,
                                               solve_inter_bandwidth, transform_budget)
from nanogeo.lab.perfmodel.report import paper_report, scenario_table  # noqa: F401
from nanogeo.lab.perfmodel.cli import main  # noqa: F401
