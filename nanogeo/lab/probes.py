"""
What a GPU would feel, counted on a CPU: kernel launches, host waits and memory of a piece of code.

A GPU pays a few microseconds per kernel launch, waits on the host for some ops (a linalg call
that checks its result, a tensor built from a Python list), and runs out of memory where a CPU
just swaps. None of that shows in a CPU's wall time, so the tests and benchmarks count it:

    with OpCounter() as ops:            # every aten op dispatched inside: ~ one launch each
        ...
    ops.total, ops.syncing, ops.counts  # ops that launch a kernel; those that wait for the
                                        # device on CUDA; by name
    ops.dispatched                      # every aten op, views included (issue 50's measure)

    with MemoryPeak() as mem:           # storages made by ops inside, tracked until freed
        ...
    mem.peak                            # the most of those bytes alive at once

Both are plain context managers around any code; they change nothing it computes.
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# aten ops that make the host wait for the device on CUDA: linalg calls that check their result
# (torch's docs: svd, eigh, cholesky, inv, solve synchronize; their `_ex` variants do not), a
# read of a value (.item(), bool(t)), data-dependent sizes (nonzero, boolean masks), and a tensor
# made from host data (torch.tensor(list, device=...): a copy from pageable memory). Not seen on
# the CPU: .tolist() and .numpy() of a CPU tensor dispatch no aten op (on CUDA they copy to the
# host and wait), so a new one of those in the hot path needs its own spy
SYNCING = {"linalg_svd", "_linalg_svd", "linalg_eigh", "_linalg_eigh", "linalg_cholesky",
           "linalg_inv", "linalg_solve", "cholesky", "_local_scalar_dense", "is_nonzero",
           "nonzero", "masked_select", "unique", "_unique2", "lift_fresh"}
# ops that only describe a tensor (no kernel on a GPU)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand",
             "unsqueeze", "squeeze", "slice", "select", "as_strided", "alias", "detach",
             "split", "split_with_sizes", "chunk", "unbind", "narrow", "view_as_real",
             "empty", "empty_strided", "empty_like", "sym_size", "sym_stride", "sym_numel",
             "is_same_size", "_reshape_alias", "unflatten", "flatten", "diagonal", "numel",
             "dim", "size", "stride"}


def op_name(func):
    """aten.linalg_svd.default -> "linalg_svd"."""
    return func._schema.name.split("::")[-1]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by name: `total` those that launch a
    kernel on a GPU (NO_KERNEL left out), `syncing` those that make the host wait (SYNCING)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(n for name, n in self.counts.items() if name not in NO_KERNEL)

    @property
    def dispatched(self):
        """Every aten op dispatched, those without a kernel (views) included."""
        return sum(self.counts.values())

    @property
    def syncing(self):
        return sum(n for name, n in self.counts.items() if name in SYNCING)


class MemoryPeak(TorchDispatchMode):
    """The most bytes of storage that ops inside the block created and that were alive at
    once (each new storage counted from the op that made it until it is freed). What existed
    before the block (the gradients, the model) does not count, nor do in-place writes and
    views; what the block leaves alive is `alive` at its end."""

    def __init__(self):
        super().__init__()
        self.alive = self.peak = 0
        self.tracked = set()            # data pointers of the storages alive now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output on an input's storage is a view or an in-place result, not new memory (an
        # input made before the block, a gradient, is in no record to say so)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.track(t.untyped_storage())
        return out

    def track(self, storage):
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.tracked or nbytes == 0:
            return                      # an in-place result or a view of a storage seen before
        self.tracked.add(ptr)
        self.alive += nbytes
        self.peak = max(self.peak, self.alive)

        def freed():
            self.alive -= nbytes
            self.tracked.discard(ptr)
        weakref.finalize(storage, freed)
