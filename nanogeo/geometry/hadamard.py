"""
The geometry-agnostic control: a randomized Hadamard transform, no statistics.

Is a layer's geometry worth its statistics? The control rotates without any: the incoherence
step of SDP4Bit's 4-bit all-reduce and of QuaRot, and what NVIDIA's NVFP4 recipe applies (with
16-entry blocks) to the inputs of its gradient GEMMs. Each row of G (m x n) is multiplied by
random signs S = diag(s), s in {-1, +1}^n, then cut into blocks of b entries (a power of two),
each multiplied by the orthonormal Walsh-Hadamard matrix of size b (Sylvester's construction,
entries +-1 / sqrt(b)):

    encode:  C = G S B          B = blockdiag(Walsh-Hadamard of size b), symmetric, B B = I
    decode:  G = C B S

Every output entry of a block sums all b inputs with equal weights and random signs, so one
large entry (an outlier column, an outlier element) is spread over its block: each block's scale
follows the block's energy, not its one largest entry. That is what 4-bit grids need; FP8
already gives small entries a precision of their own, so there the transform can be worse (the
gain check decides, unless it is forced: select="all"). What it cannot do is concentrate the
dominant directions, as compress.py's rotation does. The signs come from the matrix name's CRC
and the run's seed: every rank draws the same. B S is orthogonal, so an error comes back with its
norm unchanged. Along the columns (hadamard_sides="right", the default) each row is transformed
alone, so under FSDP a rank decodes its own rows of the mean; "both" also transforms every
column.

A batched matmul (m n / b, b) @ (b, b) applies B: 2 b flops per entry and side, one GEMM on a
GPU, and on a CPU 3-4x faster than the log2(b) passes of the fast Walsh-Hadamard butterfly. (A
GPU that allows TF32 matmuls rounds the GEMM's inputs to 10 mantissa bits: the round trip is then
exact to ~5e-4, some 50x below e4m3's rounding.) A width that is not a multiple of b: whole
blocks first, then the rest in decreasing powers of two (2736 = 21 x 128 + 32 + 16); the largest
power of two dividing n would give such a matrix blocks of 16 throughout.

It lives here, beside the dense ablations, not in compress.py: a measuring instrument of the
studies, with nothing of the method to teach beyond "a fixed orthogonal map".
"""
import math
import zlib
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from nanogeo import RenamedAttribute

HADAMARD_SIDES = ("right", "both")


@lru_cache(maxsize=None)
def walsh_hadamard(size, device, dtype=torch.float32):
    """The orthonormal Walsh-Hadamard matrix of a power-of-two size: symmetric, orthogonal, its
    own inverse. Made once per size, device and dtype."""
    M = torch.ones(1, 1, dtype=torch.float64)
    while M.shape[0] < size:                    # Sylvester: entries stay exactly +-1
        M = torch.cat([torch.cat([M, M], 1), torch.cat([M, -M], 1)])
    return (M / math.sqrt(size)).to(device=device, dtype=dtype)


@lru_cache(maxsize=None)
def hadamard_cuts(n, block):
    """A row of n entries as Walsh-Hadamard blocks: ((width, b), ...), each width a multiple of
    its b: 2736, 128 -> ((2688, 128), (32, 32), (16, 16))."""
    whole, rest = n - n % block, n % block
    cuts = [(whole, block)] if whole else []
    while rest:
        b = 1 << (rest.bit_length() - 1)        # the largest power of two <= rest
        cuts.append((b, b))
        rest -= b
    return tuple(cuts)


def block_hadamard(X, block):
    """X B for X (m, n): one batched matmul (m, width / b, b) @ (b, b) per block size."""
    m, n = X.shape
    cuts = hadamard_cuts(n, block)
    parts = X.split([width for width, _ in cuts], dim=1)
    out = [(part.reshape(m, width // b, b) @ walsh_hadamard(b, X.device, X.dtype)).reshape(m, width)
           for part, (width, b) in zip(parts, cuts)]
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def randomized_hadamard(X, signs, block):
    """X S B: each row of X (m, n) times the random signs (n,), then block_hadamard."""
    return block_hadamard(X * signs, block)


def randomized_hadamard_inverse(C, signs, block):
    """C B S, the inverse of randomized_hadamard (B B = I, S S = I)."""
    return block_hadamard(C, block) * signs


def random_signs(n, generator):
    """(n,) fp32 of +-1, each a fair coin from `generator`."""
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


@dataclass
class HadamardLayer:
    """The control's coordinates of one matrix, behind compress.py's layer interface: n random
    signs for the columns (and m for the rows with hadamard_sides="both"). refresh() draws them
    once; later refreshes only re-judge."""
    shape: tuple
    seed: int                           # zlib.crc32(name) + Options.seed
    opts: object = field(repr=False)    # the Options (hadamard_block, hadamard_sides)
    column_signs: torch.Tensor = None   # (n,) +-1: S of C = G S B
    row_signs: torch.Tensor = None      # (m,) +-1, with hadamard_sides="both"
    use_geo: bool = False
    gain: float = float("nan")
    energy = float("nan")               # (the rotation's core energy: none here)
    transform = ()                      # (no Householder rotation)
    swaps = None                        # (no core scattering)
    from_moments = False
    ready = RenamedAttribute("built")   # (the old name, for one release)

    @classmethod
    def create(cls, name, shape, opts):
        return cls(shape, zlib.crc32(name.encode()) + opts.seed, opts)

    @property
    def built(self):
        return self.column_signs is not None

    @property
    def sides(self):
        return self.opts.hadamard_sides

    @property
    def r(self):
        """The Walsh-Hadamard block size along each row (hadamard_block, or less for a narrow
        matrix): the layer table's r column."""
        return hadamard_cuts(self.shape[1], self.opts.hadamard_block)[0][1]

    @property
    def row_local(self):
        """Along the columns only: decode acts on each row alone (FSDP decodes its rows)."""
        return self.row_signs is None

    def encode(self, g):
        """C = G S B, then with row signs the same along the columns (on C^T)."""
        c = randomized_hadamard(g, self.column_signs, self.opts.hadamard_block)
        if self.row_signs is not None:
            c = randomized_hadamard(c.T, self.row_signs, self.opts.hadamard_block).T
        return c

    def decode(self, c):
        if self.row_signs is not None:
            c = randomized_hadamard_inverse(c.T, self.row_signs, self.opts.hadamard_block).T
        return randomized_hadamard_inverse(c, self.column_signs, self.opts.hadamard_block)

    def refresh(self, mean):
        """Draw the signs the first time, from a CPU generator seeded with the layer's seed
        (every rank draws the same); `mean` gives only the device."""
        if self.built:
            return
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        self.column_signs = random_signs(self.shape[1], generator).to(mean.device)
        if self.opts.hadamard_sides == "both":
            self.row_signs = random_signs(self.shape[0], generator).to(mean.device)


    # what rank agreement and checkpoints read (nanogeo.geometry.agreement, layers)
    def tensors(self):
        return [t for t in (self.column_signs, self.row_signs) if t is not None]

    def flags(self):
        """The decisions as numbers: (use_geo, -, gain)."""
        return [float(self.use_geo), 0.0, self.gain]

    def load_flags(self, flags):
        self.use_geo, self.gain = bool(flags[0]), flags[2]

    def state_dict(self):
        return {"column_signs": self.column_signs, "row_signs": self.row_signs,
                "use_geo": self.use_geo, "gain": self.gain}

    def load_state_dict(self, s):
        self.use_geo, self.gain = s["use_geo"], s["gain"]
        self.column_signs, self.row_signs = s["column_signs"], s["row_signs"]
