"""
train.py --simulate_workers=W: one process plays W data-parallel ranks. Each simulated rank
computes its own micro-batches' gradients (train.forward_backward); this module averages them
through exactly the numerics a W-rank run's collective applies, so a study of many ranks runs on
one machine (tests/test_train.py: bit-equal to a real 2-rank gloo run).
"""
import torch

import compress
from nanogeo import hooks


@torch.no_grad()
def reduce_gradients(params, worker_grads, method, communicator, worker_moments=None):
    """train.reduce_gradients for W simulated ranks (method: --comm): set each param's .grad
    to the mean of their gradients (worker_grads[i]: rank i's, in params order), through exactly
    the numerics of the collective a W-rank run uses: the same sum in the wire's dtype for fp32 /
    bf16 (equal, bit for bit, to a 2-rank gloo run), the collective's simulator for the
    compressed methods. Returns the bytes each rank would send (with the whitening statistics'
    all-reduce on the steps that average them, as train.reduce_gradients counts them)."""
    world = len(worker_grads)
    if method in ("fp32", "bf16"):
        dtype = torch.float32 if method == "fp32" else torch.bfloat16
        means = []
        for grads in zip(*worker_grads):
            total = grads[0].to(dtype)
            for g in grads[1:]:
                total = total + g.to(dtype)         # the all_reduce SUM, in the wire's dtype
            means.append(total.float() / world)
        numel = sum(g.numel() for g in worker_grads[0])
        sent = compress.ring_allreduce_bytes(numel, dtype.itemsize, world) if world > 1 else 0
    else:   # worker_moments: each rank's whitening statistics, on the steps that collect them
        means, sent = communicator.reduce_workers(worker_grads, worker_moments or None)
        if worker_moments:      # ... averaged over the ranks by one more all-reduce
            sent += hooks.statistics_bytes(communicator, world)
    for p, mean in zip(params, means):
        p.grad = mean
    return sent
