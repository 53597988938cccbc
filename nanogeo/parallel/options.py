"""
The options of the communicator as training runs it: compress.GeoOptions (the method's settings)
plus production's (buckets, stochastic rounding, the paper's collective's order, the Hadamard
control, the ablations), each string checked against its choices, with one-line errors that
name the fix. nanogeo.parallel.communicator re-exports them.
"""
from dataclasses import dataclass

import compress
from nanogeo.geometry import hadamard, layers
from nanogeo.wire import buckets, collective, nvfp4

# options renamed to train.py's flag names (one vocabulary), and the whitening's old name
RENAMED = {"refresh": "geo_refresh", "warmup": "geo_warmup", "judge": "geo_judge",
           "enter_gain": "geo_enter_gain", "exit_gain": "geo_exit_gain",
           "factor": "whiten_factor", "stochastic": "stochastic_round"}
OLD_GEOMETRY = {"whiten": "geofp8"}
COLLECTIVES = compress.COLLECTIVES
SUM_ORDERS = ("ring", "tree")      # fp8-sum: the order NCCL adds in (nanogeo/wire/fp8sum.py)
SELECTIONS = compress.SELECTIONS + ("fragile",)
GEOMETRIES = compress.GEOMETRIES + ("hadamard",)
FEEDBACK_STAGES = compress.FEEDBACK_STAGES
SUBSPACE_SIDES = ("both", "left", "right", "auto")
WHITEN_SIDES = ("input", "output", "both")


@dataclass
class Options(compress.GeoOptions):
    sum_order: str = "ring"         # fp8-sum: the order NCCL adds in ("ring" or "tree")
    scale_sync_every: int = 1       # fp8-sum: >1 reproduces the published local-scale defect
    top_k: int = 0                  # select="fragile": the top_k matrices by fraction of saturated
                                    # FP8 sums over the warmup steps (needs collective="fp8-sum")
    seed: int = 0                   # stochastic rounding's and the Hadamard control's draws
    nvfp4_scale: str = "6"          # NVFP4's block scales: each block's max at 6, or "4over6":
                                    # at 6 or 4, whichever errs less (Four Over Six)
    stochastic_round: bool = False  # stochastic rounding (two-stage collective only)
    stochastic_stages: str = "both" # ... in both stages, or only "1" (each rank's send) or "2"
                                    # (the re-quantized averaged shard)
    feedback_geo_only: bool = False # stage 1 only on the geometry-aware matrices (as published)
    # the Hadamard control (geometry="hadamard", nanogeo/geometry/hadamard.py)
    hadamard_block: int = 128       # entries per Walsh-Hadamard block, a power of two
    hadamard_sides: str = "right"   # "right": along each row (row-local), "both": columns too
    sides: str = "auto"             # subspace: both | left (output side) | right (input side) |
                                    # auto (both or right, the better measured; right keeps every
                                    # row's scale)
    # ablations (nanogeo/geometry/layers.py)
    whiten_sides: str = "input"     # geofp8: input (published) | output | both
    whiten_factor: str = "lowrank"  # lowrank | lowrank-dense | full | diag | block
    whiten_block: int = 64          # block size of whiten_factor="block"
    whiten_solver: str = "auto"     # the low-rank factor's top-r eigenpairs: "subspace" iteration,
                                    # warm-started (compress.subspace_eigenpairs), or "eigh"
                                    # (compress.py's full float64 eigendecomposition); "auto":
                                    # subspace where the gain check measures every factor before
                                    # use (geo_layers=gain), eigh where layers are used unmeasured
    factor_decay: float = 0.0       # EMA of the triangular factor itself (published: 0.95)
    full: bool = False              # exact dense eigenbases (reference / ablation)
    decay: float = 0.0              # subspace: EMA of the covariances (0: the latest mean only)
    basis: str = "householder"      # "householder" or "random" (dense random rotation)
    stale_residual: bool = False    # keep the residual in the old coordinates (defect c)
    # memory (nanogeo/wire/buckets.py)
    bucket_mb: float = buckets.DEFAULT_BUCKET_MB    # average a bucket of at most this many MiB
                                    # of fp32 gradients at a time (0: the whole list as one)

    def choices(self):
        return {**super().choices(), "geometry": GEOMETRIES,
                "select": SELECTIONS, "collective": COLLECTIVES, "sum_order": SUM_ORDERS,
                "sides": SUBSPACE_SIDES, "whiten_sides": WHITEN_SIDES,
                "whiten_factor": layers.WHITEN_FACTORS, "whiten_solver": layers.WHITEN_SOLVERS,
                "basis": ("householder", "random"),
                "stage2_fmt": ("", *compress.FORMATS), "nvfp4_scale": nvfp4.NVFP4_SCALES,
                "stochastic_stages": tuple(collective.ROUNDING_STAGES),
                "feedback_stages": FEEDBACK_STAGES,
                "hadamard_sides": hadamard.HADAMARD_SIDES}

    def __post_init__(self):
        super().__post_init__()
        compress.check_codec(self.fmt, self.block)
        if self.hadamard_block < 2 or self.hadamard_block & (self.hadamard_block - 1):
            raise ValueError(f"hadamard_block must be a power of two >= 2 (e.g. 128), got "
                             f"{self.hadamard_block}")
        buckets.capacity(self.bucket_mb)        # (its check: bucket_mb >= 0)
        if self.scale_sync_every < 1:
            raise ValueError("scale_sync_every must be >= 1")
        fp8 = self.fmt in compress.FP8_FORMATS
        if self.collective == "fp8-sum" and (not fp8 or self.stochastic_round):
            raise ValueError("the fp8-sum collective sums e4m3/e5m2 codes with nearest rounding; "
                             f"use collective='two-stage' for {self.fmt} or stochastic rounding")
        if self.stochastic_round and not (fp8 or self.fmt == "nvfp4"):
            raise ValueError(f"stochastic_round rounds e4m3, e5m2 and nvfp4 codes, not "
                             f"{self.fmt}: drop stochastic_round (--stochastic_round)")
        if self.feedback_stages != "1" and not (self.error_feedback
                                                and self.collective == "two-stage"):
            raise ValueError("feedback_stages chooses the stages of the two-stage collective that "
                             "error_feedback keeps residuals for: turn error_feedback on "
                             "(--error_feedback), on collective='two-stage'")
        if self.stochastic_stages != "both" and not self.stochastic_round:
            raise ValueError("stochastic_stages chooses the stages that stochastic_round rounds "
                             "stochastically: turn stochastic_round on too (--stochastic_round)")
        self.check_stage2_fmt()
        self.check_nvfp4_scale()
        if self.full and self.basis != "householder":
            raise ValueError("full=True (exact bases) and basis='random' are two different "
                             "ablations; choose one")
        if self.sides == "auto" and self.dense_bases:
            self.sides = "both"     # the choice is between Householder rotations; dense: both
        if self.collective == "fp8-sum":
            self.block = "tensor"   # its one scale per tensor; the gain check measures that codec
        if self.select == "fragile" and (self.collective != "fp8-sum" or self.top_k < 1
                                         or self.geo_warmup < 1):
            raise ValueError("select='fragile' profiles saturated FP8 sums during the warmup: it "
                             "needs collective='fp8-sum', geo_warmup >= 1 and top_k >= 1")

    def check_stage2_fmt(self):
        """A stage-2 format of its own: on the two-stage collective, rounded to nearest, without
        stage 2's error feedback, after NVFP4 in integer blocks (the same format: ""). The gain
        check still measures `fmt`'s round trip only: stage 1's codec."""
        if self.stage2_fmt == self.fmt:
            self.stage2_fmt = ""
        if not self.stage2_fmt:
            return
        if self.collective != "two-stage":
            raise ValueError("stage2_fmt is the format of the two-stage collective's all-gather; "
                             "the fp8-sum collective has none: drop stage2_fmt (--stage2_fmt)")
        if self.stochastic_round and self.stochastic_stages != "1":
            raise ValueError("stage2_fmt: a stage 2 in its own format rounds to nearest; round "
                             "stage 1 only (stochastic_stages='1') or drop stage2_fmt")
        if self.error_feedback and self.feedback_stages != "1":
            raise ValueError("stage2_fmt: stage 2's error feedback is not supported in a format "
                             "of its own; use feedback_stages='1' or drop stage2_fmt")
        compress.check_codec(self.stage2_fmt, self.block)
        if self.fmt == "nvfp4" and not isinstance(self.block, int):
            raise ValueError(f"stage2_fmt={self.stage2_fmt!r} after nvfp4 scales stage 2 in "
                             f"groups of `block` elements: use an integer block (e.g. 128), not "
                             f"{self.block!r}")

    def check_nvfp4_scale(self):
        """Four Over Six scales NVFP4 blocks (a stage in nvfp4), rounded to nearest: its choice
        compares the two encodings' errors, which a stochastic draw would not reproduce."""
        if self.nvfp4_scale == "6":
            return
        if "nvfp4" not in (self.fmt, self.stage2_fmt):
            raise ValueError(f"nvfp4_scale={self.nvfp4_scale!r} chooses NVFP4's block scales: "
                             "send a stage in nvfp4 (--fmt=nvfp4) or drop nvfp4_scale")
        if self.stochastic_round:
            raise ValueError(f"nvfp4_scale={self.nvfp4_scale!r} rounds to nearest: drop "
                             "stochastic_round (--stochastic_round) or nvfp4_scale")

    @classmethod
    def of(cls, **options):
        """Options(**options), with a one-line error that names the new name of a renamed one."""
        old = sorted(set(options) & set(RENAMED))
        if old:
            raise ValueError(f"option {old[0]!r} is now {RENAMED[old[0]]!r} (the name of train.py's "
                             f"flag): pass {RENAMED[old[0]]}=...")
        if options.get("geometry") in OLD_GEOMETRY:
            raise ValueError(f"geometry={options['geometry']!r} is now "
                             f"{OLD_GEOMETRY[options['geometry']]!r}")
        return cls(**options)

    @property
    def dense_bases(self):
        """The subspace rotation with dense bases (ablations: full=True or basis="random")."""
        return self.full or self.basis != "householder"
