"""
The coordinate layers as production runs them (nanogeo.parallel.communicator makes these):

  * compress.py's two - SubspaceLayer, WhitenedLayer - and the Hadamard control
    (nanogeo.geometry.hadamard), with what rank agreement, the broadcast, checkpoints, FSDP and
    the layer table need of them: tensors(), flags() / load_flags() (the decisions as numbers),
    state_dict() / load_state_dict(), row_local, r, sides; the rotation estimated in
    nanogeo.geometry.rows' form (FSDP's row blocks, an optional EMA of the covariances; on a whole
    matrix without the EMA, compress.py's iteration number for number) and its core energy;

  * the ablations: whitening factors other than the low-rank one compress.py applies in O(d r) per row -
    "lowrank-dense": the same low-rank + diagonal A^ with a dense Cholesky factor and a
    triangular solve (what the published artifact does; its factor EMA, factor_decay, applies to
    it), "full": A itself, "diag": A's diagonal, "block": A's diagonal blocks;
  * dense bases for the subspace rotation - exact singular bases (full=True) and a random
    rotation (basis="random"): DenseSubspaceLayer, a compress.SubspaceLayer whose rotation() uses
    dense m x m and n x n matrices.

The dense kinds exist to measure what the low-rank approximations and the Householder completion
cost or gain (BENCHMARKS.md sections 11-12, nanogeo.lab.tables); training uses the low-rank
whitening and the Householder rotation.
"""
import zlib
from dataclasses import dataclass, field

import torch

import compress
from nanogeo import RenamedAttribute
from nanogeo.geometry import rows as row_blocks
from nanogeo.geometry.hadamard import HadamardLayer
from nanogeo.wire.packing import from_host


@dataclass
class DenseFactor:
    """One side's factor F (F F^T = A^ + damping I) of a kind other than "lowrank":
    full / lowrank-dense: L (d, d) lower triangular (Cholesky); block: L (nb, b, b), one Cholesky
    factor per diagonal block; diag: sqrt_d (d,). Same methods as compress.Whitening."""
    kind: str
    size: int                   # d
    L: torch.Tensor = None
    sqrt_d: torch.Tensor = None

    def whiten(self, X):
        """X F^-T for X (m, d): every row of X to whitened coordinates."""
        if self.kind == "diag":
            return X / self.sqrt_d
        if self.kind == "block":
            out = torch.linalg.solve_triangular(self.L.transpose(1, 2), self._blocks(X),
                                                upper=True, left=False)
            return self._unblocks(out, X)
        return torch.linalg.solve_triangular(self.L.T, X, upper=True, left=False)

    def unwhiten(self, X):
        """X F^T for X (m, d): back to the original coordinates."""
        if self.kind == "diag":
            return X * self.sqrt_d
        if self.kind == "block":
            return self._unblocks(self._blocks(X) @ self.L.transpose(1, 2), X)
        return X @ self.L.T

    def _blocks(self, X):
        """(m, d) -> (nb, m, b), zero-padding d up to nb * b."""
        nb, b, _ = self.L.shape
        X = torch.nn.functional.pad(X, (0, nb * b - X.shape[1]))
        return X.view(X.shape[0], nb, b).transpose(0, 1)

    def _unblocks(self, blocks, like):
        return blocks.transpose(0, 1).reshape(like.shape[0], -1)[:, : like.shape[1]]

    def dense(self):
        """F as a dense (d, d) matrix."""
        if self.kind == "diag":
            return torch.diag(self.sqrt_d)
        if self.kind == "block":
            return torch.block_diag(*self.L)[: self.size, : self.size]
        return self.L

    def tensors(self):
        return {k: v for k, v in (("L", self.L), ("sqrt_d", self.sqrt_d)) if v is not None}

    def blended(self, old, decay):
        """The published factor smoothing, F <- decay F_old + (1 - decay) F_new (a blend of two
        triangular factors is still one)."""
        if old is None or decay == 0 or old.kind != self.kind:
            return self
        return DenseFactor(self.kind, self.size, **{k: decay * getattr(old, k) + (1 - decay) * v
                                                    for k, v in self.tensors().items()})


WHITEN_FACTORS = ("lowrank", "lowrank-dense", "full", "diag", "block")


WHITEN_SOLVERS = ("auto", "subspace", "eigh")   # the top-r eigenpairs: compress.py's subspace
                                        # iteration or its full eigh (compress.whitening_factor)


def whiten_solver(opts):
    """The eigensolver a whitened layer's factor is built with: opts.whiten_solver, with "auto"
    the fast subspace iteration only where the gain check measures every factor before it is used
    (select="gain"); where layers are used unmeasured (a list, "fragile", "all") the exact eigh."""
    if opts.whiten_solver != "auto":
        return opts.whiten_solver
    return compress.eigensolver_for(opts)


def factor_of_kind(A, kind="lowrank", r=32, block=64, damping=1e-3, floor=1e-3,
                   solver="eigh", old=None):
    """compress.whitening_factor for every kind of WHITEN_FACTORS: the dense ones computed in
    float64 from the symmetrized A and returned in A's dtype. solver="subspace": the low-rank
    factor's eigenpairs by subspace iteration, warm-started from `old`, the factor in use."""
    if kind not in WHITEN_FACTORS:
        raise ValueError(f"unknown whitening factor {kind!r}; choose one of {', '.join(WHITEN_FACTORS)}")
    if kind == "lowrank":
        return compress.whitening_factor(A, r, damping, floor, solver=solver, old=old)
    dtype = A.dtype
    A = (A.double() + A.double().T) / 2
    factor = dense_factor(A, kind, min(r, A.shape[0]), block, damping, floor)
    return DenseFactor(factor.kind, factor.size,
                       **{k: v.to(dtype) for k, v in factor.tensors().items()})


LOWRANK_TENSORS = ("sqrt_d", "directions", "up", "down")     # compress.Whitening's


def factor_tensors(factor):
    """{name: tensor} of a factor of any kind (compress.Whitening or DenseFactor)."""
    if isinstance(factor, DenseFactor):
        return factor.tensors()
    return {k: getattr(factor, k) for k in LOWRANK_TENSORS}


def load_factor(state):
    """A factor from its {"kind", "size", tensors...} (a whitened layer's state_dict; a low-rank
    factor saved before its Q was named `directions` loads too)."""
    if state["kind"] != "lowrank":
        return DenseFactor(**state)
    state = dict(state)
    if "Q" in state:
        state["directions"] = state.pop("Q")
    return compress.Whitening(**state)


def cholesky(M):
    """The Cholesky factor of M (or of each of a stack), without the host check of
    torch.linalg.cholesky (on a GPU it waits for the device to report success): cholesky_ex,
    and a factor that failed is NaN - its layer's gain is then NaN, never taken, and a forced
    layer's NaN mean is skipped. (M is a damped second moment in float64: positive definite.)"""
    L, info = torch.linalg.cholesky_ex(M)
    return torch.where((info == 0)[..., None, None], L, torch.nan)


def dense_factor(A, kind, r, block, damping, floor):
    d = A.shape[0]
    eye = torch.eye(d, dtype=A.dtype, device=A.device)
    if kind == "full":
        return DenseFactor(kind, d, L=cholesky(A + damping * eye))
    if kind == "diag":
        return DenseFactor(kind, d, sqrt_d=(A.diagonal().clamp(min=0) + damping).sqrt())
    if kind == "block":
        nb = -(-d // block)
        padded = torch.eye(nb * block, dtype=A.dtype, device=A.device)  # identity on the padding
        padded[:d, :d] = A
        blocks = torch.stack([padded[i * block:(i + 1) * block, i * block:(i + 1) * block]
                              for i in range(nb)])
        damp = damping * torch.eye(block, dtype=A.dtype, device=A.device)
        return DenseFactor(kind, d, L=cholesky(blocks + damp))
    U, lam, rest = compress.top_eigenpairs(A, r, floor)                # "lowrank-dense"
    A_hat = (U * lam) @ U.T + torch.diag(rest)
    return DenseFactor(kind, d, L=cholesky(A_hat + damping * eye))


def exact_bases(G):
    """full=True: the complete singular bases of G, dense."""
    U, _, Vh = torch.linalg.svd(G)
    return U, Vh.T


def random_orthogonal(n, seed, device, dtype=torch.float32):
    """basis="random": a dense random rotation, seeded identically on every rank."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return compress.orthonormal(torch.randn(n, n, generator=generator, dtype=torch.float64)).to(device, dtype)


@dataclass
class DenseBasis:
    """A dense orthogonal matrix M with compress.HouseholderBasis's methods."""
    M: torch.Tensor

    def apply_t(self, X):
        """M^T X."""
        return self.M.T @ X

    def apply(self, X):
        """M X."""
        return self.M @ X


class JudgedLayer:
    """flags() / load_flags() of a layer whose one decision is whether to use its coordinates."""

    def flags(self):
        return [float(self.use_geo), 0.0, self.gain]

    def load_flags(self, flags):
        self.use_geo, self.gain = bool(flags[0]), flags[2]


UNSHARDED = row_blocks.RowBlocks()      # every rank holds every row (DDP, train.py)


def swaps_on(swaps, device):
    """compress.core_swaps' index pair (made on the host) on `device`: on a GPU both in one
    pinned, non_blocking copy (packing.from_host), as a stacked (2, s) tensor."""
    if swaps is None:
        return None
    if swaps[0].is_cpu and torch.device(device).type == "cuda":
        return tuple(from_host(torch.stack(swaps), device).unbind())
    return tuple(t.to(device) for t in swaps)


@dataclass
class ProductionSubspaceLayer(compress.SubspaceLayer):
    """Also: its bases estimated on FSDP's row blocks (`rows`, set by the communicator) and from
    an EMA of the covariances across refreshes (Options.decay; the energies below carry it), the
    core energy (the fraction of the mean's energy in the r x r core: the layer table's), and
    the state rank agreement and checkpoints read."""
    left_energy: torch.Tensor = None    # (r,): the EMA covariances' energies in the bases
    right_energy: torch.Tensor = None
    energy: object = float("nan")       # a device scalar once measured: no host sync
    rows: object = field(default=None, repr=False)      # FSDP's RowBlocks of this matrix
    sides: str = "both"                 # the sides it rotates: both, left or right
    transform: tuple = field(default=(None, None), repr=False)  # (P or None, Q or None)
    ready = RenamedAttribute("built")   # (the old name, for one release)

    @classmethod
    def create(cls, name, shape, opts):
        """compress.SubspaceLayer.create, rotating the sides of Options.sides ("auto": both, until
        the gain check measures the right side alone); with dense bases, a DenseSubspaceLayer."""
        if opts.dense_bases and cls is not DenseSubspaceLayer:
            return DenseSubspaceLayer.create(name, shape, opts)
        layer = super().create(name, shape, opts)
        layer.sides = "both" if opts.sides == "auto" else opts.sides
        return layer

    @property
    def row_local(self):
        """Only the column side rotates: decode acts on each row alone."""
        return self.transform[0] is None

    def encode(self, g, transform=None):
        """H = P^T G Q, core scattered (or in the rotation `transform`: (P or None, Q or None))."""
        transform = transform or self.transform
        return compress.swap_entries(compress.encode_geo(g, *transform), self.swaps_for(transform))

    def decode(self, h, transform=None):
        transform = transform or self.transform
        return compress.decode_geo(compress.swap_entries(h, self.swaps_for(transform)), *transform)

    def swaps_for(self, transform):
        """Core scattering applies when both sides rotate: only then does the dominant energy
        gather in H's r x r corner (moved into a quiet row, a large value would set its scale)."""
        return self.swaps if transform[0] is not None and transform[1] is not None else None

    def rotation(self, sides=None):
        """(P or None, Q or None), the rotation of `sides` (DenseSubspaceLayer: dense bases)."""
        sides = sides or self.sides
        return (self.left_basis if sides in ("both", "left") else None,
                self.right_basis if sides in ("both", "right") else None)

    def rotate_sides(self, sides):
        self.sides, self.transform = sides, self.rotation(sides)

    def refresh(self, mean):
        super().refresh(mean)
        self.settle(mean.device)

    def use_bases(self, left, right, device):
        """New bases, (Y, T) of each side, put in use, then settled. T row-major, as
        compress.HouseholderBasis.from_lu makes it (a checkpoint of an older version may hold it
        column-major, and BLAS rounds a product by its operands' memory order)."""
        self.left_basis = compress.HouseholderBasis(left[0], left[1].contiguous())
        self.right_basis = compress.HouseholderBasis(right[0], right[1].contiguous())
        self.settle(device)

    def settle(self, device):
        """After new bases: the core's swaps on the gradients' device (once: no copy at each
        step), and the rotation in use made of the new bases."""
        self.swaps = swaps_on(self.swaps, device)
        self.transform = self.rotation()

    def dominant_subspaces(self, mean):
        """compress.py's subspace iteration in its row form (the same numbers when this rank
        holds every row; under FSDP `mean` is this rank's block of rows) with the covariances'
        EMA; then the core energy, summed over the ranks."""
        rows = self.rows or UNSHARDED
        if self.left_basis is None:
            U, V, self.left_energy, self.right_energy = row_blocks.initial_subspaces_rows(
                mean, self.r, self.seed, rows)
        else:
            U, V, self.left_energy, self.right_energy = row_blocks.update_subspaces_rows(
                mean, self.left_basis.columns(), self.right_basis.columns(), self.left_energy,
                self.right_energy, self.opts.decay, self.opts.iters, rows)
        self.energy = row_blocks.core_energy(mean, U, V, rows)     # stays on the device
        return U, V

    def tensors(self):
        return [self.left_basis.Y, self.left_basis.T, self.right_basis.Y, self.right_basis.T,
                self.left_energy, self.right_energy]

    def flags(self):
        """The decisions as numbers: (use_geo, only the right side rotates, gain)."""
        return [float(self.use_geo), float(self.sides == "right"), self.gain]

    def load_flags(self, flags):
        self.use_geo, self.gain = bool(flags[0]), flags[2]
        self.rotate_sides("right" if flags[1] else ("both" if self.sides == "right" else self.sides))

    def state_dict(self):
        return {"left_Y": self.left_basis.Y, "left_T": self.left_basis.T,
                "right_Y": self.right_basis.Y, "right_T": self.right_basis.T,
                "left_energy": self.left_energy, "right_energy": self.right_energy,
                "use_geo": self.use_geo, "gain": self.gain, "energy": self.energy,
                "sides": self.sides}

    def load_state_dict(self, s):
        self.use_geo, self.gain = s["use_geo"], s["gain"]
        self.left_energy, self.right_energy = s["left_energy"], s["right_energy"]
        self.energy, self.sides = s["energy"], s.get("sides", self.sides)
        self.use_bases((s["left_Y"], s["left_T"]), (s["right_Y"], s["right_T"]),
                       s["left_Y"].device)          # (the swaps where refresh() leaves them)


@dataclass
class ProductionWhitenedLayer(JudgedLayer, compress.WhitenedLayer):
    """Also the factor kinds of Options.whiten_factor and the published EMA of the triangular factor
    (factor_decay; the low-rank form is not closed under blending, so it is smoothed through its
    second moment only), and what the layer table and FSDP read."""
    energy = float("nan")               # (the rotation's core energy: none here)
    sides = "both"                      # (no side is chosen here)
    transform = ()                      # (no rotation)
    ready = RenamedAttribute("built")   # (the old name, for one release)

    @property
    def r(self):
        """r of its low-rank approximation: the factor's eigenpairs (whiten_rank)."""
        return self.opts.whiten_rank

    @property
    def row_local(self):
        """Only the input side is whitened (G~ = G F^-T): decode acts on each row alone."""
        return "output" not in self.factors

    def encode(self, g):
        """G~ = F_B^-1 G F_A^-T for the sides that have a factor (whiten_sides)."""
        h = self.factors["input"].whiten(g) if "input" in self.factors else g
        return self.factors["output"].whiten(h.T).T if "output" in self.factors else h

    def decode(self, h):
        """G = F_B G~ F_A^T."""
        g = self.factors["output"].unwhiten(h.T).T if "output" in self.factors else h
        return self.factors["input"].unwhiten(g) if "input" in self.factors else g

    def factor_of(self, side, moment):
        o = self.opts
        factor = factor_of_kind(moment, o.whiten_factor, o.whiten_rank, o.whiten_block, o.damping,
                                solver=whiten_solver(o), old=self.factors.get(side))
        if isinstance(factor, DenseFactor):
            return factor.blended(self.factors.get(side), o.factor_decay)
        return factor

    def tensors(self):
        return ([m for m in self.moments.values()]
                + [t for f in self.factors.values() for t in factor_tensors(f).values()])

    def state_dict(self):
        return {"moments": dict(self.moments), "use_geo": self.use_geo, "gain": self.gain,
                "factors": {side: {"kind": f.kind, "size": f.size, **factor_tensors(f)}
                            for side, f in self.factors.items()}}

    def load_state_dict(self, s):
        self.use_geo, self.gain = s["use_geo"], s["gain"]
        self.moments = dict(s["moments"])
        self.factors = {side: load_factor(f) for side, f in s["factors"].items()}


LAYERS = {"geofp8": ProductionWhitenedLayer, "subspace": ProductionSubspaceLayer,
          "hadamard": HadamardLayer}


@dataclass
class DenseSubspaceLayer(ProductionSubspaceLayer):
    """The subspace rotation with dense bases in place of the Householder completion: full=True,
    the complete singular bases of the latest mean (kept in `exact`; r = min(m, n)), or
    basis="random", a seeded random rotation. The Householder bases are still estimated as in
    ProductionSubspaceLayer (they carry the warm start, the energies and the readiness)."""
    exact: tuple = field(default=None, repr=False)      # full=True: (U (m, m), V (n, n))

    @classmethod
    def create(cls, name, shape, opts):
        """r = min(m, n) for full=True, no core scattering."""
        r = min(shape) if opts.full else min(opts.geo_rank, min(shape) // 2)
        return cls(shape, r, seed=zlib.crc32(name.encode()), opts=opts,
                   sides="both" if opts.sides == "auto" else opts.sides)

    def rotation(self, sides=None):
        """The dense bases in place of the Householder ones, on the same sides."""
        left, right = super().rotation(sides)
        if self.opts.full:
            dense = tuple(DenseBasis(M) for M in self.exact)
        else:
            device = self.left_basis.Y.device
            dense = (DenseBasis(random_orthogonal(self.shape[0], self.seed, device)),
                     DenseBasis(random_orthogonal(self.shape[1], self.seed + 1, device)))
        return (dense[0] if left is not None else None, dense[1] if right is not None else None)

    def refresh(self, mean):
        if self.opts.full:
            self.exact = exact_bases(mean)
        super().refresh(mean)

    def tensors(self):
        return super().tensors() + list(self.exact or ())

    def state_dict(self):
        return {**super().state_dict(), "exact": self.exact}

    def load_state_dict(self, s):
        self.exact = s.get("exact")
        if self.opts.full and self.exact is None:
            raise ValueError("this communicator state has no exact bases (saved before full=True "
                             "kept them); start the full=True ablation afresh")
        super().load_state_dict(s)
