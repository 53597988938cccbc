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

torch.compile'd code under a dispatch mode falls back to its eager ops, so by itself a probe would
count the packed FP8 codec's ~11 ops an encode where compiled code runs one fused kernel. To
count the codec compiled (as train.py --compile runs it), on the CPU:

    with kernels_profiled():            # the codec compiled anew, its C++ kernels profiled
        nanogeo.wire.kernels.compile_hot_path(True)
        with OpCounter() as ops, compiled_kernels_seen():
            ...                         # each compiled codec call: its fused kernels, counted
"""
import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
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

    def compiled_call(self, name, kernels, outputs):
        """A compiled call seen by compiled_kernels_seen(): its `kernels` fused kernels."""
        self.counts[name] = self.counts.get(name, 0) + kernels

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

    def compiled_call(self, name, kernels, outputs):
        """A compiled call seen by compiled_kernels_seen(): the storages it returned (inside,
        inductor's fused kernels keep their intermediates in registers)."""
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t.untyped_storage())

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


@contextlib.contextmanager
def kernels_profiled():
    """While active, every C++ kernel inductor compiles records itself in the profiler (named
    graph_<n>_cpp_fused_...), so compiled_kernels_seen() can count them. The codec compiles anew
    on entry and on exit (torch._dynamo.reset(): so does every other compiled function of the
    process, a compiled model too), so none compiled before runs unprofiled inside and none
    compiled inside stays profiled; on exit the codec is compiled or eager as it was before."""
    import torch._dynamo as dynamo
    import torch._inductor.config as inductor_config
    from nanogeo.wire import kernels

    def compile_anew():
        kernels.COMPILED.clear()
        kernels.KERNELS.update(kernels.EAGER)
        dynamo.reset()
    was, was_compiled = inductor_config.cpp.enable_kernel_profile, kernels.compiled()
    try:
        inductor_config.cpp.enable_kernel_profile = True
        compile_anew()
        yield
    finally:
        inductor_config.cpp.enable_kernel_profile = was
        compile_anew()
        kernels.compile_hot_path(was_compiled)


@contextlib.contextmanager
def compiled_kernels_seen():
    """While active, each call of a compiled codec kernel (nanogeo.wire.kernels.KERNELS after
    compile_hot_path(True)) runs compiled, outside the probes, and reports to each probe active
    at the call (compiled_call) the fused kernels it ran, each a launch. The profiler counts
    them at the first call of each graph (a graph is the same for every group count G but 1,
    nanogeo.wire.kernels: one per kernel, dtype and G = 1 or not). On the CPU only (inductor's
    C++ kernels, compiled inside kernels_profiled()): there the codec's graph is one kernel an
    encode and one a decode; Triton's fusion on a GPU is not counted here and may differ."""
    from nanogeo.wire import kernels
    fused_per_graph = {}

    def fused(kernel, args):
        """The kernels that one call of `kernel` runs, the profiler's count."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out = kernel(*args)
        count = sum(e.name.startswith("graph_") for e in profile.events())
        if not count:
            raise RuntimeError("a compiled kernel ran no profiled kernel: compile it inside "
                               "kernels_profiled(), on the CPU")
        return out, count

    def seen(name, kernel):
        def call(*args):
            graph = (name, *[(a.dtype, a.shape[:1] == (1,), a.shape[1:])
                             if isinstance(a, torch.Tensor) else a for a in args])
            with _disable_current_modes() as probes:
                if graph not in fused_per_graph:
                    out, fused_per_graph[graph] = fused(kernel, args)
                else:
                    out = kernel(*args)
            for probe in probes:
                if hasattr(probe, "compiled_call"):
                    probe.compiled_call(f"compiled {name}", fused_per_graph[graph], out)
            return out
        return call

    saved = dict(kernels.KERNELS)
    kernels.KERNELS.update({name: seen(name, kernel) for name, kernel in saved.items()
                            if kernel is not kernels.EAGER[name]})
    try:
        yield
    finally:
        kernels.KERNELS.update(saved)
