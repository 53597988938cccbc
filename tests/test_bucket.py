"""Bucketing the explicit path (issue 50, item 4; nanogeo/wire/buckets.py): the gradients are
averaged a bucket of --bucket_mb MiB at a time, each mean written back in place, so a step
holds one bucket's temporaries instead of several copies of the model's gradients."""
import json
import math

import pytest
import torch

import compress
import train
from conftest import run_ranks
from nanogeo.parallel.communicator import Options, ProductionCommunicator
from nanogeo.wire import buckets
from test_train import tiny_args, train_rank


# ---------------------------------------------------------------------------- the plan

SHAPES = [(300, 64), (64,), (128, 200), (7,), (3000, 33)]
SMALL_MB = 40_000 * 4 / 2 ** 20     # buckets of 40,000 fp32 elements: SHAPES make 5


def test_the_plan_fills_buckets_in_order_and_cuts_only_whole_scale_groups():
    plan = buckets.codec_plan(SHAPES, SMALL_MB, "e4m3", 128)
    segments = [s for bucket in plan for s in bucket]
    # every element once, tensor after tensor; a tensor that fits whole, in its own shape
    assert [[(s.index, s.start, s.end) for s in bucket] for bucket in plan] == [
        [(0, 0, 19200), (1, 0, 64)], [(2, 0, 25600), (3, 0, 7)],
        [(4, 0, 39936)], [(4, 39936, 79872)], [(4, 79872, 99000)]]
    assert [s.shape for s in segments][:4] == SHAPES[:4]
    assert all(s.start % 128 == 0 for s in segments)            # whole groups of 128
    assert all(sum(s.end - s.start for s in bucket) <= 40_000 for bucket in plan)
    # row scaling: whole rows, shaped as rows; one scale per tensor (share): never cut
    rows = [s for b in buckets.codec_plan(SHAPES, SMALL_MB, "e4m3", "row") for s in b]
    assert [s.shape for s in rows if s.index == 4] == [(1212, 33), (1212, 33), (576, 33)]
    whole = buckets.codec_plan(SHAPES, SMALL_MB, "e4m3", "tensor")
    assert [s.shape for b in whole for s in b] == SHAPES and len(whole) == 3
    # NVFP4: blocks of 16; bucket_mb=0: one bucket of whole tensors
    assert all(s.start % 16 == 0 for b in buckets.codec_plan(SHAPES, SMALL_MB, "nvfp4", 128)
               for s in b)
    assert buckets.codec_plan(SHAPES, 0, "e4m3", 128) == [
        [buckets.Segment(t, 0, math.prod(s), s, math.prod(s)) for t, s in enumerate(SHAPES)]]
    with pytest.raises(ValueError, match="bucket_mb must be >= 0"):
        buckets.codec_plan(SHAPES, -1, "e4m3", 128)


def test_a_negative_bucket_size_is_refused_with_the_fix():
    with pytest.raises(train.ConfigError, match="--bucket_mb must be >= 0"):
        train.parse_config(["--bucket_mb=-1"])
    with pytest.raises(ValueError, match="bucket_mb must be >= 0"):
        Options(bucket_mb=-1)


# ---------------------------------------------------------------------------- the numerics

def workers_of(shapes, world, steps, seed=0):
    """[step][worker] -> gradients of `shapes`: matrices of rank 4 plus noise (a dominant
    subspace for the rotation to find), vectors plain noise."""
    g = torch.Generator().manual_seed(seed)
    bases = {s: (torch.randn(s[0], 4, generator=g), torch.randn(4, s[1], generator=g))
             for s in shapes if len(s) == 2}
    def one(s):
        noise = torch.randn(s, generator=g)
        return noise if len(s) != 2 else bases[s][0] @ bases[s][1] * 3 + noise
    return [[[one(s) for s in shapes] for _ in range(world)] for _ in range(steps)]


# (options, equal bit for bit at any bucket size): FP8's scales are per group, and a cut never
# splits one; NVFP4's per piece, which the buckets cut (the ranks and the simulator alike)
FP8_CODECS = [dict(geometry="euclidean"),
              dict(geometry="euclidean", fmt="e5m2", block=32),
              dict(geometry="euclidean", block="row"),
              dict(geometry="euclidean", block="tensor"),
              dict(geometry="euclidean", collective="fp8-sum", fmt="e5m2", sum_order="tree"),
              dict(geometry="euclidean", error_feedback=True, feedback_stages="both"),
              dict(geometry="subspace", select="all", geo_refresh=2, error_feedback=True,
                   geo_judge="l2"),
              dict(geometry="subspace", geo_refresh=2, geo_judge="l2"),
              dict(geometry="hadamard", select="all", geo_judge="l2"),
              dict(geometry="euclidean", stage2_fmt="e5m2")]


@pytest.mark.parametrize("options", FP8_CODECS,
                         ids=["e4m3", "e5m2-32", "row", "tensor", "fp8-sum-tree", "feedback",
                              "subspace", "subspace-gain", "hadamard", "stage2-e5m2"])
def test_bucketed_means_equal_one_buckets_where_the_scale_groups_are_the_same(options):
    """Simulated ranks (reduce_workers) over several steps: the means and bytes of five
    buckets (a matrix cut in three) against one bucket, bit for bit; the geometry alike."""
    named = [(f"t{i}", s) for i, s in enumerate(SHAPES)]
    runs = []
    for mb in (0, SMALL_MB):
        comm = ProductionCommunicator(named, Options(bucket_mb=mb, geo_warmup=1, min_numel=1000,
                                                     **options))
        runs.append([comm.reduce_workers(step) for step in workers_of(SHAPES, 3, 5)] + [comm])
    assert len(runs[1][-1].buckets()) == (3 if runs[1][-1].opts.block == "tensor" else 5)
    for (one_means, one_bytes), (many_means, many_bytes) in zip(runs[0][:-1], runs[1][:-1]):
        assert all(torch.equal(a, b) for a, b in zip(one_means, many_means))
        assert abs(many_bytes / one_bytes - 1) < 0.01       # (the padding of more all_gathers)
    one, many = runs[0][-1], runs[1][-1]
    assert [one.coords(n) for n in one.layers] == [many.coords(n) for n in many.layers]
    for w, residual in one.residuals.items():      # stage 1's, per tensor (stage 2's per shard
        assert all(torch.equal(residual[n], many.residuals[w][n]) for n, _ in named  # of a
                   if n in residual)                                                 # bucket)


def test_nvfp4_buckets_cut_its_tensor_scales_and_the_simulator_cuts_alike():
    """NVFP4's fp32 scale is per piece (a rank's share of a tensor in a bucket): buckets change
    its numerics, by about its own error, while every rank and the simulator cut the same."""
    named = [(f"t{i}", s) for i, s in enumerate(SHAPES)]
    [step] = workers_of(SHAPES, 3, 1)
    exact = [torch.stack(ts).mean(0) for ts in zip(*step)]
    means = [ProductionCommunicator(named, Options(geometry="euclidean", fmt="nvfp4",
                                                   bucket_mb=mb)).reduce_workers(step)[0]
             for mb in (0, SMALL_MB)]
    assert not all(torch.equal(a, b) for a, b in zip(*means))
    error = [sum((m - e).pow(2).sum() for m, e in zip(ms, exact)).sqrt() for ms in means]
    assert 0.8 < float(error[1] / error[0]) < 1.25


@pytest.mark.parametrize("options", [dict(geometry="subspace", geo_refresh=2, geo_judge="l2"),
                                     dict(geometry="subspace", geo_refresh=2, fmt="nvfp4",
                                          error_feedback=True, geo_judge="l2"),
                                     dict(geometry="geofp8", geo_refresh=2, judge_every=2,
                                          geo_judge="l2", select="all")],
                         ids=["subspace", "subspace-nvfp4-feedback", "whitening"])
def test_in_place_reduce_equals_reduce_workers_and_judges_alike(options):
    """reduce() writes each mean into its gradient as it is decoded and measures the layers
    the gain check judges right then (judged_next); reduce_workers() returns new means and
    measures after. One worker, five buckets, eight steps: the same means, gains, decisions."""
    named = [(f"t{i}", s) for i, s in enumerate(SHAPES)]
    opts = dict(bucket_mb=SMALL_MB, geo_warmup=1, min_numel=1000, **options)
    in_place, apart = (ProductionCommunicator(named, Options(**opts)) for _ in range(2))
    measure_now, measured = in_place.measure_now, []
    in_place.measure_now = lambda name, *args: measured.append(name) or measure_now(name, *args)
    moments = {"input": {n: torch.eye(s[1]) + 0.1 for n, s in named if len(s) == 2}}
    for step, [grads] in enumerate(workers_of(SHAPES, 1, 8)):
        stats = moments if in_place.moments_due() else None
        expected, _ = apart.reduce_workers([[g.clone() for g in grads]], stats)
        in_place.reduce(grads, stats)
        assert all(torch.equal(g, m) for g, m in zip(grads, expected)), step
        assert [(l.gain, l.use_geo) for l in in_place.layers.values()] == \
            [(l.gain, l.use_geo) for l in apart.layers.values()] or \
            all(math.isnan(a.gain) and math.isnan(b.gain) for a, b in
                zip(in_place.layers.values(), apart.layers.values())), step
    assert any(l.use_geo for l in in_place.layers.values())        # the geometry was used
    assert any(not math.isnan(l.gain) for l in in_place.layers.values())      # and judged,
    assert measured                     # on measurements taken as the means were decoded


def test_proposals_repaired_after_in_place_measurements_are_measured_on_the_next_step(
        monkeypatch):
    """(Rare) the agreement check finds the ranks' proposals differed and repairs them with
    rank 0's, after an in-place step measured them - on gradients now overwritten by their
    means. They are neither judged on those measurements nor lost: they stay proposals,
    measured on the next step's gradients."""
    from nanogeo.geometry import agreement
    named = [(f"t{i}", s) for i, s in enumerate(SHAPES)]
    comm = ProductionCommunicator(named, Options(geometry="subspace", geo_refresh=2, geo_warmup=1,
                                                 min_numel=1000, geo_judge="l2",
                                                 bucket_mb=SMALL_MB))
    steps = iter(workers_of(SHAPES, 1, 8))
    while not comm.proposals:
        comm.reduce(next(steps)[0])
    proposed = dict(comm.proposals)
    comm.pending = (torch.ones(len(comm.layers) + 1), list(proposed.values()), comm.steps_taken)
    monkeypatch.setattr(agreement, "repair_geometry", lambda *args: True)   # "repaired"
    comm.reduce(next(steps)[0])
    assert set(comm.proposals) == set(proposed) and comm.skipped == 0
    assert all(comm.proposals[n] is layer for n, layer in proposed.items())
    assert all(math.isnan(layer.gain) for layer in comm.proposals.values())
    monkeypatch.undo()
    comm.reduce(next(steps)[0])
    assert not comm.proposals and all(not math.isnan(comm.layers[n].gain) for n in proposed)


# ---------------------------------------------------------------------------- 2 ranks

CHAR_STUDY_MB = 0.02        # 5,242 elements a bucket: char-study's 21 tensors in 28, 8 cut in 22


@pytest.mark.parametrize("extra", [
    ["--comm=fp8", "--fmt=nvfp4", "--stochastic_round", "--error_feedback",
     "--feedback_stages=both"],
    ["--comm=subspace", "--geo_warmup=2", "--geo_refresh=2", "--error_feedback", "--log_stages"],
    ["--comm=fp8", "--collective=fp8-sum", "--fmt=e5m2"],
    ["--comm=bf16"]], ids=["nvfp4-stochastic-feedback", "subspace-feedback", "fp8-sum", "bf16"])
def test_several_buckets_on_two_ranks_equal_the_simulator(tiny_corpus, tmp_path, extra):
    """A real 2-rank gloo run with several buckets (tensors cut among them) ends bit-equal to
    --simulate_workers=2, which cuts its buckets alike."""
    from model import model_config, Llama
    with torch.device("meta"):
        shapes = [p.shape for p in Llama(model_config("char-study")).parameters()]
    plan = buckets.codec_plan(shapes, CHAR_STUDY_MB, "e4m3", 128)
    assert len(plan) == 28 and sum(not buckets.is_whole(s) for b in plan for s in b) == 22
    flags = ["--max_iters=8", "--eval_interval=8", "--log_interval=4",
             f"--bucket_mb={CHAR_STUDY_MB}", *extra]
    run_ranks(train_rank, 2, tiny_args(tiny_corpus, tmp_path / "real", *flags), str(tmp_path))
    real = json.load(open(tmp_path / "rank0.json"))
    simulated = train.train(train.parse_config(
        tiny_args(tiny_corpus, tmp_path / "sim", "--simulate_workers=2", *flags)))
    assert simulated["param_sha256"] == real["param_sha256"]
    logs = [[json.loads(l) for l in open(tmp_path / d / "log.jsonl") if '"loss"' in l]
            for d in ("real", "sim")]
    assert [l["loss"] for l in logs[0]] == [l["loss"] for l in logs[1]]
    # bytes: rank 0's against the ranks' average (28 all_gathers, each padded to its largest shard)
    assert all(abs(a["wire_bytes"] / b["wire_bytes"] - 1) < 1e-2 for a, b in zip(*logs))


def test_resume_with_several_buckets_is_exact_and_keeps_its_bucket_size(tiny_corpus, tmp_path,
                                                                        monkeypatch):
    """Interrupted at step 4, resumed from step 3 = never interrupted, bit for bit, with stage
    2's error feedback kept per bucket (as residuals[rank]["stage 2 k"]) and stochastic
    rounding's per-bucket streams; a resume with another --bucket_mb is refused, naming it."""
    from test_reliability import interrupted_and_resumed
    extra = ("--max_iters=6", "--ckpt_interval=3", "--comm=fp8", "--fmt=nvfp4", "--error_feedback",
             "--feedback_stages=both", "--stochastic_round", "--simulate_workers=2",
             f"--bucket_mb={CHAR_STUDY_MB}")
    whole, resumed = interrupted_and_resumed(tiny_corpus, tmp_path, monkeypatch, extra)
    assert resumed["param_sha256"] == whole["param_sha256"]
    residuals = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["communicator"][
        "residuals"]
    assert {"stage 2", "stage 2 27"} <= set(residuals[0]) | set(residuals[1])
    with pytest.raises(train.ConfigError, match="--bucket_mb=0.02"):
        train.train(train.parse_config(tiny_args(tiny_corpus, tmp_path / "b", *extra[:-1],
                                                 "--bucket_mb=1", "--resume", "--max_iters=8")))


# ---------------------------------------------------------------------------- memory

def reduce_peak_rank(rank, world_size, argv, out):
    """train.train with reduce_gradients inside a MemoryPeak: per step, the most bytes of new
    storage alive at once inside it, and the gradients' bytes."""
    from nanogeo.lab.probes import MemoryPeak
    reduce, peaks = train.reduce_gradients, []

    def measured(params, *args, **kwargs):
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
        with MemoryPeak() as mem:
            sent = reduce(params, *args, **kwargs)
        peaks.append((mem.peak, grad_bytes))
        return sent
    train.reduce_gradients = measured
    try:
        train.train(train.parse_config(argv))
    finally:
        train.reduce_gradients = reduce
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(peaks, f)


@pytest.mark.parametrize("flags", [["--comm=fp8"], ["--comm=fp8", "--fmt=nvfp4"],
                                   ["--comm=subspace", "--geo_warmup=2"], ["--comm=bf16"]],
                         ids=["fp8", "nvfp4", "subspace", "bf16"])
def test_peak_memory_inside_the_reduce_stays_below_the_gradients(bpe_corpus, tmp_path, flags):
    """cpu-tiny (13.7M parameters, 6.4M in each of its two vocabulary matrices: cut among the
    buckets), rank 0 of 2 gloo ranks, --bucket_mb=4: at most 1.0x the gradients' bytes of new
    storage alive at once inside reduce_gradients, on every step, the rotation's judged and
    refresh steps included (one bucket, before: 3.0x for FP8 and the rotation, 5.0x for NVFP4,
    2.5x for bf16's cast copies; BENCHMARKS.md section 21)."""
    argv = tiny_args(bpe_corpus, tmp_path / "out", "--preset=cpu-tiny", "--max_iters=8",
                     "--batch_size=1", "--block_size=16", "--eval_interval=8", "--eval_iters=1",
                     "--bucket_mb=4", *flags)
    out = str(tmp_path / "peaks")
    run_ranks(reduce_peak_rank, 2, argv, out)
    peaks = [peak / grads for peak, grads in json.load(open(f"{out}.0.json"))]
    print(flags, [round(p, 3) for p in peaks])
    assert max(peaks) <= 1.0, peaks


def test_the_loopback_group_answers_as_a_second_rank_holding_the_same_gradients():
    """nanogeo.lab.reduce_memory measures rank 0 of 2 in one process: its Loopback group answers
    every collective at once, with buffers of the sizes a second rank would fill. Its
    all_to_all brings W copies of this rank's own shard (what identical ranks send it), its
    all_gather W copies of this rank's input (other ranks would send their own shards: same
    sizes, other values), a SUM W times the value. Through it rank 0's reduce sends the bytes
    the simulator counts, and one bucket's peak is the 3.0x of 2 gloo ranks (BENCHMARKS.md
    section 21)."""
    import torch.distributed as dist
    from nanogeo.lab import reduce_memory
    named = [(f"t{i}", s) for i, s in enumerate(SHAPES)]
    [[grads]] = workers_of(SHAPES, 1, 1)
    options = Options(geometry="euclidean", bucket_mb=SMALL_MB)
    reduce_memory.join_loopback(2)
    try:
        x, out = torch.arange(4.0), torch.empty(4)
        dist.all_to_all_single(out, x, [2, 2], [2, 2])
        assert out.tolist() == [0, 1, 0, 1]
        compress.all_gather_flat(out, x[2:])
        assert out.tolist() == [2, 3, 2, 3]
        dist.all_reduce(x)
        assert x.tolist() == [0, 2, 4, 6]
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        assert x.tolist() == [0, 2, 4, 6]
        sent = ProductionCommunicator(named, options).reduce([g.clone() for g in grads])
        [(one_bucket, grad_bytes, _)] = reduce_memory.reduce_peaks(
            "char-study", dict(geometry="euclidean", bucket_mb=0), steps=1)
    finally:
        dist.destroy_process_group()
    plan = ProductionCommunicator(named, options).buckets()
    layouts = [compress.ShardLayout([s.shape for s in b], "e4m3", 128, 2) for b in plan]
    assert sent == sum(compress.collective_bytes(layout, 0) for layout in layouts)
    assert 2.9 < one_bucket / grad_bytes < 3.1


def test_bf16_gradients_average_in_place_and_refresh_from_the_fp32_mean():
    """A bf16 model's gradients (a DDP hook's bucket) are averaged in place like fp32 ones: each
    gradient gets its mean rounded to bf16, while the geometry (the refresh, the finiteness
    check) reads the fp32 mean - the CPU's triangular solves (the subspace iteration's and the
    Householder completion's) take no bf16, and the refresh would otherwise see the rounded one.
    The rotation is built and its means are those of fp32 copies of the same gradients, rounded
    to bf16."""
    named = [(f"t{i}", s) for i, s in enumerate(SHAPES)]
    options = dict(geometry="subspace", geo_warmup=0, geo_refresh=1, geo_judge="l2",
                   bucket_mb=SMALL_MB)
    low, high = (ProductionCommunicator(named, Options(**options)) for _ in range(2))
    for [grads] in workers_of(SHAPES, 1, 3):
        bf16 = [g.bfloat16() for g in grads]
        fp32 = [g.float() for g in bf16]
        low.reduce(bf16)
        high.reduce(fp32)
        assert all(b.dtype == torch.bfloat16 for b in bf16)
        assert all(torch.equal(b, f.bfloat16()) for b, f in zip(bf16, fp32))
    assert low.layers and all(layer.built for layer in low.layers.values())


def test_a_checkpoint_from_before_the_buckets_resumes_only_as_one_bucket():
    """A checkpoint written before --bucket_mb averaged the model as one bucket (its stage-2
    residual is one shard of the whole model): resuming it with buckets is refused, naming
    --bucket_mb=0."""
    import types
    from nanogeo.run import checkpoint
    from nanogeo.run.config import ConfigError
    old = {"config": {"optimizer": "adamw", "fmt": "e4m3", "stage2_fmt": ""}}
    run = dict(optimizer="adamw", fmt="e4m3", stage2_fmt="", error_feedback=False)
    with pytest.raises(ConfigError, match="--bucket_mb=0.0 run"):
        checkpoint.check_resumable(old, "ckpt.pt", types.SimpleNamespace(**run, bucket_mb=25.0), 1)
    checkpoint.check_resumable(old, "ckpt.pt", types.SimpleNamespace(**run, bucket_mb=0.0), 1)
