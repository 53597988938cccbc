"""
Every rank must hold the same geometry (and train.py's ranks the same parameters).

Each rank computes its bases or whitening factors from the same bytes (the decoded mean, the
all-reduced K-FAC statistics), so they agree bit for bit - unless a kernel is nondeterministic
or a node misbehaves. After each refresh compress.GeoFP8Communicator checks it with one tiny
all-reduce (verify_geometry); nanogeo.runtime.check_ranks_agree does the same for parameters.
"""
import torch
import torch.distributed as dist


def same_on_every_rank(value, group=None):
    """True on every rank iff the device scalar `value` is the same on every rank: one
    all-reduce MAX of (value, -value), whose result is (value, -value) only if max = min."""
    both = torch.stack([value, -value])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return bool((both == torch.stack([value, -value])).all())


def geometry_checksum(layers):
    """One number (on the device) that changes with any bit of the geometry in use: every ready
    layer's tensors and its decisions, each weighted by its position."""
    terms = []
    for i, layer in enumerate(layers):
        if layer.ready:
            tensors = layer.tensors()
            terms += [t.double().sum() * (i + k + 1) for k, t in enumerate(tensors)]
            use_geo, right_only, _ = layer.flags()
            terms.append(tensors[0].new_tensor(0.5 * use_geo + 0.25 * right_only,
                                               dtype=torch.float64))
    return torch.stack(terms).sum()


def verify_geometry(comm):
    """Check that every rank of comm.group holds the same geometry; on a mismatch broadcast rank
    0's (every layer's tensors and decisions) and print a warning."""
    layers = list(comm.layers.values())
    if not any(layer.ready for layer in layers):    # nothing computed yet (no statistics came)
        return
    mine = geometry_checksum(layers)
    if same_on_every_rank(mine, comm.group):
        return
    print(f"nanogeo: warning: GeoFP8 geometry differs across ranks at step {comm.step}; "
          "using rank 0's", flush=True)
    src = dist.get_global_rank(comm.group, 0) if comm.group is not None else 0
    for layer in layers:
        if layer.ready:
            flags = torch.tensor(layer.flags(), device=mine.device)
            for t in layer.tensors() + [flags]:
                dist.broadcast(t, src=src, group=comm.group)
            layer.load_flags(flags.tolist())
