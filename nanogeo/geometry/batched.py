"""
The subspace rotation for many matrices at once: the matrices of one shape stacked, and the
per-matrix code mapped over the stack with torch.vmap. (The production seam of issue 50: the
communicator's all_to_coords, all_from_coords, propose_all and measure come here.)

compress.py rotates one matrix at a time (its section 4): a dozen small kernels to encode a
matrix, as many to decode it, and at a refresh a subspace iteration, an SVD and two Householder
completions per matrix. A GPU pays a launch of a few microseconds for every kernel and, at every
SVD, a wait of the host (torch's svd checks its result on the host and has no `_ex` variant). A
transformer has few shapes, each many times over (cpu-tiny: 28 matrices of 4 shapes). Here the
matrices of one shape go through together: torch.vmap runs compress.py's own functions (and
nanogeo.geometry.rows' row form of the subspace iteration, nanogeo.geometry.update_error's
optimizer views) on a stack (L, m, n), each op launched once for the whole stack: a matrix
product becomes one batched product, and a refresh makes one SVD per shape group. One piece is
written a second time: the rotation's encode and decode (rotate_stack_), whose subtractions run
in place on the stack as one GEMM each (vmap has no batching rule for an in-place product: it
would loop over the matrices); it makes the products compress.encode_geo makes, on the same
operands, and the tests hold it to them.

Numbers: the same ops on the same values (a batched in-place product for compress's addmm). A
batched product or reduction may add in another order than its one-matrix form (torch chooses
the kernel; below 400 multiply-adds a CPU's batched product takes ATen's own loop, not BLAS):
on the CPU with one thread they have matched bit for bit (tests/test_reference.py holds whole
runs against compress.py's), elsewhere the bases, coordinates and measured errors may differ
from compress.py's at fp32 rounding (tests/test_batched.py states the tolerances, and that the
gain check decides alike). The
codec's round trip of a stack (round_trip_stack) is bit-equal to compress.py's per matrix: it
only views the stack so that compress.quantize's scale groups are each matrix's own.

What goes through here: nanogeo.geometry.layers.ProductionSubspaceLayer with Householder bases,
on a rank that holds every row (train.py, the DDP hook) - encode, decode, refresh and the gain
check's measurements - and the low-rank whitening's refresh (its factors, one eigendecomposition
and one SVD per side and group of one width: whiten_stack). FSDP's row blocks run their subspace
iteration matrix by matrix but complete their bases together (refresh_rows); the dense-basis
ablations, the whitening's encode and decode and the Hadamard control go matrix by matrix.
"""
import functools

import torch

import compress
from nanogeo.geometry import rows as row_blocks
from nanogeo.geometry.layers import (LOWRANK_TENSORS, UNSHARDED, ProductionSubspaceLayer,
                                     ProductionWhitenedLayer, factor_of_kind, whiten_solver)
from nanogeo.geometry.update_error import OptimizerView, UpdateError


def stackable(layer):
    """Can this layer go through the batched forms: the subspace rotation with Householder
    bases, every row of its matrix on this rank?"""
    return (type(layer) is ProductionSubspaceLayer
            and (layer.rows is None or not layer.rows.sharded))


def row_sharded(layer):
    """Is this layer the subspace rotation on a block of its matrix's rows (FSDP): its subspace
    iteration runs matrix by matrix (summed over the ranks), its Householder completion batched
    with other layers' (refresh_rows)?"""
    return type(layer) is ProductionSubspaceLayer and not stackable(layer)


def refresh_rows(layers, means):
    """ProductionSubspaceLayer.refresh(mean) of each row_sharded layer: its own subspace
    iteration on its rows (the same order of collectives on every rank), then the Householder
    completions of all of them together (complete_together) - one set of kernels per r and
    shape, not one per matrix. (The new bases are views into one tensor per shape, as
    refresh_stacks' are: a few hundred KB a module.)"""
    found = [layer.dominant_subspaces(mean) for layer, mean in zip(layers, means)]  # [(U, V)]
    bases = complete_together([U[None] for U, _ in found] + [V[None] for _, V in found])
    for layer, mean, (Yl, Tl), (Yr, Tr) in zip(layers, means, bases, bases[len(layers):]):
        layer.use_bases((Yl[0], Tl[0]), (Yr[0], Tr[0]), mean.device)


def groups(keys):
    """{key: [item, ...]} from {item: key}, in first-seen order."""
    out = {}
    for item, key in keys.items():
        out.setdefault(key, []).append(item)
    return out


def runs(items, numel, limit):
    """items (of one shape, numel elements each) cut into runs of at most `limit` elements
    together (None: one run): a stack is a copy, so a large model's shape group is stacked a
    bucket's worth at a time - the memory of one bucket, not of every matrix of the shape."""
    per = len(items) if limit is None else max(1, limit // numel)
    return [items[i:i + per] for i in range(0, len(items), per)]


# -- the rotation: encode and decode ------------------------------------------------------------

def sides_of(transform):
    """(left rotates, right rotates) of a transform (P or None, Q or None)."""
    return tuple(basis is not None for basis in transform)


def stack_bases(transforms):
    """[(P or None, Q or None)] of L matrices (all on the same sides) -> per side the stacked
    (Y (L, m or n, r), T (L, r, r)), or None for a side that does not rotate."""
    return tuple(None if transforms[0][side] is None else
                 (torch.stack([t[side].Y for t in transforms]),
                  torch.stack([t[side].T for t in transforms]))
                 for side in (0, 1))


def with_products(bases):
    """stack_bases' (Y, T) of each side with Y T^T and Y T added: the products
    compress.HouseholderBasis.apply_t and apply make at every call, made once for the stack
    (mapped with vmap, as compress makes them a matrix at a time)."""
    products = torch.vmap(lambda Y, T: (Y @ T.T, Y @ T))
    return tuple(None if b is None else (*b, *products(*b)) for b in bases)


def subtract_product_(X, Y, YT):
    """X <- X - YT (Y^T X) for a stack X (L, m, n) or its transposed view, in place:
    compress.HouseholderBasis.apply_t (YT = Y T^T) or apply (YT = Y T) of every matrix. The
    spec's addmm becomes one in-place batched GEMM (beta = 1): no copy of X and no separate
    subtraction - on a GPU one kernel where X - A @ B launches two."""
    return X.baddbmm_(YT, Y.mT @ X, alpha=-1)


def swap_stack_(X, swaps):
    """compress.swap_entries of every matrix of a stack X (L, m, n) of row-major matrices, in
    place."""
    if swaps is not None:
        a, b = swaps
        flat = X.view(X.shape[0], -1)           # (L, m n): each matrix's entries in a row
        flat[:, a], flat[:, b] = flat[:, b], flat[:, a]     # (both read before either is written)


def rotate_stack_(layer, X, bases, inverse=False):
    """layer.encode (inverse: decode) of each matrix of X (L, m, n), written into X - a stack
    the caller made, of row-major matrices - and returned; `bases` as with_products gives them;
    `layer`: any layer of the stack (they share the shape, and so the core's swaps).
    compress.encode_geo and decode_geo batched: the same products of the same operands in the
    same memory order (the column side on X's transposed view, as compress's apply_t(H.T).T
    reads it)."""
    if any(b is not None and len(b) != 4 for b in bases):
        raise ValueError("rotate_stack takes with_products(stack_bases(...)): (Y, T, Y T^T, Y T)")
    if len(X) and not X[0].is_contiguous():     # (the stack itself may be padded between them)
        raise ValueError("rotate_stack_ writes into a stack of row-major matrices: pass "
                         "torch.stack's")
    left, right = bases
    swaps = layer.swaps_for(bases)              # both sides rotate: the core is scattered
    if inverse:                                 # G = P H Q^T
        swap_stack_(X, swaps)
        if right is not None:
            subtract_product_(X.mT, right[0], right[3])     # H Q^T = (Q H^T)^T
        if left is not None:
            subtract_product_(X, left[0], left[3])
    else:                                       # H = P^T G Q
        if left is not None:
            subtract_product_(X, left[0], left[2])
        if right is not None:
            subtract_product_(X.mT, right[0], right[2])     # G Q = (Q^T G^T)^T
        swap_stack_(X, swaps)
    return X


def rotate_stack(layer, X, bases, inverse=False):
    """rotate_stack_ on a copy: X stays as it was."""
    return rotate_stack_(layer, X.clone(memory_format=torch.contiguous_format), bases, inverse)


class StackedBases:
    """The stacked bases of each group of matrices rotated together, kept while the group and
    its bases stay the same tensors, unchanged (a refresh makes new ones; rank agreement's repair
    writes into them, which bumps their version): stacking them at every step would copy them at
    every step. One entry per run of matrices stacked (of one rotation_key, in one bucket)."""

    def __init__(self):
        self.kept = {}          # key -> ([(basis tensor, its version)] in order, the stacks)

    def of(self, key, transforms):
        sources = [(t, t._version) for transform in transforms for b in transform
                   if b is not None for t in (b.Y, b.T)]
        kept = self.kept.get(key)
        if kept is None or len(kept[0]) != len(sources) or any(
                a is not b or u != v for (a, u), (b, v) in zip(kept[0], sources)):
            kept = self.kept[key] = (sources, with_products(stack_bases(transforms)))
        return kept[1]


def rotation_key(layer):
    """Matrices rotated together: same shape (so the same r and core swaps), same sides."""
    return layer.shape, sides_of(layer.transform)


# -- the codec's round trip of a stack ----------------------------------------------------------

def round_trip_stack(X, fmt, block):
    """compress.dequantize(compress.quantize(x, fmt, block)) of every matrix x of X (L, m, n),
    bit for bit, in one codec call: X is viewed so that the codec's scale groups are each
    matrix's own - an integer block: each matrix zero-padded to whole groups, as quantize pads
    it; "row": the rows; "tensor": one group per matrix; NVFP4: each matrix's tensor scale."""
    L, m, n = X.shape
    flat = X.reshape(L, m * n)
    if fmt == "nvfp4":
        return nvfp4_round_trip_stack(flat).view(L, m, n)
    if block == "tensor":
        grouped, by = flat, "row"                       # (L, m n): a group per matrix
    elif block == "row":
        grouped, by = X.reshape(L * m, n), "row"
    else:
        padding = -(m * n) % block
        grouped, by = torch.nn.functional.pad(flat, (0, padding)), block    # (L, whole groups)
    back = compress.dequantize(compress.quantize(grouped, fmt, by))
    return back.view(L, -1)[:, : m * n].reshape(L, m, n)


def nvfp4_round_trip_stack(flat):
    """The NVFP4 round trip of each row of flat (L, k): compress.nvfp4_wire's encode and
    compress.dequantize's decode, with each matrix's own tensor scale."""
    L, k = flat.shape
    padded = torch.nn.functional.pad(flat, (0, -k % compress.NVFP4_BLOCK))
    blocks = padded.reshape(-1, compress.NVFP4_BLOCK)                       # (L G, 16)
    amax = blocks.abs().amax(dim=1)
    scale = compress.nvfp4_tensor_scale(amax.view(L, -1).amax(dim=1))       # (L,)
    scale = scale[:, None].expand(L, amax.numel() // L).reshape(-1)         # (L G,)
    block_scale, nibbles = compress.nvfp4_encode(blocks, amax, scale)
    values = compress.nvfp4_decode(block_scale, nibbles, scale)
    return values.view(L, -1)[:, :k]


# -- the refresh --------------------------------------------------------------------------------

def refresh_key(layer, statistics):
    """Layers whose new geometry is built together (None: one by one) - the rotation's: one
    shape, all cold (no bases yet) or all warm; the low-rank whitening's: one shape, the same
    sides refreshed, each with a factor in use or none."""
    if stackable(layer):
        return "subspace", layer.shape, layer.left_basis is None
    if whitening_stackable(layer):
        sides = tuple(sorted(statistics))
        return "whitening", layer.shape, sides, tuple(side in layer.factors for side in sides)
    return None


def refresh_group(layers, statistics):
    """layer.refresh(statistics) of each of `layers` (one refresh_key), together."""
    if stackable(layers[0]):
        refresh_stack(layers, statistics)
    else:
        whiten_stack(layers, statistics)


def refresh_stack(layers, means):
    """refresh_stacks of one stack."""
    refresh_stacks([(layers, means)])


def complete_together(stacks):
    """compress.HouseholderBasis.complete of every matrix of `stacks` [(L, m, r)], as (Y, T)
    stacked per stack: the LU of every r x r top block of one r in one mapped call (its r steps
    launched once a refresh for each r, not once a shape), then the reflectors of every stack of
    one shape in one."""
    LR = map_together(compress.lu_with_signs, [U[:, :U.shape[2]] for U in stacks])
    return map_together(reflectors, stacks, LR)


def reflectors(U, LR):
    """compress.HouseholderBasis.from_lu of one matrix, as the tensors (Y, T) vmap maps."""
    basis = compress.HouseholderBasis.from_lu(U, LR)
    return basis.Y, basis.T


def columns_stack(Y, T):
    """HouseholderBasis.columns() of each stacked basis: (L, m, r)."""
    return torch.vmap(lambda y, t: compress.HouseholderBasis(y, t).columns())(Y, T)


def refresh_stacks(stacks):
    """ProductionSubspaceLayer.refresh(mean) of every layer of `stacks`, [(layers, means)] each
    stackable and of one refresh_key: nanogeo.geometry.rows' subspace iteration (its warm start,
    or its seeded cold start) mapped over each stack, the orthonormal bases of every stack of
    one shape made in one call a round (iterate_stacks), then ONE SVD for the r x r cores of
    every stack of one r (on a GPU each SVD call waits for the host twice: once a refresh, not
    once a stack), then each stack's alignment and core energy, and compress.py's Householder
    completion of every basis (complete_together). A stack of gradients is a copy, made again
    for each phase, so that only one is held at a time; the bases (m x r each) of every stack
    are held together for the completion."""
    iterated = iterate_stacks(stacks)
    by_rank = {}
    for k, (*_, core) in enumerate(iterated):
        by_rank.setdefault(core.shape[-1], []).append(k)
    aligned = {}
    for ks in by_rank.values():         # the cores of every stack of one r: (sum of L, r, r)
        a, _, bh = torch.linalg.svd(torch.cat([iterated[k][-1] for k in ks]))
        sizes = [iterated[k][-1].shape[0] for k in ks]
        aligned.update(zip(ks, zip(a.split(sizes), bh.split(sizes))))
    finished = []                                                      # [(U, V, energies)]
    for k, (layers, means) in enumerate(stacks):
        finished.append(align_stack(layers, torch.stack(means), *iterated[k][:4], *aligned[k]))
        iterated[k] = None                     # (the bases before alignment: held no longer)
    bases = complete_together([U for U, *_ in finished] + [V for _, V, *_ in finished])
    for (layers, means), (_, _, *energies), left, right in zip(
            stacks, finished, bases, bases[len(stacks):]):
        settle_stack(layers, left, right, *energies, means[0].device)


def iterate_stacks(stacks):
    """The first half of every stack's refresh: [(U, V, left energies, right energies, cores)],
    rows.iterate_subspaces_rows mapped over each stack phase by phase, so that each round's
    orthonormal bases - U's and V's - of every stack of one shape are made in one call
    (orthonormal_together: llama-600m's 3776 x 1408 matrices are one a stack, and a call a
    stack would be ~170 a refresh). A stack is made again in each phase, one held at a time: a
    refresh copies each gradient iters + 2 times with align_stack's copy, a cold one 7 + 1."""
    stacked = lambda k: torch.stack(stacks[k][1])                       # (L, m, n)
    states = start_stacks(stacks)                   # [[U, V, left e., right e., decay, rounds]]

    def per_stack(f, k):
        return torch.vmap(functools.partial(f, decay=states[k][4], rows=UNSHARDED))
    core = torch.vmap(functools.partial(row_blocks.core_rows, rows=UNSHARDED))
    cores = {k: core(stacked(k), *state[:2]) for k, state in enumerate(states) if state[5] <= 0}
    pending = {k: per_stack(row_blocks.subspace_products_rows, k)(stacked(k), *state[:4])
               for k, state in enumerate(states) if state[5] > 0}
    round_ = 0
    while pending:
        round_ += 1
        bases = orthonormal_together([A for A, _ in pending.values()]
                                     + [B for _, B in pending.values()])
        later = {}
        for k, U_new, V_new in zip(pending, bases, bases[len(pending):]):
            G, (U, V, left_energy, right_energy, _, rounds) = stacked(k), states[k]
            states[k][:4] = U_new, V_new, *per_stack(row_blocks.subspace_energies_rows, k)(
                G, U, V, U_new, V_new, left_energy, right_energy)
            if rounds > round_:         # this copy serves the next round's products too
                later[k] = per_stack(row_blocks.subspace_products_rows, k)(G, *states[k][:4])
            else:
                cores[k] = core(G, U_new, V_new)
            del G                       # (before the next stack is made)
        pending = later
    return [(*state[:4], cores[k]) for k, state in enumerate(states)]


def start_stacks(stacks):
    """Each stack's iteration start, [U, V, left energies, right energies, decay, rounds]: warm,
    the bases in use; cold, each matrix's own seeded range finder (rows.range_finder_start),
    its two bases made for every cold stack of one shape together."""
    states, cold = [], []
    for k, (layers, means) in enumerate(stacks):
        first = layers[0]
        if first.left_basis is None:
            cold.append(k)
            states.append([None, None, None, None, 0.0, 4])
            continue
        left, right = stack_bases([(layer.left_basis, layer.right_basis) for layer in layers])
        states.append([columns_stack(*left), columns_stack(*right),
                       torch.stack([layer.left_energy for layer in layers]),
                       torch.stack([layer.right_energy for layer in layers]),
                       first.opts.decay, first.opts.iters])
    left = torch.vmap(functools.partial(row_blocks.left_range_rows, rows=UNSHARDED))
    right = torch.vmap(functools.partial(row_blocks.right_range_rows, rows=UNSHARDED))
    U = orthonormal_together([left(torch.stack(stacks[k][1]), seeded_start(*stacks[k]))
                              for k in cold])
    V = orthonormal_together([right(torch.stack(stacks[k][1]), u) for k, u in zip(cold, U)])
    for k, u, v in zip(cold, U, V):
        zeros = u.new_zeros(u.shape[0], u.shape[2])
        states[k][:4] = u, v, zeros, zeros
    return states


def seeded_start(layers, means):
    """Each matrix's own seeded random start omega, stacked (L, n, r)."""
    return torch.stack([row_blocks.seeded_directions(means[0].shape[1], layer.r, layer.seed,
                                                     means[0].device, means[0].dtype)
                        for layer in layers])


def map_together(f, stacks, *more):
    """f (matrices -> a tensor, or a tuple of them) of every matrix of `stacks` [(L, ...)] (and
    the matching matrices of each list in `more`), the stacks of one shape, dtype and device
    concatenated into one mapped call (batched kernels: a few launches however many matrices),
    split back per stack. On the CPU with one thread a matrix's bits do not depend on which
    stacks share its call; a GPU's batched kernels may pick another algorithm by batch size
    (every rank still gets the same bits: the stacks are alike on every rank)."""
    out, by_kind = [None] * len(stacks), {}
    for k, X in enumerate(stacks):
        by_kind.setdefault((tuple(X.shape[1:]), X.dtype, X.device), []).append(k)
    for ks in by_kind.values():
        found = torch.vmap(f)(*(torch.cat([args[k] for k in ks]) for args in (stacks, *more)))
        sizes = [stacks[k].shape[0] for k in ks]
        parts = zip(*(t.split(sizes) for t in found)) if isinstance(found, tuple) else \
            found.split(sizes)
        for k, part in zip(ks, parts):
            out[k] = part
    return out


def orthonormal_together(stacks):
    """compress.orthonormal of every matrix of `stacks` [(L, d, r)] (map_together: a batched
    Cholesky and triangular solve per shape)."""
    return map_together(compress.orthonormal, stacks)


def align_stack(layers, G, U, V, left_energy, right_energy, a, bh):
    """After the iteration: the bases aligned by their cores' SVD (a, bh), and the core energy:
    (U, V, left energies, right energies, core energies), stacked."""
    first = layers[0]
    decay = 0.0 if first.left_basis is None else first.opts.decay
    align = functools.partial(row_blocks.align_subspaces_rows, decay=decay, rows=UNSHARDED)
    U, V, left_energy, right_energy = torch.vmap(align)(G, U, V, left_energy, right_energy, a, bh)
    energy = torch.vmap(functools.partial(row_blocks.core_energy, rows=UNSHARDED))(G, U, V)
    return U, V, left_energy, right_energy, energy


def settle_stack(layers, left, right, left_energy, right_energy, energy, device):
    """The completed bases ((Y, T) of each side, stacked) and energies written into the layers."""
    for layer, Yl, Tl, Yr, Tr, el, er, e in zip(layers, *(t.unbind() for t in (
            *left, *right, left_energy, right_energy, energy))):
        layer.left_energy, layer.right_energy, layer.energy = el, er, e
        layer.use_bases((Yl, Tl), (Yr, Tr), device)


def whitening_stackable(layer):
    """Can this whitened layer's factors be built together with others: the low-rank kind?"""
    return type(layer) is ProductionWhitenedLayer and layer.opts.whiten_factor == "lowrank"


def whiten_stack(layers, moments):
    """ProductionWhitenedLayer.refresh(moments) of each of `layers` (whitening_stackable, one
    refresh_key): each layer's EMA of its moments, then per side the low-rank factors of all
    of them in one mapped call of factor_of_kind - one eigendecomposition (or one subspace
    iteration and Rayleigh-Ritz eigh) and one SVD per side and group."""
    for layer, found in zip(layers, moments):
        layer.smooth(found)
    for side in moments[0]:
        factors = factors_stack(torch.stack([layer.moments[side] for layer in layers]),
                                [layer.factors.get(side) for layer in layers], layers[0].opts)
        for layer, factor in zip(layers, factors):
            layer.factors[side] = factor


def factors_stack(A, olds, opts):
    """layers.factor_of_kind(A[i], "lowrank", ..., old=olds[i]) of each moment of A (L, d, d),
    as ProductionWhitenedLayer.factor_of builds it (olds: the factors in use, all or none
    None): one mapped call. Returns [compress.Whitening]."""
    old = [] if olds[0] is None else [torch.stack([getattr(f, k) for f in olds])
                                      for k in LOWRANK_TENSORS]

    def one(a, *previous):
        factor = factor_of_kind(
            a, "lowrank", opts.whiten_rank, opts.whiten_block, opts.damping,
            solver=whiten_solver(opts),
            old=compress.Whitening("lowrank", a.shape[0], *previous) if previous else None)
        return tuple(getattr(factor, k) for k in LOWRANK_TENSORS)
    # randomness="same": the subspace iteration's seeded random start (compress.random_start,
    # made once per width) is one draw for the whole stack, as it is for every layer alone
    out = torch.vmap(one, randomness="same")(A, *old)
    return [compress.Whitening("lowrank", A.shape[1], *tensors)
            for tensors in zip(*(t.unbind() for t in out))]


# -- the gain check's measurements --------------------------------------------------------------

def view_key(view):
    """Matrices judged together: the same optimizer view kind, param group (its settings) and
    state entries (None: plain L2)."""
    if view is None:
        return None
    return view.kind, id(view.hyper), tuple(sorted(view.read_state()))


def seen_stack(views, means, workers):
    """deltas [(L, m, n), ...] -> (L, len(deltas)): each error's squared size as each matrix's
    optimizer sees it (update_error.UpdateError from its view, or L2 without one), the views of
    one view_key mapped over the stack."""
    view = views[0]
    hyper = view.hyper if view is not None else None
    state = {} if view is None else {
        key: torch.stack([v.read_state()[key] for v in views])
        for key in view.read_state()}

    def one(mean, state, deltas):
        seen = UpdateError(None if view is None else OptimizerView(
            view.kind, lambda: hyper, lambda: state), mean, None, workers)
        return torch.stack([seen(d) for d in deltas])
    return lambda deltas: torch.vmap(one)(means, state, tuple(deltas))


def codec_errors(layers, means, grads, views, auto_sides, round_trip, workers):
    """compress.Communicator.measure's errors for matrices of one shape, before the sum over
    workers: (L, W, K) - per matrix and worker (grads[w]: (L, m, n)), the error its optimizer
    sees of the Euclidean round trip, then of the round trip in each rotation (auto_sides: both
    sides, then the right alone; else the layer's own)."""
    if auto_sides:
        left, right = with_products(stack_bases([layer.rotation("both") for layer in layers]))
        rotations = [(left, right), (None, right)]
    else:
        rotations = [with_products(stack_bases([layer.transform for layer in layers]))]
    deltas = []
    for G in grads:
        deltas.append(round_trip(G) - G)
        for bases in rotations:
            coords = round_trip(rotate_stack(layers[0], G, bases))     # (a new tensor)
            deltas.append(rotate_stack_(layers[0], coords, bases, inverse=True) - G)
    errors = seen_stack(views, means, workers)(deltas)                   # (L, W K)
    return errors.view(len(layers), len(grads), -1)
