"""
The distributed runtime of train.py: process-group setup under torchrun (elastic restarts
included), rank 0's parameters on every rank at the start, the checks that every rank agrees
(finite gradients everywhere, identical parameters: a checksum all-reduce, a sha256 for
tests), the GPU's peak for MFU, and the one-line stop (with the CUDA wheel index that fits the
driver) where GPUs are visible but torch cannot use them. Nothing here knows about gradient
communication; that is train.py's reduce_gradients and compress.py.
"""
import contextlib
import datetime
import hashlib
import itertools
import os
import platform
import re
import subprocess
import sys
import warnings

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


@torch.no_grad()
def broadcast_from_rank0(model):
    """Every rank takes rank 0's parameters and buffers, once, before the first step. Each host
    builds the model on its own CPU from the same seed, but two CPUs need not draw the same bits
    (an aarch64 GH200 and an x86 node in one job, another libm: the rotary tables' cos and sin
    least of all), and the explicit path has no DDP to broadcast them; the first agreement check
    would come only at --check_every. Where every rank already holds the same bits (all CPU
    runs here) nothing changes. One broadcast per tensor (tied weights once)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(tensor, src=0)


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
    return (f"{gpus} NVIDIA GPU(s) visible (nvidia-smi) but {build}: {install_advice()} "
            "(docs/guide.md, GPUs), or pass --device=cpu to run on the CPU on purpose")


# PyTorch's CUDA wheel indexes, newest CUDA first, each with the oldest NVIDIA driver (major
# version, Linux) that runs its builds. The minimums are NVIDIA's (CUDA Compatibility guide,
# "Minor Version Compatibility", Table 1: CUDA 13.x needs a driver >= 580, CUDA 12.x >= 525;
# a build runs on any driver of at least its family's minimum); the index names are PyTorch's
# (pytorch.org, "Installing previous versions": cu126, cu128 and cu130 since torch 2.9).
CUDA_WHEEL_INDEXES = (("cu130", 580), ("cu128", 525))
WHEEL_INDEX_URL = "https://download.pytorch.org/whl/"


def driver_version():
    """The NVIDIA driver's version as nvidia-smi reports it (e.g. "580.65.06"), or None."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = listed.stdout.strip().splitlines()
    first = lines[0].strip() if lines else ""
    return first if re.fullmatch(r"\d+(\.\d+)*", first) else None


def wheel_index(driver):
    """The newest CUDA wheel index whose builds this driver ("580.65.06") runs; None where it is
    older than every one of them."""
    major = int(driver.split(".")[0])
    return next((index for index, minimum in CUDA_WHEEL_INDEXES if major >= minimum), None)


def install_command(index):
    return (f"`make -B install PIP_ARGS=\"--force-reinstall --index-url "
            f"{WHEEL_INDEX_URL}{index}\"`")


def install_advice():
    """What to install, for the driver nvidia-smi reports: the CUDA wheel index that fits it."""
    where = f"install a CUDA build of torch for {platform.machine()} from PyTorch's CUDA wheel index"
    both = " or ".join(f"{index} for a driver >= {minimum}" for index, minimum in CUDA_WHEEL_INDEXES)
    driver = driver_version()
    if driver is None:
        return f"{where} ({both}; nvidia-smi did not report the driver's version)"
    index = wheel_index(driver)
    if index is None:
        oldest, minimum = CUDA_WHEEL_INDEXES[-1]
        return (f"driver {driver} is older than any CUDA build of torch needs ({both}): update "
                f"the NVIDIA driver to >= {minimum}, then {where}, e.g. {install_command(oldest)}")
    return f"{where}, for driver {driver}: {install_command(index)}"


def leave_if_distributed():
    """End a finished torchrun rank at once, exit code 0. Its log is closed and its checkpoint
    synced to disk by now; gloo's threads now and then abort the interpreter's teardown
    ("terminate called without an active exception", pytorch/gloo#514), which torchrun would
    report as a failed rank (and with --max-restarts, restart)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def setup_distributed(cfg, timeout=None):
    """(rank, world_size, local_rank, device). torchrun sets RANK/WORLD_SIZE/LOCAL_RANK. On a
    GPU, fp32 matmuls may use TF32 (the model runs in bf16 autocast anyway). --device=auto
    takes the GPUs when torch can, and stops (ConfigError) where GPUs are visible but torch
    cannot use them: never a silent CPU run on a GPU node. `timeout` (seconds): how long a
    collective may wait for the other ranks before the process group reports it (None: torch's
    default, 10 minutes for NCCL)."""
    if cfg.device == "auto" and (reason := cuda_build_missing()):
        raise ConfigError(reason)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(cuda_build_missing() or "--device=cuda but no GPU is visible; use "
                          "--device=cpu")
    if use_cuda:    # TF32 for the model's fp32 matmuls (the communicator's stay IEEE:
        # parallel/precision.py), set through the one call that sets the fp32_precision API
        # and the legacy view alike, so that code reading either (inductor reads the legacy
        # one) sees "tf32". (cuDNN's convolutions keep their default, TF32; the model has none.)
        torch.set_float32_matmul_precision("high")
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
                            device_id=device if use_cuda else None,
                            **({"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}))
    return dist.get_rank(), dist.get_world_size(), local_rank, device


if __name__ == "__main__":
    # `python -m nanogeo.run.runtime`: the Makefile's check before it starts one rank per GPU
    if reason := cuda_build_missing():
        print(f"error: {reason}", file=sys.stderr)
        sys.exit(2)


SYNC_WARNING = "called a synchronizing CUDA operation"   # what sync debug mode "warn" says
# the CUDA runtime and driver calls that launch a kernel, as torch.profiler names them
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
                "cuLaunchKernel", "cuLaunchKernelEx")


def launches_in(events):
    """How many of a profile's events launch a kernel (LAUNCH_CALLS)."""
    return sum(1 for e in events if e.name in LAUNCH_CALLS)


@contextlib.contextmanager
def counting_launches(enabled):
    """Count the kernels launched inside, by torch.profiler's record of the CUDA runtime calls
    (train.py --sync_debug, on logged steps: the smoke's launches per step beside its host
    waits). Not counted: CUDA graph replays (cudaGraphLaunch) and calls kineto does not name. Yields a list
    that holds the count once the block ends; not enabled: nothing counted, the list stays
    empty. (The profiler's own start and stop lie outside what a counting_syncs inside sees.)"""
    found = []
    if not enabled:
        yield found
        return
    # the CUDA activity alone records the runtime and driver calls, no CPU op (a CPU-only torch
    # profiles the CPU instead: no kernel to count, the same API)
    activity = torch.profiler.ProfilerActivity
    kind = activity.CUDA if torch.cuda.is_available() else activity.CPU
    with torch.profiler.profile(activities=[kind]) as profile:
        yield found
    found.append(launches_in(profile.events()))


@contextlib.contextmanager
def counting_syncs(enabled):
    """Count the calls inside that make the host wait for a GPU: torch.cuda's sync debug mode
    "warn" reports each one as a warning (train.py --sync_debug, the smoke's budget). Yields a
    list that holds the count once the block ends; not enabled (or no CUDA): nothing counted,
    the list stays empty."""
    found = []
    if not enabled:
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found.append(sum(SYNC_WARNING in str(w.message) for w in caught))
