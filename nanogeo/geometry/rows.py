"""
The subspace rotation on row blocks: FSDP's dim-0 shards, where each rank holds only a block of
rows of every gradient and of its mean.

compress.py estimates the rotation's bases from the whole decoded mean (DDP: every rank holds
it). Under FSDP the same algebra runs on row blocks with two kinds of collectives: partial
products summed over the ranks (G^T U = sum_j G_j^T U_j, an n x r all-reduce) and m x r results
gathered whole (RowBlocks). The bases U and V are always held whole, so every rank completes the
same Householder bases. The decode of a rank's rows needs one small r x n all-reduce
(decode_geo_rows), and core scattering a few values exchanged across blocks
(swap_entries_rows).
nanogeo.geometry.layers.ProductionSubspaceLayer always uses the row forms (with RowBlocks(), whose
methods are the identity, when a rank holds every row).
"""
import torch
import torch.distributed as dist

import compress
from nanogeo.wire.packing import from_host, on_device


class RowBlocks:
    """Where the rows of a gradient G (m x n) live while its geometry is estimated.

    Under DDP (train.py) every rank holds all of G: RowBlocks() (or one over a single rank),
    whose methods are the identity. Under FSDP each rank holds only a block of rows: rank j has
    rows [j c, (j + 1) c) of G, with
    c = ceil(m / W) (FSDP's dim-0 sharding). The subspace iteration is then the same algebra with
    two collectives: `sum` adds the rank's partial products (G^T U = sum_j G_j^T U_j is an n x r
    all-reduce) and `gather` assembles an m x r matrix from its row blocks. Bases (U, V) are
    always held whole, so every rank completes the same Householder basis from them."""

    def __init__(self, m=None, group=None):
        self.sharded = m is not None and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = group
        if self.sharded:
            world, me = dist.get_world_size(group), dist.get_rank(group)
            self.m, self.per_rank = m, -(-m // world)
            self.start, self.end = min(m, me * self.per_rank), min(m, (me + 1) * self.per_rank)

    def local(self, X):
        """This rank's rows of a whole m x k matrix."""
        return X[self.start: self.end] if self.sharded else X

    def sum(self, x):
        """The sum over ranks of a partial product (all ranks get the same result)."""
        return self.sum_all([x])[0]

    def sum_all(self, parts):
        """sum() of several partial products (any shapes) with one all-reduce."""
        if not self.sharded:
            return parts
        flat = torch.cat([p.reshape(-1) for p in parts])
        dist.all_reduce(flat, group=self.group)
        return [f.view(p.shape) for f, p in zip(flat.split([p.numel() for p in parts]), parts)]

    def gather(self, X_rows):
        """The whole m x k matrix from every rank's block of rows."""
        if not self.sharded:
            return X_rows
        padded = X_rows.new_zeros(self.per_rank, X_rows.shape[1])
        padded[: X_rows.shape[0]] = X_rows
        blocks = [torch.empty_like(padded) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(blocks, padded, group=self.group)
        return torch.cat(blocks)[: self.m]


def decode_geo_rows(matrices):
    """decode_geo when each rank holds only a block of rows of H (FSDP; see RowBlocks), for
    Householder bases. `matrices` is a list of (H_rows, left, right, rows), typically all of one
    FSDP module's rotated matrices. The right side acts on each row alone: K = H Q^T row by row.
    The left side mixes rows only through r directions: (P K)_j = K_j - (Y_j T)(Y^T K), and
    Y^T K (r x n) is the sum over ranks of Y_j^T K_j: r n numbers against the m n / W of the
    block, summed for all the matrices in one all-reduce. Returns each matrix's rows of G."""
    Ks = [right.apply(H.T).T if right is not None else H for H, _, right, _ in matrices]
    lefts = [(k, rows.local(left.Y), left.T) for k, (_, left, _, rows) in enumerate(matrices)
             if left is not None]                                  # Y_j: (rows here, r)
    if lefts:
        rows = matrices[0][3]
        totals = rows.sum_all([Y.T @ Ks[k] for k, Y, _ in lefts])  # Y^T K of each, (r, n)
        for (k, Y, T), YtK in zip(lefts, totals):
            Ks[k] = torch.addmm(Ks[k], Y @ T, YtK, alpha=-1)    # compress's P X
    return Ks


def swap_entries_rows(matrices):
    """swap_entries on this rank's block of rows of H (FSDP; see RowBlocks), for a list of
    (H_rows, swaps, rows). A pair may join two blocks (core entries sit in the first rows,
    their partners in the last), so every rank contributes the values at the swapped positions
    it holds, one all-reduce (2 s numbers per matrix, all matrices at once) shares them, and
    every rank writes each of its positions' partner value."""
    out, writes, contributions, group_rows = [], [], [], None
    for H_rows, swaps, rows in matrices:
        if swaps is None or not rows.sharded:
            out.append(compress.swap_entries(H_rows, swaps))
            continue
        # index tensors, not boolean masks: a masked select has a data-dependent size, which
        # stops the host (a nonzero) inside FSDP's reduce-scatter on a GPU
        n = H_rows.numel()
        first = rows.start * H_rows.shape[1]                # flat index of this block's start
        positions = torch.cat(on_device(swaps, H_rows.device))  # (2 s,): all a's, then all b's
        held = (positions >= first) & (positions < first + n)
        local = torch.where(held, positions - first, n)     # held here: its index; else a spare
        flat = torch.cat([H_rows.reshape(-1), H_rows.new_zeros(1)])   # (n + 1,): the spare last
        values = torch.where(held, flat[local], 0)          # the swapped values held here
        out.append(flat[:n].view(H_rows.shape))
        writes.append((flat, local))
        contributions.append(values)
        group_rows = rows
    if writes:
        for (flat, local), values in zip(writes, group_rows.sum_all(contributions)):
            partner = values.roll(values.numel() // 2)      # a_k <-> b_k
            flat.index_copy_(0, local, partner)             # (what lands on the spare is unused)
    return out


def update_subspaces_rows(G, U, V, left_energy, right_energy, decay, iters, rows):
    """compress.update_subspaces with two additions. An EMA of the covariances across refreshes
    (decay > 0: C = decay U diag(e) U^T + (1 - decay) G G^T, kept as the bases and their energies
    e; decay = 0 is compress.py's iteration, number for number). And G may be this rank's block
    of rows of the mean (FSDP): every product that runs over the rows is summed over the ranks
    (rows.sum), every m x r result gathered whole before it is orthonormalised (rows.gather), and
    this rank's rows of a whole m x r matrix are rows.local(U). Returns (U, V, left_energy,
    right_energy), the same on every rank. Its two halves apart (iterate_subspaces_rows, then
    the core's SVD, then align_subspaces_rows) let a refresh make one SVD for every matrix."""
    U, V, left_energy, right_energy, core = iterate_subspaces_rows(
        G, U, V, left_energy, right_energy, decay, iters, rows)
    a, _, bh = torch.linalg.svd(core)                                 # r x r: negligible cost
    return align_subspaces_rows(G, U, V, left_energy, right_energy, a, bh, decay, rows)


def iterate_subspaces_rows(G, U, V, left_energy, right_energy, decay, iters, rows):
    """update_subspaces_rows up to its SVD: (U, V, left_energy, right_energy, the r x r core
    U^T G V whose singular vectors align the bases). Each iteration in its three phases: the
    products, their orthonormal bases, the energies (batched.iterate_stacks runs the middle one
    for every stack at once)."""
    for _ in range(iters):
        A, B = subspace_products_rows(G, U, V, left_energy, right_energy, decay, rows)
        U_new, V_new = compress.orthonormal(A), compress.orthonormal(B)
        left_energy, right_energy = subspace_energies_rows(G, U, V, U_new, V_new, left_energy,
                                                           right_energy, decay, rows)
        U, V = U_new, V_new
    return U, V, left_energy, right_energy, core_rows(G, U, V, rows)


def subspace_products_rows(G, U, V, left_energy, right_energy, decay, rows):
    """One iteration's products, to be orthonormalised: the whole G G^T U (m, r) and G^T G V
    (n, r), with the covariance EMA's terms (decay > 0)."""
    A = (1 - decay) * (G @ rows.sum(G.T @ rows.local(U)))          # rows of G G^T U
    B = (1 - decay) * rows.sum(G.T @ (G @ V))                     # G^T G V
    if decay > 0:
        A = A + decay * rows.local(U) * left_energy
        B = B + decay * V * right_energy
    return rows.gather(A), B


def subspace_energies_rows(G, U, V, U_new, V_new, left_energy, right_energy, decay, rows):
    """The energies of the new bases' directions (U, V: the old bases; the EMA's part moves
    along with them)."""
    left_energy = ((1 - decay) * rows.sum(G.T @ rows.local(U_new)).pow(2).sum(0)
                   + decay * ((U.T @ U_new).pow(2) * left_energy[:, None]).sum(0))
    right_energy = ((1 - decay) * rows.sum((G @ V_new).pow(2).sum(0))
                    + decay * ((V.T @ V_new).pow(2) * right_energy[:, None]).sum(0))
    return left_energy, right_energy


def core_rows(G, U, V, rows):
    """The r x r core U^T G V (summed over the ranks)."""
    return rows.sum(rows.local(U).T @ G @ V)


def align_subspaces_rows(G, U, V, left_energy, right_energy, a, bh, decay, rows):
    """update_subspaces_rows after its SVD (a, bh: the core's singular vectors): the bases
    rotated so that the core is diagonal, and their energies."""
    U, V = U @ a, V @ bh.T
    left_energy = ((1 - decay) * rows.sum(G.T @ rows.local(U)).pow(2).sum(0)
                   + decay * left_energy.sort(descending=True).values)
    right_energy = ((1 - decay) * rows.sum((G @ V).pow(2).sum(0))
                    + decay * right_energy.sort(descending=True).values)
    return U, V, left_energy, right_energy


def initial_subspaces_rows(G, r, seed, rows, iters=4):
    """compress.initial_subspaces in the row form (this rank's rows under FSDP): the same seeded
    range finder. Returns (U, V, left_energy, right_energy)."""
    return range_finder_rows(G, seeded_directions(G.shape[1], r, seed, G.device, G.dtype), rows,
                             iters)


def seeded_directions(n, r, seed, device, dtype=torch.float32):
    """compress.initial_subspaces' random start omega (n, r), seeded alike on every rank."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return from_host(torch.randn(n, r, generator=generator), device, dtype)   # drawn on the CPU


def range_finder_rows(G, omega, rows, iters=4):
    """initial_subspaces_rows from its random start omega (n, r)."""
    return update_subspaces_rows(G, *range_finder_start(G, omega, rows), 0.0, iters, rows)


def range_finder_start(G, omega, rows):
    """The cold start of the range finder: (U, V, zero energies) from omega (n, r). In two
    phases, each product then its orthonormal basis (batched.start_stacks runs each basis of
    every stack at once)."""
    U = compress.orthonormal(left_range_rows(G, omega, rows))
    V = compress.orthonormal(right_range_rows(G, U, rows))
    zeros = torch.zeros(omega.shape[1], device=G.device, dtype=G.dtype)
    return U, V, zeros, zeros


def left_range_rows(G, omega, rows):
    """The whole G omega (m, r), whose basis is the first U."""
    return rows.gather(G @ omega)


def right_range_rows(G, U, rows):
    """G^T U (n, r), whose basis is the first V."""
    return rows.sum(G.T @ rows.local(U))


def core_energy(G, U, V, rows):
    """The fraction of G's energy in the r x r core U^T G V (G: this rank's rows; summed over
    the ranks), on the device."""
    total = rows.sum(G.pow(2).sum())
    core = rows.sum(rows.local(U).T @ G @ V).pow(2).sum()       # sum over ranks, then square
    return core / total.clamp(min=1e-30)
