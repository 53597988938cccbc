"""
GeoFP8 for any DistributedDataParallel model, as a DDP communication hook.

    from torch.nn.parallel import DistributedDataParallel as DDP
    from nanogeo.ddp import GeoFP8HookState, geofp8_hook

    model = DDP(model)
    model.register_comm_hook(GeoFP8HookState(model, rank=16, warmup=10), geofp8_hook)

DDP hands the hook one bucket at a time: a flat buffer holding several parameters' gradients.
The hook names the parameters in the bucket, averages their gradients with compress.py's
two-stage FP8 collective (in geometry-aware coordinates where that measurably helps), writes the
mean back into the bucket and returns it as an already-completed future. Options are those of
compress.GeoOptions (the same as train.py's flags): fmt, block, geo, rank, refresh, warmup,
error_feedback, stochastic, ...

Buckets: DDP rebuilds its buckets once, after the first iteration, in the order gradients became
ready. Each distinct bucket gets its own communicator; when a new bucket appears, the geometry
and error-feedback state of its parameters move over from the communicators that held them, so
nothing learned is lost. Every rank sees the same buckets, so every rank builds the same state.
Parameters that received no gradient (find_unused_parameters=True) arrive as zeros and are sent
like any other.
"""

import torch
import torch.distributed as dist

import compress


class GeoFP8HookState:
    """What the hook keeps between calls: parameter names, one communicator per bucket layout,
    and the bytes sent (for logging)."""

    def __init__(self, model, process_group=None, **options):
        module = model.module if hasattr(model, "module") else model
        vocab = options.pop("vocab_size", 0) or _guess_vocab_size(module)
        self.options = compress.GeoOptions(vocab_size=vocab, **options)
        self.process_group = process_group
        self.names = {p: n for n, p in module.named_parameters()}
        self.communicators = {}     # tuple of names -> GeoFP8Communicator
        self.bytes_sent = 0         # since the last reset_bytes()

    def communicator(self, names, shapes):
        key = tuple(names)
        comm = self.communicators.get(key)
        if comm is None:
            comm = compress.GeoFP8Communicator(list(zip(names, shapes)), self.options,
                                               self.process_group)
            for old in self.communicators.values():  # carry state over from older buckets
                for n in names:
                    if n in old.layers and n in comm.layers:
                        comm.layers[n] = old.layers[n]
                for worker, residual in old.residuals.items():
                    comm.residuals.setdefault(worker, {}).update(
                        {n: r for n, r in residual.items() if n in names})
                comm.step = max(comm.step, old.step)
            self.communicators[key] = comm
        return comm

    def reset_bytes(self):
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    def table(self):
        return "\n".join(c.table() for c in self.communicators.values())


def _guess_vocab_size(module):
    """The vocabulary of the first nn.Embedding: its dimension stays Euclidean everywhere."""
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding):
            return m.num_embeddings
    return 0


def geofp8_hook(state: GeoFP8HookState,
                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket with the FP8 / GeoFP8 collective. Returns a completed future."""
    params = bucket.parameters()
    grads = [g.detach().clone() for g in bucket.gradients()]  # per-parameter (views of buffer)
    names = [state.names[p] for p in params]
    comm = state.communicator(names, [tuple(p.shape) for p in params])
    state.bytes_sent += comm.reduce(grads)
    buffer = bucket.buffer()
    offset = 0
    for g in grads:  # write the means back in bucket order
        buffer[offset: offset + g.numel()].copy_(g.reshape(-1))
        offset += g.numel()
    future = torch.futures.Future()
    future.set_result(buffer)
    return future
