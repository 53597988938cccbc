"""
Every rank must hold the same geometry (and train.py's ranks the same parameters), and a
non-finite value on one rank must be seen by all of them (each rank's all_finite flag, which its
callers combine over the ranks in one all-reduce).

Each rank computes its bases or whitening factors from the same bytes (the decoded mean, the
all-reduced K-FAC statistics), so they agree bit for bit - unless a kernel is nondeterministic
or a node misbehaves. After each refresh ProductionCommunicator checks it with one tiny
all-reduce (verify_geometry); nanogeo.run.runtime.check_ranks_agree checks the parameters with the
same same_on_every_rank. Every decision below is read from the all-reduced values, which are
identical on every rank, so every rank takes the same branch and enters the same collectives.
"""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def all_finite(tensors):
    """A bool tensor on the device: every element of every tensor finite (no host sync). This
    rank's elements only: a DTensor is read through its local shard, and callers combine the
    ranks' flags in one all-reduce. Each tensor's (min, max) in one pass: a NaN anywhere makes
    both NaN, +inf is the max and -inf the min, so only 2 numbers a tensor are tested
    (isfinite(t).all() gives the same answer but writes a bool for every element: 8x slower on
    CPU, BENCHMARKS.md section 1). Real floating-point tensors (aminmax takes no complex)."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    ends = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    if not ends:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    return torch.isfinite(torch.cat(ends)).all()


def agrees_elementwise(value, group=None):
    """A bool tensor shaped like the device tensor `value`, identical on every rank: True where
    that element of `value` is the same on every rank. One all-reduce MAX of (value, -value):
    max = -max(-value) = min only where all ranks agree. NaN counts as +inf (a NaN would not
    reliably survive MAX)."""
    value = torch.nan_to_num(value.double(), nan=float("inf"))
    both = torch.stack([value, -value])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return both[0] == -both[1]


def same_on_every_rank(value, group=None):
    """True on every rank iff the device tensor `value` is the same on every rank."""
    return bool(agrees_elementwise(value, group).all())


def geometry_checksum(layers, ready):
    """One number (on the device) that changes with the geometry in use: every ready layer's
    tensors, each element weighted by its position among them all, summed in float64 - a few
    kernels for all the layers, not a few per tensor - plus the layers' decisions, each weighted
    by its layer's position (host numbers: added as a scalar, not copied to the device).
    `ready`: readiness() of layers."""
    tensors, decisions = [], 0.0
    for i, layer in enumerate(layers):
        if layer.built:
            tensors += [t.reshape(-1) for t in layer.tensors()]
            use_geo, right_only, _ = layer.flags()
            decisions += (i + 1) * (0.5 * use_geo + 0.25 * right_only)
    if not tensors:
        return ready.new_zeros(()) + decisions
    flat = torch.cat(tensors)
    weights = torch.linspace(1, 2, flat.numel(), dtype=flat.dtype, device=flat.device)
    return (flat * weights).sum(dtype=torch.float64) + decisions


def device_vector(values, device):
    """(len(values),) float64 on the device holding the host numbers `values`, made without a
    copy from host memory (on a GPU, torch.tensor(list, device=...) copies from pageable memory
    and makes the host wait): the numbers travel as the arguments of one multi-tensor add."""
    out = torch.zeros(len(values), dtype=torch.float64, device=device)
    if len(values):
        torch._foreach_add_(list(out.unbind()), [float(v) for v in values])
    return out


def readiness(layers, device):
    """(L,) float64 on the device: 1 for each layer that has a geometry, 0 for the others."""
    return device_vector([float(layer.built) for layer in layers], device)


def verify_geometry(layers, group, step, device):
    """Check that every rank of `group` holds the same geometry in `layers` (a list, in the same
    order on every rank): which layers have one, and its bits. On a mismatch rank 0's is
    broadcast and a warning printed; returns whether that was needed. Ranks on which different
    layers have a geometry cannot be repaired that way: a RuntimeError says so on every rank.
    (One host read; ProductionCommunicator splits it in two, to read `agree` with its other
    flags: geometry_agreement, then repair_geometry.)"""
    agree = geometry_agreement(layers, group, device)
    return repair_geometry(agree.tolist(), layers, group, step, device)


def geometry_agreement(layers, group, device):
    """(L + 1,) bool on the device, identical on every rank: which layers' readiness agrees
    across the ranks, then whether their bits do (a checksum). One all-reduce, no host read."""
    ready = readiness(layers, device)
    return agrees_elementwise(torch.cat([ready, geometry_checksum(layers, ready).reshape(1)]),
                              group)


def repair_geometry(agree, layers, group, step, device):
    """verify_geometry's decision, from geometry_agreement's flags read on the host (a list)."""
    if all(agree):
        return False
    if not all(agree[:-1]):
        raise RuntimeError(f"GeoFP8: the ranks built geometries for different layers by step "
                           f"{step}; restart from the last checkpoint")
    print(f"nanogeo.geometry.agreement: warning: GeoFP8 geometry differs across ranks at step {step}; "
          "using rank 0's", flush=True)
    broadcast_from_first(layers, group, device)
    return True


def broadcast_from_first(layers, group, device):
    """Overwrite every ready layer's tensors and decisions with those of the group's rank 0: one
    broadcast of one contiguous float64 buffer (exact for fp32 values; NCCL refuses
    non-contiguous tensors, and an SVD's factors are often strided), copied back in place."""
    ready = [layer for layer in layers if layer.built]
    tensors = [t for layer in ready for t in layer.tensors()]
    flags = device_vector([f for layer in ready for f in layer.flags()], device)
    buffer = torch.cat([t.double().reshape(-1) for t in tensors] + [flags.reshape(-1)])
    dist.broadcast(buffer, group=group, group_src=0)
    values = buffer.split([t.numel() for t in tensors] + [flags.numel()])
    for t, v in zip(tensors, values):
        t.copy_(v.view(t.shape))
    for layer, row in zip(ready, values[-1].view(len(ready), -1).tolist()):
        layer.load_flags(row)
