"""Faults the communicator must survive without a silent wrong result: a non-finite gradient
(an fp16 GradScaler overflow, a bad batch) on a refresh step, stochastic-rounding streams
that must not repeat across buckets, and ranks whose geometry differs."""

import datetime
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from nanogeo.geometry import agreement, update_error
from nanogeo.wire import collective, kernels
from test_published import anisotropic_moment
from nanogeo.parallel.communicator import Options, ProductionCommunicator


def workers_at(step, world=2, shape=(48, 64)):
    g = torch.Generator().manual_seed(step)
    U, V = torch.randn(shape[0], 3, generator=g), torch.randn(shape[1], 3, generator=g)
    return [[U @ V.T + 0.1 * torch.randn(*shape, generator=g)] for _ in range(world)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_sees_one_bad_element_anywhere(bad):
    """agreement.all_finite reads each tensor's (min, max): one NaN, +inf or -inf at any position
    (vectorised body or tail, first or last) of any tensor, in fp32, bf16 or fp16, makes it
    False; also in a list that mixes dtypes."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensors = [torch.randn(5, 7).to(dtype), torch.randn(1037).to(dtype), torch.zeros(0)]
        assert bool(agreement.all_finite(tensors))
        for i, t in enumerate(tensors[:2]):
            for position in (0, 1, 15, 16, 17, t.numel() // 2, t.numel() - 1):
                broken = [u.clone() for u in tensors]
                broken[i].view(-1)[position] = bad
                assert not bool(agreement.all_finite(broken)), (dtype, i, position)
    assert bool(agreement.all_finite([])) and bool(agreement.all_finite([torch.zeros(0)]))
    mixed = [torch.randn(33).bfloat16(), torch.randn(40)]
    assert bool(agreement.all_finite(mixed))
    mixed[0][32] = bad
    assert not bool(agreement.all_finite(mixed))


@pytest.mark.parametrize("geometry", ["subspace", "geofp8", "hadamard"])
def test_a_non_finite_step_does_not_poison_the_geometry_or_the_residuals(geometry):
    """An inf gradient on a refresh step: that step's mean is inf (the optimizer skips it), but
    the bases / factors and the error-feedback residuals stay as they were, and every later
    step decodes finite means - with or without the fault, the same geometry."""
    opts = Options(geometry=geometry, geo_refresh=2, judge_every=2, min_numel=16,
                               geo_rank=4, whiten_rank=4, error_feedback=True, select="all")
    clean, faulty = (ProductionCommunicator([("w", (48, 64))], opts) for _ in range(2))
    moment = {"input": {"w": anisotropic_moment(64, 0)}} if geometry == "geofp8" else None
    fault = 2 if geometry == "geofp8" else 3        # a step that refreshes the geometry
    for step in range(6):
        workers = workers_at(step)
        clean.reduce_workers(workers, moment if step % 2 == 0 else None)
        if step == fault:
            workers = [[workers[0][0].clone().fill_(float("inf"))], workers[1]]
            state_before = [t.clone() for t in faulty.layers["w"].tensors()]
        means, _ = faulty.reduce_workers(workers, moment if step % 2 == 0 else None)
        if step == fault:
            assert not torch.isfinite(means[0]).all()
            assert all(torch.equal(a, b) for a, b in zip(state_before, faulty.layers["w"].tensors()))
            assert faulty.skipped == 1
        else:
            assert torch.isfinite(means[0]).all()
        assert all(torch.isfinite(r["w"]).all() for r in faulty.residuals.values())
    assert faulty.sent_in_geometry("w")
    assert all(torch.isfinite(t).all() for t in faulty.layers["w"].tensors())


def geometry_check_rank(rank, world_size, out):
    """The check that follows every refresh, on 3 ranks: a geometry estimated from different
    statistics on every rank (as a nondeterministic kernel might produce) - bases over the
    subgroup of ranks 1 and 2 and over all ranks, whitening factors and Hadamard signs (from
    another seed on every rank) over all ranks; the same bases everywhere; a geometry on rank 0
    only."""
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    pair = dist.new_group([1, 2], timeout=timeout)      # every rank takes part in creating it

    def check(seed, group, geometry="subspace", ready=True):
        opts = Options(geometry=geometry, select="all", min_numel=16, geo_rank=4,
                                   whiten_rank=4, seed=seed)
        layer = ProductionCommunicator([("w", (48, 64))], opts).layers["w"]
        if ready and geometry in ("subspace", "hadamard"):
            layer.refresh(workers_at(step=seed)[0][0])
        elif ready:
            layer.refresh({"input": anisotropic_moment(64, seed=seed)})
        if ready:
            layer.use_geo, layer.gain = seed == 0, 1.1 + seed       # 1.1: not exact in fp32
        before = ([t.clone() for t in layer.tensors()], layer.flags()) if ready else ([], [])
        try:
            repaired = agreement.verify_geometry([layer], group, 7, torch.device("cpu"))
        except RuntimeError as e:
            return {"error": str(e)}
        return {"repaired": repaired, "before": before, "after": (layer.tensors(), layer.flags())}

    result = {"pair": check(rank, pair) if rank in (1, 2) else None,
              "all": check(rank, None), "geofp8": check(rank, None, "geofp8"),
              "hadamard": check(rank, None, "hadamard"),
              "same": check(0, None), "some": check(0, None, ready=rank == 0)}
    torch.save(result, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_a_geometry_that_differs_across_ranks_is_replaced_by_rank_0s(tmp_path):
    out = str(tmp_path / "geometry")
    run_ranks(geometry_check_rank, 3, out)
    ranks = [torch.load(f"{out}.{r}") for r in range(3)]
    for case, members in (("all", ranks), ("geofp8", ranks), ("hadamard", ranks),
                          ("pair", ranks[1:])):
        source_tensors, source_flags = members[0][case]["before"]     # the group's rank 0
        assert not all(torch.equal(a, b) for a, b in zip(source_tensors,
                                                         members[1][case]["before"][0]))
        for r in members:
            tensors, flags = r[case]["after"]
            assert r[case]["repaired"] and flags == source_flags
            assert all(torch.equal(a, b) for a, b in zip(tensors, source_tensors))
    for r in ranks:
        assert not r["same"]["repaired"]
        assert all(torch.equal(a, b) for a, b in zip(r["same"]["after"][0], r["same"]["before"][0]))
        assert "different layers" in r["some"]["error"]


def test_stochastic_rounding_streams_differ_between_tensor_lists():
    """Two buckets with the same layout, the same gradients and the same step must not round
    alike (their errors would add up instead of averaging out); the same bucket twice must."""
    opts = Options(geometry="euclidean", stochastic_round=True, seed=3)
    workers = workers_at(0)

    def mean(names):
        comm = ProductionCommunicator([(n, (48, 64)) for n in names], opts)
        return comm.reduce_workers(workers)[0][0]
    assert torch.equal(mean(["a.weight"]), mean(["a.weight"]))
    assert not torch.equal(mean(["a.weight"]), mean(["b.weight"]))


def test_the_fp8_codec_stays_eager_on_gpus_without_float8_casts(monkeypatch, capsys):
    """Triton cannot cast to float8 below compute capability 8.9 (A100, A10): compiling the
    codec there keeps it eager, with a one-line notice."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    try:
        kernels.compile_hot_path(True)
        assert kernels.state["float8_eager"]
        assert "below sm_89" in capsys.readouterr().out
        assert not kernels.compiled()               # the float8 casts stay plain functions
        x = torch.randn(4, 128)
        means, _ = collective.mean_over_workers([[x], [x]])
        assert ((means[0] - x).abs() <= x.abs() / 8 + 1e-3).all()
    finally:
        kernels.compile_hot_path(False)
    assert not kernels.state["float8_eager"] and not kernels.compiled()


def test_the_fp8_codec_stays_eager_on_a_big_endian_host(monkeypatch, capsys):
    """The fused packing cuts a scale's bytes little-endian (as .view(torch.uint8) gives them on
    x86 and ARM): on a big-endian host compiling keeps the codec eager, with a one-line notice."""
    monkeypatch.setattr(sys, "byteorder", "big")
    try:
        kernels.compile_hot_path(True)
        assert not kernels.compiled() and "big-endian" in capsys.readouterr().out
    finally:
        kernels.compile_hot_path(False)


class HostSyncs:
    """Counts the calls that make the host wait for the device (item, tolist, cpu, numpy,
    bool) while it is active."""
    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("options", [
    dict(geometry="subspace", geo_refresh=4),
    dict(geometry="geofp8", geo_refresh=50, judge_every=4),
    dict(geometry="subspace", geo_refresh=4, error_feedback=True),
    dict(geometry="euclidean", fmt="e5m2", collective="fp8-sum", error_feedback=True)])
@pytest.mark.parametrize("optimizer", [None, "adamw"])
def test_no_host_sync_between_geometry_steps(monkeypatch, options, optimizer):
    """The step path (encode, collective, decode, residuals) never waits for the device; only
    steps that touch the geometry (refresh, gain check) do, a few times - also when the gain
    check reads AdamW's state (its step counter is a tensor, on the GPU when fused)."""
    opts = Options(min_numel=16, geo_rank=4, whiten_rank=4, **options)
    comm = ProductionCommunicator([("w", (48, 64)), ("b", (64,))], opts)
    if optimizer:
        state = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(48, 64),
                 "exp_avg_sq": torch.full((48, 64), 1e-2)}
        comm.watch({"w": update_error.OptimizerView(
            "adamw", lambda: {"betas": (0.9, 0.95), "eps": 1e-8}, lambda: state)})
    moment = {"input": {"w": anisotropic_moment(64, 0)}, "tokens": {"input": {"w": 64}}}
    per_step = []
    for step in range(9):
        grads = [workers_at(step)[0][0].clone(), torch.randn(64)]
        counter = HostSyncs(monkeypatch)
        comm.reduce(grads, moment if comm.moments_due() else None)
        per_step.append(counter.count)
        monkeypatch.undo()
    # subspace: bases at step 0 and every 4 steps (3, 7), each measured at the next step (1, 4,
    # 8); whiten: factors at step 0, measured at step 1, re-judged every 4 steps (3, 7)
    geometry_steps = [0, 1, 3, 7] + ([4, 8] if options["geometry"] == "subspace" else [])
    assert all(c == 0 for s, c in enumerate(per_step) if s not in geometry_steps), per_step
    assert max(per_step) <= 4, per_step                 # geometry steps: a few transfers
    if options["geometry"] != "euclidean":
        assert max(per_step) > 0, per_step              # (the counter does see them)
