"""
Peak memory of the gradient reduction at any model size, without training it (issue 50, item 4).

    python -m nanogeo.lab.reduce_memory --preset llama-600m --geometry euclidean --fmt nvfp4
        [--bucket_mb 25] [--steps 3] [--compile] [any other Options field: --geo_warmup 1 ...]

Builds the preset's model (its memory only: never initialised), fills every .grad with random
normal values and averages them as train.py does with a compressed --comm
(train.reduce_gradients: ProductionCommunicator.step, here through reduce(); the communicator
made as train.make_communicator makes it: linear layers by module type, judged through an AdamW's
view), as rank 0 of a 2-rank process group: Loopback, a process group in this one process
whose collectives complete at once, into buffers of the sizes a second rank holding the same
gradients would fill. An all_to_all brings W copies of this rank's own shard (what identical
ranks send it), a SUM is W times the value, a MAX the value; an all_gather brings W copies of
this rank's input, where the other rank would send its own shard: the same sizes, other values.
So every buffer rank 0 of a real 2-rank run allocates is allocated here, with the same sizes
(2 gloo ranks' peaks are the same: tests/test_bucket.py, BENCHMARKS.md section 21), while the
means outside this rank's shard are stand-ins (with FP8, this shard's [scale | codes] rows,
read in the others' places: finite, so the geometry's refresh and gain check run on them as
they would, deciding nothing about real gradients).

Each step runs inside nanogeo.lab.probes.MemoryPeak (the most bytes of new storage alive at once
inside the reduce; the gradients and the model not counted) and OpCounter (aten ops: ~ a kernel
launch each on a GPU, the price of more buckets; the ops that make a GPU's host wait, by name;
and a refresh's factorisations, SOLVERS), printed per step in MB (10^6 bytes) and as a multiple
of the gradients' bytes. The first step also builds what is kept from then on (the layouts'
index tensors, the geometry); the steps after it show what every step needs. --compile
compiles the packed FP8 codec as train.py --compile does (nanogeo.wire.kernels) and counts
each compiled call as the fused kernels it runs
(nanogeo.lab.probes.compiled_kernels_seen: inductor's C++ kernels on this CPU; Triton's fusion
on a GPU may differ).
"""
import argparse
import contextlib
import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.futures import Future

import model as model_lib
from nanogeo.lab.probes import (SYNCING, MemoryPeak, OpCounter, compiled_kernels_seen,
                                kernels_profiled)
from nanogeo.parallel import hooks
from nanogeo.parallel.communicator import Options, ProductionCommunicator
from nanogeo.run import config
from nanogeo.wire import kernels


class Done(dist._Work):
    """A collective that finished when it was called."""

    def __init__(self, result=None):
        super().__init__()
        self.future = Future()
        self.future.set_result(result)

    def wait(self, timeout=None):
        return True

    def get_future(self):
        return self.future


class Loopback(dist.ProcessGroup):
    """Rank 0 of `world` ranks that hold what this process holds: each collective completes at
    once, as if every other rank had sent this one's values (for an all_gather, whose other
    ranks send their own parts, only the sizes are right)."""

    def __init__(self, world):
        super().__init__(0, world)
        self.world = world

    def getBackendName(self):
        return "loopback"

    def allreduce(self, tensors, opts):
        for t in tensors:
            if opts.reduceOp == dist.ReduceOp.SUM:
                t.mul_(self.world)          # W equal values; MAX, MIN, AVG: the value itself
        return Done(tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        own = input_split_sizes[0] if input_split_sizes else input.numel() // self.world
        output.view(self.world, -1).copy_(input[:own].expand(self.world, -1))   # shard 0, W x
        return Done([output])

    def all_gather_single(self, output, input, opts):
        output.view(self.world, -1).copy_(input.reshape(1, -1).expand(self.world, -1))
        return Done([output])

    _allgather_base = all_gather_single

    def allgather(self, output_lists, inputs, opts):
        for outputs, t in zip(output_lists, inputs):
            for out in outputs:
                out.copy_(t)
        return Done(output_lists)

    def broadcast(self, tensors, opts):
        return Done(tensors)

    def barrier(self, opts=None):
        return Done()


def join_loopback(world=2):
    """Make a Loopback group of `world` ranks the default process group (this process: rank 0)."""
    group = Loopback(world)
    dist.Backend.register_backend("loopback", lambda store, rank, size, timeout: group,
                                  devices=["cpu"])
    dist.init_process_group("loopback", store=dist.HashStore(), rank=0, world_size=world)
    return group


def communicator_for(net, options):
    """The communicator train.make_communicator makes for `net` (linear layers by module type,
    the vocabulary, an AdamW's view for the gain check), with Options `options`."""
    named = [(n, p.shape) for n, p in net.named_parameters() if p.requires_grad]
    communicator = ProductionCommunicator(named, Options.of(vocab_size=net.config.vocab_size,
                                                            **options),
                                          linear=set(hooks.linear_layers(net)))
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad])
    return communicator.watch(hooks.optimizer_views([optimizer], net))


def reduce_peaks(preset, options, steps=3, seed=0, compiled=False):
    """[(peak new bytes inside the reduce, the gradients' bytes, its OpCounter)] for `steps`
    steps of a Loopback rank 0 averaging random gradients of `preset`'s parameters with Options
    `options` (`compiled`: with the packed codec compiled, its calls counted as their kernels -
    every compiled function of the process is compiled anew, probes.kernels_profiled; the
    codec's state is put back after)."""
    with torch.device("meta"):
        net = model_lib.Llama(model_lib.model_config(preset))
    net.to_empty(device="cpu")                  # memory only: the reduction never reads it
    params = [p for p in net.parameters() if p.requires_grad]
    communicator = communicator_for(net, options)
    generator, peaks, was_compiled = torch.Generator().manual_seed(seed), [], kernels.compiled()
    try:
        with kernels_profiled() if compiled else contextlib.nullcontext():
            kernels.compile_hot_path(compiled)
            for _ in range(steps):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=generator)
                with OpCounter() as ops, MemoryPeak() as mem, compiled_kernels_seen():
                    communicator.reduce([p.grad for p in params])
                peaks.append((mem.peak, sum(p.grad.numel() * p.grad.element_size()
                                            for p in params), ops))
    finally:
        kernels.compile_hot_path(was_compiled)      # (compiled anew, unprofiled, if it was)
    return peaks


def option_flags(parser):
    """--FIELD for every Options field of a plain type (a string, number or bool), and --block."""
    for f in dataclasses.fields(Options):
        if f.name == "block":
            parser.add_argument("--block", type=config.parse_block)
        elif f.type in (str, int, float):
            parser.add_argument(f"--{f.name}", type=f.type)
        elif f.type is bool:
            parser.add_argument(f"--{f.name}", type=lambda text: text.lower() in
                                config.TRUE_WORDS)


# the factorisations of a refresh (BENCHMARKS.md section 26), each one op here whatever its
# batch; on CUDA some are a solver call per matrix (orgqr always, geqrf for more than 256 rows)
# - the SVD and eigh are under "syncing"; the triangular solves include the Householder
# completions' T
SOLVERS = {"linalg_qr", "geqrf", "linalg_householder_product", "linalg_cholesky_ex",
           "linalg_solve_triangular"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", default="cpu-tiny", choices=list(model_lib.PRESETS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", dest="compiled",
                        help="the packed FP8 codec compiled")
    option_flags(parser)
    args = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    preset, steps, compiled = args.pop("preset"), args.pop("steps"), args.pop("compiled")
    options = {k: v for k, v in args.items() if v is not None}
    join_loopback(2)
    peaks = reduce_peaks(preset, options, steps, compiled=compiled)
    grads = peaks[0][1]
    print(f"{preset} {options}{' compiled' if compiled else ''}: gradients {grads / 1e6:,.1f} "
          f"MB; peak new bytes inside the reduce, rank 0 of 2:")
    for step, (peak, _, ops) in enumerate(peaks, 1):
        syncing = {name: n for name, n in sorted(ops.counts.items()) if name in SYNCING}
        solvers = {name: n for name, n in sorted(ops.counts.items()) if name in SOLVERS}
        print(f"  step {step}: {peak / 1e6:,.1f} MB = {peak / grads:.3f} x the gradients, "
              f"{ops.total} aten ops (kernel launches on a GPU), syncing {syncing or 'none'}"
              + (f", solvers {solvers}" if solvers else ""))
    dist.destroy_process_group()
    return peaks


if __name__ == "__main__":
    main()
