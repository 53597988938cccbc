"""
What a GPU would change in the communicator's numbers, checked on the CPU (issue 43):
its measurements and geometry in IEEE fp32 under a global TF32 setting; no host reads on
ordinary steps (a counter of them); the whitening refresh's fast form against compress.py's.
"""
import contextlib
import os
import sys

import pytest
import torch
from torch import nn

import compress
from nanogeo.parallel import hooks, precision
from nanogeo.parallel.communicator import Options, ProductionCommunicator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -----------------------------------------------------------------------------
# TF32: the communicator computes in IEEE fp32 whatever the global setting

@contextlib.contextmanager
def global_tf32():
    """The model's setting on a GPU (nanogeo.run.runtime) and more: TF32 everywhere, set through
    the fp32_precision API (readable and settable without CUDA); put back as it was."""
    saved = torch.backends.fp32_precision
    torch.backends.fp32_precision = "tf32"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.fp32_precision = saved


def restore_precision_defaults():
    """torch's matmul precision as a process starts: the legacy view "highest", each matmul
    backend "none" (after a test that set TF32 the way train.py does on a GPU)."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.mkldnn.matmul.fp32_precision = "none"


def project_code(filename):
    """Is `filename` one of the project's own sources outside the tests?"""
    path = os.path.abspath(filename)
    return path.startswith(ROOT + os.sep) and os.sep + "tests" + os.sep not in path[len(ROOT):] \
        and ".venv" not in path


@contextlib.contextmanager
def precision_spy(monkeypatch):
    """Records the matmul precision in force at every matmul (@), eigh, svd, qr and Cholesky
    call that the project's code makes (compress.py, nanogeo/; not torch.optim.Muon's own) while
    active: [(cuda's, oneDNN's)]."""
    seen = []

    def spied(fn):
        def call(*args, **kwargs):
            if project_code(sys._getframe(1).f_code.co_filename):
                seen.append(precision.matmul_precisions())
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(torch.Tensor, "__matmul__", spied(torch.Tensor.__matmul__))
    for name in ("eigh", "svd", "qr", "cholesky"):
        monkeypatch.setattr(torch.linalg, name, spied(getattr(torch.linalg, name)))
    try:
        yield seen
    finally:
        monkeypatch.undo()


def a_model_and_its_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96, bias=False), nn.GELU(), nn.Linear(96, 48, bias=False))
    muon = torch.optim.Muon([model[0].weight], lr=0.02)
    adamw = torch.optim.AdamW([model[2].weight], lr=1e-3)
    return model, [muon, adamw]


@pytest.mark.parametrize("geometry", ["geofp8", "subspace"])
def test_the_communicator_computes_in_ieee_fp32_under_global_tf32(monkeypatch, geometry):
    """Under a global TF32 setting, every matmul and decomposition of the communicator - the
    K-FAC moments x^T x, the factors, the coordinates, the gain check through Muon's
    Newton-Schulz and AdamW - sees "ieee" on both the GPU's and the CPU's backend; afterwards
    the global setting is back, and a later change of it still reaches the matmul backends."""
    model, optimizers = a_model_and_its_optimizers()
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    comm = ProductionCommunicator(named, Options(geometry=geometry, min_numel=16, whiten_rank=4,
                                                 geo_rank=4, geo_refresh=2, judge_every=1),
                                  linear=hooks.linear_layers(model))
    comm.watch(hooks.optimizer_views(optimizers, model))
    moments = hooks.KroneckerMoments(hooks.linear_layers(model, list(comm.layers)))
    g = torch.Generator().manual_seed(1)
    with global_tf32(), precision_spy(monkeypatch) as seen:
        for step in range(6):
            workers, stats = [], []
            for w in range(2):
                with moments.attached() if comm.moments_due() else contextlib.nullcontext():
                    model(torch.randn(4, 8, 48, generator=g) * (1 + w)).pow(2).mean().backward()
                workers.append([p.grad.clone() for p in model.parameters()])
                stats.append(moments.take())
                model.zero_grad()
            comm.reduce_workers(workers, stats if comm.moments_due() else None)
            for o in optimizers:                    # the optimizers' state moves (Muon's buffer)
                for p, m in zip(model.parameters(), workers[0]):
                    p.grad = m
                o.step()
            model.zero_grad()
        assert precision.matmul_precisions() == ("tf32", "tf32")   # the model's, outside
    assert any(layer.built for layer in comm.layers.values())       # geometry was built
    assert len(seen) > 20 and set(seen) == {("ieee", "ieee")}, set(seen)
    assert precision.matmul_precisions() == ("none", "none")        # restored
    torch.backends.fp32_precision = "tf32"                          # inheritance restored too
    try:
        assert precision.matmul_precisions() == ("tf32", "tf32")
    finally:
        torch.backends.fp32_precision = "none"


def test_ieee_fp32_restores_the_setting_in_force():
    """ieee_fp32 puts back an explicit setting as it was, also after an exception."""
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(ZeroDivisionError):
            with precision.ieee_fp32():
                assert precision.matmul_precisions() == ("ieee", "ieee")
                1 / 0
        assert precision.matmul_precisions() == ("tf32", "none")
    finally:
        torch.backends.cuda.matmul.fp32_precision = "none"


def test_runtime_turns_tf32_on_so_that_both_views_agree(monkeypatch):
    """On a GPU runtime.setup_distributed lets the model's fp32 matmuls use TF32 so that torch's
    two views of the setting agree: the fp32_precision API says "tf32" and the legacy view
    (allow_tf32, get_float32_matmul_precision, which inductor reads) says so too instead of
    raising (PyTorch #166387: set through the new API alone, the legacy read raises). The
    communicator's ieee_fp32 still overrides it, in both views, and puts it back."""
    from types import SimpleNamespace
    from nanogeo.run import runtime
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    matmul = torch.backends.cuda.matmul
    try:
        runtime.setup_distributed(SimpleNamespace(device="auto"))
        assert matmul.fp32_precision == "tf32"
        assert matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
        with precision.ieee_fp32():
            assert precision.matmul_precisions() == ("ieee", "ieee")
            assert not matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
        assert matmul.fp32_precision == "tf32"
        assert matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    finally:
        restore_precision_defaults()
    assert precision.matmul_precisions() == ("none", "none") and not matmul.allow_tf32


# -----------------------------------------------------------------------------
# the whitening refresh: subspace iteration against compress.py's full eigh

def decaying_moment(d, alpha, seed):
    """A second moment whose eigenvalues fall as i^-alpha along random directions (float64)."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    return (Q * torch.arange(1, d + 1, dtype=torch.float64) ** -alpha) @ Q.T


def metric(U, lam, rest):
    """A^ = U diag(lam) U^T + diag(rest): the metric the low-rank factor whitens with."""
    return (U * lam) @ U.T + torch.diag(rest)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_subspace_eigenpairs_give_the_textbook_metric(alpha):
    """The top-r eigenpairs by subspace iteration (cold, and warm from the factor of an earlier
    moment) give nearly compress.top_eigenpairs' A^: its distance to the exact A^ is a small part
    of A^'s own distance to A (the low-rank approximation's error), also on a flat spectrum."""
    d, r = 256, 32
    A = decaying_moment(d, alpha, 0)
    later = 0.95 * A + 0.05 * decaying_moment(d, alpha, 1)     # the EMA one refresh later
    for moment, start in ((A, None), (later, "warm")):
        exact = metric(*compress.top_eigenpairs(moment, r, 1e-3))
        if start:
            start = compress.eigen_directions(
                compress.whitening_factor(A.float(), r, solver="subspace"))
        fast = metric(*compress.subspace_eigenpairs(moment, r, 1e-3, warm_start=start))
        approximation = torch.linalg.norm(exact - moment)
        assert torch.linalg.norm(fast - exact) < 0.2 * approximation, (alpha, start)
    U, lam, _ = compress.subspace_eigenpairs(A, r, 1e-3)
    exact_lam = compress.top_eigenpairs(A, r, 1e-3)[1]
    assert torch.allclose(lam, exact_lam, rtol=2e-2)                # the eigenvalues
    # orthonormal to Cholesky QR's shift (compress.orthonormal: ~1e-8), not float64's rounding
    assert (U.T @ U - torch.eye(r, dtype=U.dtype)).abs().max() < 1e-7


def test_fast_factor_is_the_textbook_factor_on_a_clear_spectrum():
    """Where A's top r eigenvalues stand clear of the rest, the fast factor is compress.py's:
    the same whitening of a gradient to fp32 rounding (the directions may differ in sign)."""
    d, r = 200, 16
    A = decaying_moment(d, 0.3, 2) * 1e-2 + 10 * metric(
        torch.linalg.qr(torch.randn(d, r, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(3))).Q,
        torch.linspace(1, 4, r, dtype=torch.float64), torch.zeros(d, dtype=torch.float64))
    A = A.float()
    exact = compress.whitening_factor(A, r)
    fast = compress.whitening_factor(A, r, solver="subspace")
    G = torch.randn(48, d, generator=torch.Generator().manual_seed(4))
    fast_G, exact_G = fast.whiten(G), exact.whiten(G)
    assert torch.linalg.norm(fast_G - exact_G) < 1e-4 * torch.linalg.norm(exact_G)
    assert torch.allclose(fast.unwhiten(fast_G), G, atol=1e-4)


def test_the_gain_check_decides_the_same_layers_with_the_fast_refresh():
    """The same run of the published whitening with whiten_solver="subspace" (warm-started at
    every refresh) and "eigh" (compress.py's): every layer decided alike at every step, both
    ways (thresholds set between the layers' gains), with gains within 2 % where A has a
    spectrum to find (on a round A, every choice of the top r directions is an exact answer)."""
    ranks, steps, d_out, d_in = 4, 10, 64, 160
    data = {f"w{i}": compress.planted_gradients(ranks, steps, d_out, d_in, seed=i)
            for i in range(3)}
    round_A = torch.eye(d_in)                   # w3: a round input, nothing to gain
    data["w3"] = [(grads, round_A) for grads, _ in data["w0"]]
    named = [(n, (d_out, d_in)) for n in data]
    runs = {}
    for solver in ("subspace", "eigh"):
        # in plain L2 the planted layers' gain is ~0.8 and the round one's ~1: thresholds
        # between them make the check decide both ways, with margins well above 2 %
        comm = ProductionCommunicator(named, Options(geometry="geofp8", geo_judge="l2",
                                                     min_numel=0, geo_refresh=3, judge_every=1,
                                                     geo_enter_gain=0.9, geo_exit_gain=0.85,
                                                     whiten_solver=solver))
        history = []
        for step in range(steps):
            grads = [[data[n][step][0][w][0] for n in data] for w in range(ranks)]
            moments = ({"input": {n: data[n][step][1] for n in data}}
                       if comm.moments_due() else None)
            comm.reduce_workers(grads, moments)
            history.append({n: (comm.sent_in_geometry(n), comm.layers[n].gain) for n in data})
        runs[solver] = history
    for fast, exact in zip(runs["subspace"], runs["eigh"]):
        assert {n: used for n, (used, _) in fast.items()} == \
            {n: used for n, (used, _) in exact.items()}
        for n in ("w0", "w1", "w2"):    # (w3's A = I: every top-r choice is as good, for eigh too)
            assert fast[n][1] == pytest.approx(exact[n][1], rel=0.02, nan_ok=True), n
    last = runs["eigh"][-1]
    assert not last["w0"][0] and not last["w1"][0] and last["w3"][0]    # both kinds of decision


# -----------------------------------------------------------------------------
# host reads: every .item(), .tolist(), .cpu(), float(t), bool(t), int(t), nonzero and boolean
# mask indexing stops the host on a GPU (it waits for the device). A counter of them, by caller.

READS = ("item", "tolist", "cpu", "__float__", "__bool__", "__int__", "nonzero")


@contextlib.contextmanager
def host_reads(skip=()):
    """Counts the host reads that the project's code (compress.py, train.py, nanogeo/; not the
    tests, not torch) makes while active: {"file:line": count}. `skip`: file names left out."""
    counts = {}
    originals = {name: getattr(torch.Tensor, name) for name in READS + ("__getitem__",)}

    def caller():
        frame = sys._getframe(2)
        path = os.path.abspath(frame.f_code.co_filename)
        if project_code(path) and os.path.basename(path) not in skip:
            key = f"{os.path.relpath(path, ROOT)}:{frame.f_lineno}"
            counts[key] = counts.get(key, 0) + 1

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller()
            return original(self, *args, **kwargs)
        return read

    def getitem(self, index):
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            caller()                    # a masked select: its size is data-dependent
        return originals["__getitem__"](self, index)
    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    torch.Tensor.__getitem__ = getitem
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def row_swaps_rank(rank, world_size, out):
    """FSDP's un-scattering of the core on row blocks, counted."""
    import torch.distributed as dist
    from nanogeo.geometry import rows as row_blocks
    dist.init_process_group("gloo")
    m, n, r = 37, 24, 4
    H = torch.randn(m, n, generator=torch.Generator().manual_seed(0))
    swaps = compress.core_swaps((m, n), r, 16)
    rows = row_blocks.RowBlocks(m)
    with host_reads() as counts:
        [unswapped] = row_blocks.swap_entries_rows([(rows.local(H), swaps, rows)])
    torch.save({"counts": counts, "unswapped": unswapped,
                "expected": rows.local(compress.swap_entries(H, swaps))}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp_row_decode_reads_nothing_on_the_host(tmp_path):
    """FSDP's row decode (inside the reduce-scatter) swaps the core entries back by index
    tensors, not boolean masks: no host read, and the rows compress.swap_entries gives."""
    from conftest import run_ranks
    out = str(tmp_path / "swaps")
    run_ranks(row_swaps_rank, 2, out)
    for rank in (0, 1):
        r = torch.load(f"{out}.{rank}")
        assert r["counts"] == {}, r["counts"]
        assert torch.equal(r["unswapped"], r["expected"])


def test_auto_solver_is_exact_where_layers_are_used_unmeasured():
    """whiten_solver="auto": the fast subspace iteration only where the gain check measures every
    factor before it is used; a listed / profiled / forced layer choice gets the exact eigh."""
    from nanogeo.geometry import layers
    from nanogeo.run import config
    import train
    for flags, solver in ((["--comm=geofp8"], "subspace"),
                          (["--comm=geofp8", "--geo_layers=all"], "eigh"),
                          (["--comm=geofp8", "--whiten_solver=subspace", "--geo_layers=all"],
                           "subspace"),
                          (["--comm=geofp8", "--whiten_solver=eigh"], "eigh")):
        opts = config.geo_options(train.parse_config(flags), vocab_size=100)
        assert layers.whiten_solver(opts) == solver, flags


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    """A rank whose LOCAL_RANK has no GPU (NPROC counted GPUs that CUDA_VISIBLE_DEVICES hides)
    stops with one line naming --nproc_per_node, not torch's 'invalid device ordinal'."""
    import pytest
    from nanogeo.run import runtime
    from nanogeo.run.config import ConfigError
    import train
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device called"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        with pytest.raises(ConfigError, match="--nproc_per_node=1"):
            runtime.setup_distributed(train.parse_config(["--device=cuda"]))
    finally:
        restore_precision_defaults()
