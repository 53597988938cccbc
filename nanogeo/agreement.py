"""
Every rank must hold the same geometry (and train.py's ranks the same parameters).

Each rank computes its bases or whitening factors from the same bytes (the decoded mean, the
all-reduced K-FAC statistics), so they agree bit for bit - unless a kernel is nondeterministic
or a node misbehaves. After each refresh compress.GeoFP8Communicator checks it with one tiny
all-reduce (verify_geometry); nanogeo.runtime.check_ranks_agree checks the parameters with the
same same_on_every_rank.
"""
import torch
import torch.distributed as dist


def same_on_every_rank(value, group=None):
    """True on every rank iff the device tensor `value` (a scalar, or any shape) is the same on
    every rank: one all-reduce MAX of (value, -value), whose result is (value, -value) only if
    max = min, element by element."""
    both = torch.stack([value, -value])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return bool((both == torch.stack([value, -value])).all())


def readiness(layers, device):
    """(L,) float64 on the device: 1 for each layer that has a geometry, 0 for the others."""
    return torch.tensor([float(layer.ready) for layer in layers], dtype=torch.float64,
                        device=device)


def geometry_checksum(layers, device):
    """One number (on the device) that changes with any bit of the geometry in use: which layers
    have one, every ready layer's tensors and its decisions, each weighted by its position."""
    ready = readiness(layers, device)
    terms = [(ready * torch.arange(1, len(layers) + 1, device=device)).sum()]
    for i, layer in enumerate(layers):
        if layer.ready:
            tensors = layer.tensors()
            terms += [t.double().sum() * (i + k + 1) for k, t in enumerate(tensors)]
            use_geo, right_only, _ = layer.flags()
            terms.append(tensors[0].new_tensor(0.5 * use_geo + 0.25 * right_only,
                                               dtype=torch.float64))
    return torch.stack(terms).sum()


def verify_geometry(layers, group, step, device):
    """Check that every rank of `group` holds the same geometry in `layers` (a list, in the same
    order on every rank). On a mismatch rank 0's (every ready layer's tensors and decisions) is
    broadcast and a warning printed; returns whether that was needed. Ranks on which different
    layers have a geometry cannot be repaired that way: a RuntimeError says so on every rank."""
    if same_on_every_rank(geometry_checksum(layers, device), group):
        return False
    if not same_on_every_rank(readiness(layers, device), group):
        raise RuntimeError(f"GeoFP8: the ranks built geometries for different layers by step "
                           f"{step}; restart from the last checkpoint")
    print(f"nanogeo.agreement: warning: GeoFP8 geometry differs across ranks at step {step}; "
          "using rank 0's", flush=True)
    for layer in layers:
        if layer.ready:
            flags = torch.tensor(layer.flags(), dtype=torch.float64, device=device)
            for t in layer.tensors() + [flags]:
                dist.broadcast(t, group=group, group_src=0)
            layer.load_flags(flags.tolist())
    return True
