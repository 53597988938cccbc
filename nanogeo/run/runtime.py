"""
The distributed runtime of train.py: process-group setup under torchrun (elastic restarts
included), the checks that every rank agrees (finite gradients everywhere, identical
parameters: a checksum all-reduce, a sha256 for tests), and the GPU's peak for MFU. Nothing here knows about
gradient communication; that is train.py's reduce_gradients and compress.py.
"""
import hashlib
import os
import platform
import subprocess
import sys

import torch
import torch.distributed as dist

from nanogeo.geometry import agreement
from nanogeo.run.config import ConfigError


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12,
                   "L40S": 362e12, "A10": 125e12, "4090": 165e12}


def peak_flops(device):
    """Dense bf16 peak of the GPU, for MFU; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return flops
    return None


def parameter_checksum(params):
    """sha256 of every parameter's bytes: equal on two ranks iff their parameters are bitwise equal."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def gradients_finite(grads, world_size):
    """True on every rank iff no rank has a NaN/inf gradient: one 1-element all-reduce and one
    transfer to the host (the flags of all tensors are combined on the device)."""
    bad = (~agreement.all_finite(grads)).float().reshape(1)
    if world_size > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


class RankMismatch(RuntimeError):
    """Parameters differ across ranks: the run cannot continue meaningfully."""


def check_ranks_agree(params, step, device):
    """All ranks must hold bitwise-identical parameters: one all-reduce of a checksum checks it
    (nanogeo.geometry.agreement.same_on_every_rank)."""
    checksum = torch.zeros((), dtype=torch.float64, device=device)
    for i, p in enumerate(params):
        checksum += p.detach().double().sum() * (1 + (i % 7) / 7)
    if not agreement.same_on_every_rank(checksum):
        raise RankMismatch(f"parameters differ across ranks at step {step}; a rank diverged "
                           "(nondeterministic kernel, bad hardware or a code change on one node): "
                           "restart from the last checkpoint")


NVIDIA_DEVICE_FILE = "/dev/nvidia0"    # the driver's first device node (tests point it elsewhere)


def visible_gpus():
    """How many NVIDIA GPUs this machine shows, whatever torch can use: the lines of
    `nvidia-smi -L`, else 1 if the driver's device node exists. 0 where CUDA_VISIBLE_DEVICES
    hides them on purpose (set and empty, or -1)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    except (OSError, subprocess.SubprocessError):
        count = 0
    return count or int(os.path.exists(NVIDIA_DEVICE_FILE))


def cuda_build_missing():
    """None, or the one-line reason to stop: NVIDIA GPUs are visible but this torch has no CUDA
    (on aarch64, e.g. GH200, `pip install torch` from the default index can be a CPU-only
    build). Training on the CPU there by accident would look like a working run."""
    if torch.cuda.is_available():
        return None
    gpus = visible_gpus()
    if not gpus:
        return None
    build = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
             else f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use them "
                  "(driver too old for this build?)")
    return (f"{gpus} NVIDIA GPU(s) visible (nvidia-smi) but {build}: install a CUDA build of "
            f"torch for {platform.machine()} from PyTorch's CUDA wheel index, e.g. `make -B "
            "install PIP_ARGS=\"--force-reinstall --index-url "
            "https://download.pytorch.org/whl/cu130\"` (docs/guide.md, GPUs), or pass "
            "--device=cpu to run on the CPU on purpose")


def setup_distributed(cfg):
    """(rank, world_size, local_rank, device). torchrun sets RANK/WORLD_SIZE/LOCAL_RANK. On a
    GPU, fp32 matmuls may use TF32 (the model runs in bf16 autocast anyway). --device=auto
    takes the GPUs when torch can, and stops (ConfigError) where GPUs are visible but torch
    cannot use them: never a silent CPU run on a GPU node."""
    if cfg.device == "auto" and (reason := cuda_build_missing()):
        raise ConfigError(reason)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(cuda_build_missing() or "--device=cuda but no GPU is visible; use "
                          "--device=cpu")
    if use_cuda:    # the fp32_precision API only: mixed with allow_tf32 it breaks torch.compile
        torch.backends.cuda.matmul.fp32_precision = "tf32"      # (the communicator measures in
        torch.backends.cudnn.conv.fp32_precision = "tf32"       # IEEE: parallel/precision.py)
    if "RANK" not in os.environ:
        return 0, 1, 0, torch.device("cuda" if use_cuda else "cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda and local_rank >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(f"LOCAL_RANK {local_rank} but {n} GPU(s) visible to torch: start at most "
                          f"{n} ranks per node (torchrun --nproc_per_node={n}, make ... NPROC={n})")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # After an elastic restart (torchrun --max-restarts) the new workers meet in the same agent
    # store as the dead ones; a key space per attempt keeps a restarted rank from reading a dead
    # peer's address (gloo then fails with "Connection refused").
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                            store=dist.PrefixStore(f"nanogeo/attempt{attempt}", store),
                            rank=rank, world_size=world_size,
                            device_id=device if use_cuda else None)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


if __name__ == "__main__":
    # `python -m nanogeo.run.runtime`: the Makefile's check before it starts one rank per GPU
    if reason := cuda_build_missing():
        print(f"error: {reason}", file=sys.stderr)
        sys.exit(2)
