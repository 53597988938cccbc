"""
The whitening's cheap refresh - the top-r eigenpairs of a layer's input second moment by
subspace iteration, warm-started from the factor in use - is part of the method, so compress.py
states it (section 3: whitening_factor(..., solver="subspace"), subspace_eigenpairs); the fast
path builds its factors with that code (geometry/layers.factor_of_kind, mapped over a stack by
geometry/batched.factors_stack). This module keeps its old functions' names and signatures for
one release (without the iteration count, now fixed: 8 products cold, 4 warm).
Times and accuracy: BENCHMARKS.md "Geometry refresh cost"; tests/test_gpu_numerics.py.
"""
import compress
from compress import orthonormal, random_start  # noqa: F401 (old names)

start_of = compress.eigen_directions


def subspace_eigenpairs(A, r, floor, start=None, oversample=16):
    return compress.subspace_eigenpairs(A, r, floor, warm_start=start, oversample=oversample)


def fast_whitening_factor(A, r=32, damping=1e-3, floor=1e-3, old=None):
    return compress.whitening_factor(A, r, damping, floor, solver="subspace", old=old)
