"""nanogeo.geometry.batched: the subspace rotation of the matrices of one shape at once, held to
compress.py's one-matrix forms (issue 50, items 2 and 3).

Tolerances: the round trip of a stack is the codec's, bit for bit (the same ops on the same
groups). The rotation, the refresh and the gain check's errors run the same functions mapped
over a stack (torch.vmap): on this CPU they come out bit-equal too, but a batched matrix product
or reduction may add in another order on other hardware, so they are held to fp32 rounding -
1e-5 relative to the largest entry for coordinates, bases and errors - and the gain check to
the same decisions."""
import copy

import pytest
import torch

import compress
from nanogeo.geometry import batched, layers
from nanogeo.geometry.update_error import OptimizerView
from nanogeo.lab.probes import OpCounter
from nanogeo.parallel.communicator import Options, ProductionCommunicator

SHAPES = [(48, 64), (96, 32)]


def planted(m, n, count, seed):
    """`count` gradients (m, n): six dominant directions on each side (the same for every seed
    of a shape, as a layer's are from step to step), their weights and noise drawn by `seed`."""
    fixed = torch.Generator().manual_seed(m * 1000 + n)
    left, right = torch.randn(m, 6, generator=fixed), torch.randn(6, n, generator=fixed)
    g = torch.Generator().manual_seed(seed)
    return [left @ torch.diag(torch.logspace(1, -1, 6) * (1 + 0.1 * torch.randn(6, generator=g)))
            @ right + 0.05 * torch.randn(m, n, generator=g) for _ in range(count)]


def close(a, b, rel=1e-5):
    return (a - b).abs().max() <= rel * b.abs().max().clamp(min=1e-30)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4"])
@pytest.mark.parametrize("block", [128, 100, "row", "tensor"])
@pytest.mark.parametrize("shape", [(48, 40), (37, 24)])
def test_round_trip_of_a_stack_is_the_codecs_bit_for_bit(fmt, block, shape):
    """Each matrix's own scale groups (padded as quantize pads them; NVFP4: its own tensor
    scale), whether the groups divide the matrix or not."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(5, *shape, generator=g) * torch.logspace(-3, 2, 5)[:, None, None]
    X[2] = 0                                                    # an all-zero matrix: scale 1
    got = batched.round_trip_stack(X, fmt, block)
    expected = torch.stack([compress.dequantize(compress.quantize(x, fmt, block)) for x in X])
    assert torch.equal(got, expected)


def refreshed_layers(shape, count, opts, seed=1):
    layer_list = [layers.ProductionSubspaceLayer.create(f"l{i}", shape, opts) for i in range(count)]
    for layer, mean in zip(layer_list, planted(*shape, count, seed)):
        layer.refresh(mean)
    return layer_list


@pytest.mark.parametrize("shape", SHAPES)
def test_stacked_refresh_is_each_layers_own(shape):
    """refresh_stack = ProductionSubspaceLayer.refresh of each matrix, cold (the seeded start)
    and warm (from the bases in use), with the EMA of the covariances on."""
    opts = Options(geometry="subspace", geo_rank=8, min_numel=16, decay=0.5)
    cold = [layers.ProductionSubspaceLayer.create(f"l{i}", shape, opts) for i in range(4)]
    for means in (planted(*shape, 4, 1), planted(*shape, 4, 2)):
        expected = [copy.copy(layer) for layer in cold]
        for layer, mean in zip(expected, means):
            layer.refresh(mean)
        got = [copy.copy(layer) for layer in cold]
        batched.refresh_stack(got, means)
        for a, b in zip(got, expected):
            for x, y in zip(a.tensors() + [a.energy], b.tensors() + [b.energy]):
                assert close(x, y)
            assert a.transform[0].Y is a.left_basis.Y and a.swaps[0].device == means[0].device
        cold = expected                                     # the next round starts warm


@pytest.mark.parametrize("sides", ["both", "right"])
def test_stacked_rotation_is_each_layers_own(sides):
    """rotate_stack = layer.encode / layer.decode of each matrix (core scattering included)."""
    opts = Options(geometry="subspace", geo_rank=8, min_numel=16)
    group = refreshed_layers((48, 64), 5, opts)
    for layer in group:
        layer.rotate_sides(sides)
    X = torch.stack(planted(48, 64, 5, 3))
    bases = batched.with_products(batched.stack_bases([layer.transform for layer in group]))
    H = batched.rotate_stack(group[0], X, bases)
    assert close(H, torch.stack([layer.encode(x) for layer, x in zip(group, X)]))
    back = batched.rotate_stack(group[0], H, bases, inverse=True)
    assert close(back, torch.stack([layer.decode(h) for layer, h in zip(group, H)]))
    assert close(back, X, rel=1e-5)                         # orthogonal: the inverse


def test_a_checkpoints_column_major_T_is_put_in_use_row_major():
    """A checkpoint written before from_lu made T row-major holds it column-major: loaded, the
    layer uses it row-major, so its rotation has a fresh layer's bits."""
    opts = Options(geometry="subspace", geo_rank=8, min_numel=16)
    [layer] = refreshed_layers((48, 64), 1, opts)
    state = layer.state_dict()
    old = {**state, **{k: state[k].T.contiguous().T for k in ("left_T", "right_T")}}
    assert old["left_T"].stride() == (1, 8)
    loaded = layers.ProductionSubspaceLayer.create("l0", (48, 64), opts)
    loaded.load_state_dict(old)
    assert loaded.left_basis.T.stride() == loaded.right_basis.T.stride() == (8, 1)
    X = planted(48, 64, 1, 5)[0]
    assert torch.equal(loaded.encode(X), layer.encode(X))


@pytest.mark.parametrize("sides", ["both", "left", "right"])
@pytest.mark.parametrize("shape", [(48, 64), (64, 40)])
def test_rotation_in_place_is_compress_bit_for_bit(sides, shape):
    """rotate_stack_ (the stack's subtractions fused into in-place products, Y T^T and Y T made
    once) writes into the stack the bits of compress's encode and decode of each matrix, which
    make every product at each call (one thread: tests/conftest.py); T's memory order included
    (from_lu gives it row-major, as a stack of T's is)."""
    opts = Options(geometry="subspace", geo_rank=8, min_numel=16)
    group = refreshed_layers(shape, 3, opts)
    for layer in group:
        layer.rotate_sides(sides)
    X = torch.stack(planted(*shape, 3, 7))
    bases = batched.with_products(batched.stack_bases([layer.transform for layer in group]))
    H = X.clone()
    assert batched.rotate_stack_(group[0], H, bases) is H          # in place
    assert torch.equal(H, torch.stack([layer.encode(x) for layer, x in zip(group, X)]))
    back = batched.rotate_stack(group[0], H, bases, inverse=True)
    assert torch.equal(back, torch.stack([layer.decode(h) for layer, h in zip(group, H)]))
    with pytest.raises(ValueError, match="row-major"):
        batched.rotate_stack_(group[0], X.mT, bases)


def adamw_views(names, shapes, seed=0):
    """Fake AdamW states (one param group) for the gain check: {name: OptimizerView}."""
    g = torch.Generator().manual_seed(seed)
    hyper = {"betas": (0.9, 0.95), "eps": 1e-8}
    views = {}
    for name, shape in zip(names, shapes):
        state = {"step": torch.tensor(7.0), "exp_avg": 0.1 * torch.randn(shape, generator=g),
                 "exp_avg_sq": 0.01 * torch.rand(shape, generator=g)}
        views[name] = OptimizerView("adamw", lambda: hyper, lambda state=state: state)
    return views


def run_communicator(stacked, monkeypatch, judge, workers=2, steps=12, **codec):
    """Decisions, gains and means of a ProductionCommunicator over planted steps, the matrices
    of one shape together (stacked) or one by one (compress.py's forms); `codec`: fmt, block."""
    if not stacked:
        monkeypatch.setattr(batched, "stackable", lambda layer: False)
    shapes = [(48, 64), (48, 64), (96, 32), (48, 64), (96, 32), (64,)]
    names = [f"w{i}" for i in range(len(shapes))]
    comm = ProductionCommunicator(list(zip(names, shapes)), Options(
        geometry="subspace", geo_rank=8, min_numel=16, geo_refresh=3, geo_judge=judge, **codec))
    if judge == "optimizer":
        comm.watch(adamw_views(names, shapes))
    record = []
    for step in range(steps):
        grads = [[*planted(48, 64, 2, 100 * step + w)[:2], *planted(96, 32, 1, 100 * step + w),
                  *planted(48, 64, 1, 100 * step + w + 50), *planted(96, 32, 1, 100 * step + w + 50),
                  torch.randn(64, generator=torch.Generator().manual_seed(step))]
                 for w in range(workers)]
        means, _ = comm.reduce_workers(grads)
        record.append((means, {n: (l.use_geo, l.sides, l.gain) for n, l in comm.layers.items()}))
    monkeypatch.undo()
    return record


@pytest.mark.parametrize("judge, codec", [("optimizer", {}), ("l2", {}),
                                          ("l2", {"block": 100}), ("l2", {"fmt": "nvfp4"})])
def test_the_gain_check_decides_alike_stacked_or_one_by_one(monkeypatch, judge, codec):
    """A ProductionCommunicator with the stacked forms (refresh, gain check, encode and decode)
    takes every decision of the one-by-one forms at every step (use, sides) with the same gains
    (fp32 rounding) and delivers the same means (fp32 rounding) - also where a matrix is not
    whole scale groups (48 x 64 in groups of 100; 96 x 32 at NVFP4 is), so that the stacked
    round trip comes back padded, not contiguous."""
    stacked = run_communicator(True, monkeypatch, judge, **codec)
    one_by_one = run_communicator(False, monkeypatch, judge, **codec)
    assert any(use for _, d in stacked for use, _, _ in d.values())     # the rotation is used
    for (means_a, decided_a), (means_b, decided_b) in zip(stacked, one_by_one):
        for n in decided_b:
            (use_a, sides_a, gain_a), (use_b, sides_b, gain_b) = decided_a[n], decided_b[n]
            assert (use_a, sides_a) == (use_b, sides_b)
            assert gain_a == pytest.approx(gain_b, rel=1e-5, nan_ok=True)
        for a, b in zip(means_a, means_b):
            assert close(a, b)


def test_stacked_step_launches_do_not_grow_with_the_matrices():
    """Encode, decode and refresh of a shape group launch a fixed number of kernels, whatever
    the number of matrices in it; a refresh makes one SVD per group."""
    opts = Options(geometry="subspace", geo_rank=8, min_numel=16)
    counts = []
    for count in (2, 8):
        group = refreshed_layers((48, 64), count, opts)
        X = torch.stack(planted(48, 64, count, 3))
        with OpCounter() as ops:
            bases = batched.with_products(
                batched.stack_bases([layer.transform for layer in group]))
            batched.rotate_stack(group[0], batched.rotate_stack(group[0], X, bases), bases, True)
            batched.refresh_stack(group, list(X))
        counts.append((ops.total, ops.counts.get("_linalg_svd", 0)))
    assert counts[0] == counts[1] and counts[0][1] == 1, counts


def moments_of(d, count, seed):
    """`count` anisotropic second moments (d, d) of one width."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        a = torch.randn(256, d, generator=g) * torch.logspace(0, -2, d)
        out.append(a.T @ a / 256)
    return out


@pytest.mark.parametrize("solver", ["eigh", "subspace"])
def test_stacked_whitening_refresh_is_each_layers_own(solver):
    """refresh_group of low-rank whitened layers = ProductionWhitenedLayer.refresh of each
    (the EMA of the moments, then the factors: compress.py's eigh, or the subspace iteration
    warm-started from the factor in use), with one eigendecomposition and one SVD per side for
    the group, not per layer."""
    opts = Options(geometry="geofp8", whiten_rank=8, min_numel=16, whiten_solver=solver,
                   whiten_sides="both")
    shape, count = (48, 64), 4
    layer_list = [layers.ProductionWhitenedLayer.create(f"l{i}", shape, opts)
                  for i in range(count)]
    for seed in (1, 2):                                     # cold, then from the factors in use
        stats = [{"input": a, "output": b} for a, b in
                 zip(moments_of(64, count, seed), moments_of(48, count, seed + 10))]
        assert len({batched.refresh_key(layer, s) for layer, s in zip(layer_list, stats)}) == 1
        expected = [copy.copy(layer) for layer in layer_list]
        for layer, s in zip(expected, stats):
            layer.refresh(s)
        got = [copy.copy(layer) for layer in layer_list]
        with OpCounter() as ops:
            batched.refresh_group(got, stats)
        for a, b in zip(got, expected):
            for x, y in zip(a.tensors(), b.tensors()):
                assert close(x, y)
        assert ops.syncing == 4, ops.counts           # per side: one eigh, one svd
        layer_list = expected


def test_refresh_bench_counts_the_stacked_refresh():
    """nanogeo.lab.refresh_bench states the refresh in kernel launches and syncing calls too:
    one by one two syncing calls per layer (eigh or the Rayleigh-Ritz eigh, and the SVD), its
    layers of one width stacked two per width."""
    from nanogeo.lab import refresh_bench
    result = refresh_bench.run("char-study", 1, 16, 1, 8)
    widths, ops = len(result["rows"]), result["ops"]
    for kind in ("eigh", "cold", "warm"):
        assert ops[kind][1] == 2 * result["layers"], ops
        assert ops[f"stacked {kind}"][1] == 2 * widths < ops[kind][1], ops
        assert ops[f"stacked {kind}"][0] < ops[kind][0]
    assert "stacked" in refresh_bench.report(result)


def test_small_tensors_are_built_on_the_device():
    """Issue 50, item 2: the agreement check's readiness and checksum and the K-FAC moments'
    token counts hold host numbers without torch.tensor(list, device=...) (a copy from
    pageable memory, which makes a CUDA host wait: aten's lift_fresh)."""
    from nanogeo.geometry import agreement
    from nanogeo.parallel import hooks
    opts = Options(geometry="subspace", geo_rank=8, min_numel=16)
    group = refreshed_layers((48, 64), 3, opts) + [
        layers.ProductionSubspaceLayer.create("cold", (48, 64), opts)]
    moments = {"input": {"a": torch.eye(4), "b": 2 * torch.eye(4)},
               "tokens": {"input": {"a": 3, "b": 5}}}
    with OpCounter() as ops:
        ready = agreement.readiness(group, torch.device("cpu"))
        agreement.geometry_checksum(group, ready)
        averaged = hooks.average_moments(moments, {"a": (4, 4), "b": (4, 4)}, ("input",),
                                         lambda flat: flat, torch.device("cpu"))
    assert ops.syncing == 0, ops.counts
    assert ready.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert torch.equal(averaged["input"]["b"], 2 * torch.eye(4))


@pytest.mark.parametrize("kind", ["full", "block", "lowrank-dense"])
def test_dense_factors_check_their_cholesky_on_the_device(kind):
    """Issue 50, item 2: the dense whitening factors (ablations) use cholesky_ex, the variant
    that does not wait on the host (the factor of torch.linalg.cholesky, bit for bit); one that
    failed is NaN."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 20, generator=g, dtype=torch.float64)
    A = a.T @ a / 64
    with OpCounter() as ops:
        factor = layers.factor_of_kind(A, kind, r=4, block=8)
    assert "linalg_cholesky" not in ops.counts and ops.counts["linalg_cholesky_ex"] == 1
    assert ops.syncing == (1 if kind == "lowrank-dense" else 0)      # (its eigh: no _ex exists)
    assert torch.isfinite(factor.dense()).all()
    if kind == "full":
        damped = (A + A.T) / 2 + 1e-3 * torch.eye(20, dtype=torch.float64)
        assert torch.equal(factor.L, torch.linalg.cholesky(damped))
    assert torch.isnan(layers.cholesky(-torch.eye(3, dtype=torch.float64))).all()


def test_a_refresh_makes_one_svd_for_every_stack():
    """Issue 58, item 1: the r x r cores of every stack (every run of every shape group) go
    through one SVD call per r - on a GPU each call waits for the host twice - however small
    the bucket that cuts the shape groups into runs; cold (the seeded start) and warm."""
    shapes = [(64, 96)] * 3 + [(96, 64)] * 2 + [(128, 128)] * 2 + [(12, 64)]    # r: 8, ..., 6
    named = [(f"w{i}", shape) for i, shape in enumerate(shapes)]
    opts = Options(geometry="subspace", geo_rank=8, min_numel=16, geo_warmup=0, geo_refresh=2,
                   geo_judge="l2", bucket_mb=0.03)         # a bucket of one 64 x 96 matrix
    comm = ProductionCommunicator(named, opts)
    assert comm.stack_limit() < 2 * 64 * 96                 # every matrix a run of its own
    g = torch.Generator().manual_seed(0)
    svds = []
    for step in range(4):           # refreshes: the cold one, then every 2 steps taken
        workers = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
        with OpCounter() as ops:
            comm.reduce_workers(workers)
        svds.append(ops.counts.get("_linalg_svd", 0) + ops.counts.get("linalg_svd", 0))
    assert svds == [2, 2, 0, 2]                             # two r's: 8 and 6
    assert all(layer.built for layer in comm.layers.values())


def test_a_refresh_orthonormalises_every_stack_of_one_shape_together():
    """Issue 58, item 2: the subspace iteration's bases (compress.orthonormal: CholeskyQR, no
    per-matrix QR) of every stack of one shape are made in one call a round, cold and warm, so
    a small bucket that puts each matrix in a run of its own makes as many calls as a large one
    - and the same bits on the CPU with one thread (a GPU's batched kernels may choose by batch
    size: the ranks still agree, as their stacks are alike)."""
    shapes = [(64, 96)] * 3 + [(96, 64)] * 2 + [(128, 128)] * 2 + [(12, 64)]    # r: 8, ..., 6
    named = [(f"w{i}", shape) for i, shape in enumerate(shapes)]
    g = torch.Generator().manual_seed(0)
    steps = [[[torch.randn(s, generator=g) for s in shapes] for _ in range(2)] for _ in range(4)]
    calls, bases = {}, {}
    for bucket_mb in (0.03, 100):                           # every matrix a run; one run a shape
        opts = Options(geometry="subspace", geo_rank=8, min_numel=16, geo_warmup=0,
                       geo_refresh=2, geo_judge="l2", bucket_mb=bucket_mb)
        comm = ProductionCommunicator(named, opts)
        calls[bucket_mb] = []
        for workers in steps:       # refreshes: the cold one, then every 2 steps taken
            with OpCounter() as ops:
                comm.reduce_workers([list(w) for w in workers])
            calls[bucket_mb].append(ops.counts.get("linalg_cholesky_ex", 0))
        bases[bucket_mb] = [t for n, _ in named for t in comm.layers[n].tensors()]
    # a warm round: U's shapes (64, 8), (96, 8), (128, 8), (12, 6) and V's (96, 8), (64, 8),
    # (128, 8), (64, 6), made together - 5 calls of 3 passes; the cold refresh: the range
    # finder's U, then its V (4 + 4 calls), and 4 rounds
    assert calls[0.03] == calls[100] == [(8 + 4 * 5) * 3, 5 * 3, 0, 5 * 3], calls
    assert all(torch.equal(a, b) for a, b in zip(bases[0.03], bases[100]))


def test_a_refresh_of_cold_and_warm_stacks_with_more_rounds_is_each_layers_own():
    """refresh_stacks with a cold and a warm stack of one shape (different rounds: the cold
    start's 4, the warm layers' iters=2) and the covariance EMA on: each layer as its own
    refresh makes it."""
    shape = (48, 40)
    opts = Options(geometry="subspace", geo_rank=6, min_numel=16, decay=0.5, iters=2)
    warm = [layers.ProductionSubspaceLayer.create(f"w{i}", shape, opts) for i in range(2)]
    for layer, mean in zip(warm, planted(*shape, 2, 1)):
        layer.refresh(mean)                                 # built: the next refresh is warm
    cold = [layers.ProductionSubspaceLayer.create(f"c{i}", shape, opts) for i in range(3)]
    means = planted(*shape, 5, 2)
    expected = [copy.copy(layer) for layer in warm + cold]
    for layer, mean in zip(expected, means):
        layer.refresh(mean)
    got = [copy.copy(layer) for layer in warm + cold]
    batched.refresh_stacks([(got[:2], means[:2]), (got[2:], means[2:])])
    for a, b in zip(got, expected):
        for x, y in zip(a.tensors() + [a.energy], b.tensors() + [b.energy]):
            assert close(x, y)



def test_the_completion_of_every_stack_is_each_matrixs_own():
    """Issue 58, item 2: complete_together gives each matrix compress.HouseholderBasis.complete's
    bits (CPU, one thread), the LU of every top block of one r in one call - its r pivots
    launched once however many stacks and shapes - and no host sync."""
    g = torch.Generator().manual_seed(0)
    stacks = [torch.stack([compress.orthonormal(torch.randn(m, r, generator=g))
                           for _ in range(L)]) for m, r, L in
              [(64, 8, 3), (96, 8, 1), (64, 8, 2), (40, 6, 2)]]
    with OpCounter() as ops:
        done = batched.complete_together(stacks)
    assert ops.counts["copysign"] == 8 + 6 and ops.syncing == 0, ops.counts    # one pivot an op
    for stack, (Y, T) in zip(stacks, done):
        for U, y, t in zip(stack, Y, T):
            r = U.shape[1]
            own = compress.HouseholderBasis.complete(U)
            assert torch.equal(y, own.Y) and torch.equal(t, own.T)
            assert t.stride() == own.T.stride() == (r, 1)       # row-major: BLAS rounds by it


def test_rows_refresh_is_each_layers_own_with_the_completions_together():
    """refresh_rows (FSDP's row-sharded rotation: each matrix's own subspace iteration, the
    completions together) = ProductionSubspaceLayer.refresh of each matrix, bit for bit (CPU,
    one thread), cold and warm, with one LU call per r for matrices of two shapes. Run here on
    unsharded rows (one process); tests/test_fsdp.py's gloo runs take the sharded route."""
    opts = Options(geometry="subspace", geo_rank=8, min_numel=16, decay=0.5)
    shapes = [(48, 40), (48, 40), (40, 64)]
    cold = [layers.ProductionSubspaceLayer.create(f"l{i}", s, opts) for i, s in enumerate(shapes)]
    for seed in (1, 2):
        means = [planted(*s, 1, seed + i)[0] for i, s in enumerate(shapes)]
        expected = [copy.copy(layer) for layer in cold]
        for layer, mean in zip(expected, means):
            layer.refresh(mean)
        got = [copy.copy(layer) for layer in cold]
        with OpCounter() as ops:
            batched.refresh_rows(got, means)
        assert ops.counts["copysign"] == 8, ops.counts             # r = 8: one LU for all six
        for a, b in zip(got, expected):
            assert all(torch.equal(x, y) for x, y in zip(a.tensors() + [a.energy],
                                                         b.tensors() + [b.energy]))
            assert a.transform[0].Y is a.left_basis.Y
        cold = expected
