"""
The GPU smoke test: does the NCCL/CUDA path work on this node, and how fast are its parts?

    make gpu-smoke        # = python -m nanogeo.smoke --nproc=<GPUs, else 2> --out=smoke.json
    python -m nanogeo.smoke --out smoke.json                       # on one GPU (GH200, H100, ...)
    python -m nanogeo.smoke --preset cpu-tiny --numel 1e6 --iters 3  # the same checks on a CPU
    python -m nanogeo.smoke ... --no-compile    # skip the compiled rows (minutes of inductor on a CPU)

One process, so no network is measured (two processes cannot share one GPU's NCCL; the wire
is measured by `torchrun ... -m nanogeo.lab.bench collective` on a real node). What it checks:

  env        device, torch, CUDA and NCCL versions
  nccl       a 1-rank NCCL process group runs the collective's calls on uint8 buffers
             (all_to_all_single, all_gather) and all_reduce_mean returns finite means
  codec      a packed round trip's throughput in GB/s of fp32 input (e4m3, e5m2: eager and
             torch.compile'd, kernels.compile_hot_path, unless --no-compile; nvfp4 eager)
  transform  GeoFP8's encode + decode of every rotated matrix of the preset, ms per step
             (eager: the transforms are not compiled), and the bytes of the geometry state
  ddp        the DDP hook on the CUDA side stream: gradients of a small model equal plain
             DDP's within FP8 error
  step       the preset's forward + backward + AdamW step (bf16 autocast on GPU), ms and
             tokens/s, eager and (unless --no-compile) compiled; GeoFP8's transform as a
             fraction of it

Each timing is the median of --iters after a warm-up, with the device synchronized.

With --nproc=N (`make gpu-smoke`) it is a node's first-contact test instead: torchrun starts N
ranks (one per GPU; 2 gloo CPU ranks at toy size where there is none), and every check prints one
PASS / FAIL / SKIP line, then what was NOT tested and why (a SKIP never counts as passed: on one
GPU, NCCL and the FP8 exchange are not tested, and the summary says so), then a summary;
smoke.json keeps the figures. It stops at once, with one line, where GPUs are visible but torch
has no CUDA. Every check can fail: tests/test_smoke.py injects each one's fault. The whole run
has a deadline (--deadline: 600 s on GPUs), and the ranks' process group a timeout (--pg_timeout:
120 s) after which the backend reports a hung collective itself. The lines:

  env          (information) torch, CUDA and NCCL versions, platform.machine(), device name
               and capability
  codec        the device's bytes equal the CPU's (e4m3, e5m2, nvfp4), the packed codec's equal
               compress.quantize's, compiled kernels give eager's; encode + decode GB/s of fp32
               input against a device copy of the same bytes (the roofline; not checked)
  collective   e4m3 / e5m2 / nvfp4 all_reduce_mean: the same bytes as the one-process simulator
               of the gathered inputs, within the codec's bound of the exact mean, and the same
               bytes on every rank (sha256 gathered)
  fp8-sum      NCCL's float8 SUM against its emulation, on inputs a quarter of which saturate by
               construction (the fractions within 10 %), where NCCL can sum float8 (CUDA,
               compute capability >= 9.0); else SKIP, saying why
  ddp          the DDP hook against plain DDP at world size N (ranks see different data; on a
               GPU width 256, 64 tokens, some matrices rotated)
  fsdp         FSDP2 with use_compressed_reduce_scatter against FP32 reduce-scatters
  train        cpu-tiny on the bundled corpus (toy: 4 x 32 tokens), --comm=geofp8 (--compile on
               a GPU), 30 steps resumed to 40, and a Muon run: train.py's all-rank parameter
               checksum every 10 steps, a falling loss, ms per step, the slowest step against
               the median
  figures      (on CUDA, not checked) the two-stage FP8 and NVFP4 collectives against NCCL's
               bf16 all_reduce at 16M and 64M elements, a llama-300m step with fp8 and subspace
               against bf16, peak memory: markdown rows for BENCHMARKS.md section 9

The package, by what each part is for:
    single.py    the one-process checks (no --nproc), and timed(), which bench.py shares
    ranks.py     the checks every rank runs under torchrun, and the worker that runs them
    figures.py   the GPU figures (timed exchanges and steps), and their markdown rows
    launcher.py  make gpu-smoke: the bounded torchrun, the training check (train.py runs), one
                 PASS / FAIL / SKIP line per check, the summary, smoke.json
    cli.py       the command line (python -m nanogeo.smoke)
"""

from nanogeo.smoke.single import (check_codec, check_ddp, check_env, check_nccl,  # noqa: F401
                                        check_step, check_transform, one_process,
                                        rotated_shapes, timed)
from nanogeo.smoke.ranks import (MANTISSA_BITS, codec_bound, env_figures,  # noqa: F401
                                       same_on_every_rank, sha256, smoke_codec,
                                       smoke_collectives, smoke_ddp, smoke_fp8_sum, smoke_fsdp,
                                       worker)
from nanogeo.smoke.launcher import (describe, exit_reason, first_contact,  # noqa: F401
                                          run_bounded, run_training, smoke_training,
                                          step_figures, train_command)
from nanogeo.smoke.cli import main  # noqa: F401
