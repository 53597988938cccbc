"""
The communicator measures and builds geometry in IEEE fp32, whatever precision the model's own
matmuls use.

On an Ampere-or-later GPU, train.py lets fp32 matmuls run in TF32 (nanogeo.run.runtime): the
model runs in bf16 autocast anyway. TF32 rounds every matmul input to a 10-bit mantissa, a
relative error of about 5e-4 - harmless for a forward pass, fatal for what the communicator
computes from the gradients:

  * Muon's gain check is a finite difference with a relative step of 1e-3 through Newton-Schulz
    (nanogeo/geometry/update_error.py): TF32's rounding is the same size as the step, so the
    measured error would be rounding noise;
  * the K-FAC moments x^T x and the whitening's eigenpairs lose the small-variance directions
    that the whitening amplifies;
  * the subspace iteration and the encode/decode of the coordinates mix every element with
    every other: the rounding of one large direction lands on the small ones.

So every such computation runs inside `ieee_fp32()`, which sets the matmul precision of cuBLAS
(torch.backends.cuda.matmul) and of oneDNN on the CPU (torch.backends.mkldnn.matmul) to "ieee"
and puts back what was there.

Torch keeps two views of that setting: the `fp32_precision` API (per backend) and the legacy one
(`torch.backends.cuda.matmul.allow_tf32`, `torch.get_float32_matmul_precision()`). Reading the
legacy view raises ("you have used mix of the legacy and new APIs") whenever the two disagree -
and setting only the new API makes them disagree, since the legacy view still says "highest".
Torch's own code still reads the legacy view (inductor: its autotuning cache key, dynamo's graph
deduplication), so a program that sets TF32 through `fp32_precision` alone can fail inside
torch.compile: PyTorch issue #166387 ("BackendCompilerFailed about mixed TF32 API usage ...
when only new API is used"), open in torch 2.13. So both views are kept in agreement: train.py
turns TF32 on with `torch.set_float32_matmul_precision("high")` (nanogeo/run/runtime.py), which
sets both, and ieee_fp32() sets "highest" the same way before it sets each backend's own
precision, and puts the legacy view back after.
"""
import contextlib
import functools

import torch

# (the matmul backend, its parent in fp32_precision's hierarchy: "none" in the child inherits)
MATMUL_BACKENDS = ((torch.backends.cuda.matmul, torch.backends.cudnn),    # cuBLAS <- "cuda"
                   (torch.backends.mkldnn.matmul, torch.backends.mkldnn))  # oneDNN <- "mkldnn"


def matmul_precisions():
    """The fp32 matmul precision in force now, per backend: ("cuda", "mkldnn") values, each
    "ieee", "tf32" or (oneDNN on CPUs with AMX) "bf16"."""
    return tuple(backend.fp32_precision for backend, _ in MATMUL_BACKENDS)


def legacy_precision():
    """The legacy view, torch.get_float32_matmul_precision() ("highest", "high" or "medium"), or
    None where torch refuses to read it (the views disagree: someone set only the new API)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


@contextlib.contextmanager
def ieee_fp32():
    """with ieee_fp32(): fp32 matmuls in here round as IEEE fp32 does (no TF32, no bf16
    passes), on the GPU and the CPU, and both of torch's views say so (allow_tf32 reads False);
    the setting in force before is restored after, also on an exception. Torch reads a child's
    precision through its parent when the child is "none", and reports the resolved value: a
    value equal to the parent's is put back as "none", so that a later change of the global
    setting still reaches it."""
    saved = [(backend, backend.fp32_precision, parent.fp32_precision)
             for backend, parent in MATMUL_BACKENDS]
    legacy = legacy_precision()
    torch.set_float32_matmul_precision("highest")       # the legacy view: no TF32
    for backend, _ in MATMUL_BACKENDS:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        if legacy is not None:      # (unreadable: the views disagreed; it stays "highest")
            torch.set_float32_matmul_precision(legacy)
        for backend, own, inherited in saved:
            backend.fp32_precision = "none" if own == inherited else own


def ieee(fn):
    """fn, run inside ieee_fp32() (a decorator for the communicator's methods)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with ieee_fp32():
            return fn(*args, **kwargs)
    return wrapper
