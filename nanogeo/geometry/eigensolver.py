"""
The whitening's refresh, made cheap: the top-r eigenpairs of a layer's input second moment A by
subspace iteration, instead of compress.py's full eigendecomposition.

compress.whitening_factor needs only A's r = 32 largest eigenpairs (the rest of A enters through
its diagonal). compress.top_eigenpairs computes all d of them in float64 - ~9 d^3 flops of a
memory-bound solver (on CUDA, eigh also stops the host) - for a llama-300m MLP input, d = 2736,
about 2e11 flops per layer and refresh, on every rank. Subspace iteration finds the top k = r +
oversample directions with a few products A Q (2 d^2 k flops each, fp32 GEMMs) and a QR of a
thin d x k matrix; a Rayleigh-Ritz step in float64 on the k x k projection of A then gives the
eigenpairs. The moments move slowly (an EMA of 0.95 across refreshes), so a refresh starts from
the directions of the factor in use and needs fewer products than the first one, which starts
from a random block (seeded by d: the same on every rank, so every rank computes the same factor from
the same all-reduced A).

Accuracy: a direction among the top r is found to a relative error of about
(lambda_k+1 / lambda_r)^iterations; where A's spectrum is flat around r, which directions make
the cut is arbitrary for the exact solver too, and A^ (U diag(lam) U^T plus the floored rest of
the diagonal) stays the same metric to within that part of the spectrum. Where the gain check
measures every factor before it is used (geo_layers=gain, compress.py section 5), a poorer factor
can cost the gain, never the error; where layers are used unmeasured (a list, the paper's
"fragile" choice, "all"), the default whiten_solver="auto" keeps the exact eigh
(layers.whiten_solver). tests/test_gpu_numerics.py holds the factors and the gain check's
decisions to the textbook form; BENCHMARKS.md "Geometry refresh cost" gives the times
(nanogeo/lab/refresh_bench.py).
"""
import functools

import torch

import compress

COLD_ITERATIONS = 8         # products A Q from a random start
WARM_ITERATIONS = 4         # ... from the directions of the factor in use
OVERSAMPLE = 16             # extra directions iterated beside the r wanted


def orthonormal(X):
    """An orthonormal basis of X's columns (d, k), k <= d."""
    return torch.linalg.qr(X).Q


@functools.lru_cache(maxsize=None)
def random_start(d, k, device):
    """(d, k) fp32 random directions seeded by d: the same on every rank. Made once per shape and
    device, so a refresh copies nothing from the host (a pageable copy would wait on the GPU)."""
    generator = torch.Generator(device="cpu").manual_seed(d)
    return torch.randn(d, k, generator=generator).to(device)


def subspace_eigenpairs(A, r, floor, start=None, iterations=None, oversample=OVERSAMPLE):
    """compress.top_eigenpairs(A, r, floor)'s (U (d, r), lam (r,), rest (d,)) for a symmetric
    float64 A (d, d), by subspace iteration in fp32 and a Rayleigh-Ritz step in float64.
    `start`: (d, r) directions near the wanted ones (a warm start), or None. Where k = r +
    oversample is not well below d, the full eigendecomposition is as cheap: that one."""
    d = A.shape[0]
    k = r + oversample
    if 2 * k > d:
        return compress.top_eigenpairs(A, r, floor)
    Q = random_start(d, k, A.device)                            # (d, k) fp32
    warm = start is not None and tuple(start.shape) == (d, r)
    if warm:                        # (a new tensor, not written in place: torch.vmap maps this)
        Q = torch.cat([start.to(Q.dtype), Q[:, r:]], dim=1)
    A32 = A.float()
    Q = orthonormal(Q)
    for _ in range(iterations or (WARM_ITERATIONS if warm else COLD_ITERATIONS)):
        Q = orthonormal(A32 @ Q)
    Q = orthonormal(Q.double())                                 # (d, k) float64
    values, W = torch.linalg.eigh(Q.T @ A @ Q)                  # (k,), (k, k) ascending
    U, lam = Q @ W[:, -r:], values[-r:].clamp(min=0)      # (d, r), (r,)
    rest = (A.diagonal() - (U.pow(2) * lam).sum(1)).clamp(min=floor)
    return U, lam, rest


def start_of(factor):
    """The eigen-directions a low-rank factor (compress.Whitening) was built from, as a warm
    start: its directions Z span D^-1/2 U, so D^1/2 Z spans U. None for other factors."""
    if not isinstance(factor, compress.Whitening) or factor.directions is None:
        return None
    return orthonormal((factor.sqrt_d[:, None] * factor.directions).float())


def fast_whitening_factor(A, r=32, damping=1e-3, floor=1e-3, old=None):
    """compress.whitening_factor with the top-r eigenpairs by subspace iteration, warm-started
    from `old`, the factor in use (or None)."""
    start = start_of(old)
    A64 = (A.double() + A.double().T) / 2
    parts = subspace_eigenpairs(A64, min(r, A.shape[0]), floor,
                                start=None if start is None else start.to(A.device))
    return compress.factor_of_parts(*parts, damping, A.dtype)
