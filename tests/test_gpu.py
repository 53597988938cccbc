"""The device twins of the CPU suite's codec, collective, DDP-hook and FSDP checks: `pytest -m gpu`
on a CUDA machine (deselected by `make test`, skipped without CUDA). The multi-rank checks run
nanogeo.smoke's rank checks under torchrun on every visible GPU (NCCL), the same code as
`make gpu-smoke`."""
import json
import os
import subprocess
import sys

import pytest
import torch

import compress
from conftest import ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA (run with `pytest -m gpu` on a GPU machine)")]


def inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(48, 40, generator=g), torch.randn(1000, generator=g) * 1e-3,
            torch.zeros(130), torch.randn(4096 * 3 + 7, generator=g) * 1e3,
            # groups whose amax is near fp32's smallest normals: scales near fp32's max, and
            # decoded values below the normals (a flush to zero, or a division that is not
            # IEEE's, shows here first)
            torch.randn(300, generator=g) * 1e-37]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4"])
def test_codec_bytes_on_the_device_equal_the_cpu(fmt):
    """compress.quantize on CUDA writes the CPU's bytes, and decodes to the CPU's values."""
    for x in inputs():
        cpu, gpu = compress.quantize(x, fmt, 128), compress.quantize(x.cuda(), fmt, 128)
        assert torch.equal(cpu.buffer, gpu.buffer.cpu())
        assert torch.equal(compress.dequantize(cpu), compress.dequantize(gpu).cpu())


def test_compiled_codec_on_the_device_equals_eager():
    """Stage 1's wire, its decode and stage 2's owner step (decode, sum, divide, encode in one
    fused kernel) compiled by Triton: eager's bytes and values."""
    from nanogeo.smoke.ranks import wire_round_trip
    from nanogeo.wire import kernels
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("below sm_89 the codec stays eager (no float8 casts in Triton)")
    for fmt in ("e4m3", "e5m2"):
        for x in inputs():
            trips = []
            for compiled in (False, True):
                kernels.compile_hot_path(compiled)
                trips.append(wire_round_trip(x.cuda(), fmt))
            kernels.compile_hot_path(False)
            assert all(torch.equal(a, b) for a, b in zip(*trips))


def test_householder_completion_on_the_device_is_orthogonal_and_never_syncs():
    """The rotation's bases completed on CUDA (batched.complete_together: the LU's pivots, the
    triangular solves) without a host sync, orthogonal, and equal to the CPU's up to fp32
    rounding (batched cuBLAS kernels may add in another order)."""
    from nanogeo.geometry import batched
    g = torch.Generator().manual_seed(0)
    stacks = [torch.stack([compress.orthonormal(torch.randn(m, 16, generator=g))
                           for _ in range(3)]) for m in (1408, 3776)]
    on_device = [s.cuda() for s in stacks]         # (a copy from pageable memory syncs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        done = batched.complete_together(on_device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (Y, T), (Y_cpu, T_cpu) in zip(done, batched.complete_together(stacks)):
        assert torch.allclose(Y.cpu(), Y_cpu, atol=1e-5) and torch.allclose(T.cpu(), T_cpu,
                                                                            atol=1e-5)
        for y, t in zip(Y, T):
            P = compress.HouseholderBasis(y, t).apply(torch.eye(y.shape[0], device="cuda"))
            assert torch.allclose(P.T @ P, torch.eye(y.shape[0], device="cuda"), atol=1e-5)


def test_rank_checks_pass_on_every_gpu(tmp_path):
    """Collectives (e4m3 / e5m2 / nvfp4 within the codec's bound, the same bytes on every rank),
    NCCL's float8 sum against its emulation (or SKIP with the reason), the DDP hook against plain
    DDP, FSDP2 with use_compressed_reduce_scatter against fp32: on NCCL over every visible GPU
    (two or more: at world size 1 nothing is exchanged, and the smoke test says SKIP)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: the rank checks need two or more (world size 1 exchanges nothing)")
    out = tmp_path / "smoke.json"
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None) if env.get("CUDA_VISIBLE_DEVICES") == "" else None
    done = subprocess.run([sys.executable, "-m", "nanogeo.smoke",
                           f"--nproc={torch.cuda.device_count()}", "--no-train", "--iters=3",
                           "--numel=4e6", "--no-figures", f"--out={out}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    for name in ("codec", "collective", "ddp", "fsdp"):
        assert result[name]["status"] == "PASS", (name, result[name])
    assert result["fp8-sum"]["status"] in ("PASS", "SKIP")
    assert result["env"]["device"] != "cpu"
