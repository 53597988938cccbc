"""--stage2_fmt: the two-stage collective with stage 2 (the owner's re-quantized mean, gathered)
in a format of its own (nanogeo.wire.collective.TwoFormatLayout), e.g. an NVFP4 all-to-all and an
e4m3 all-gather - its means, its bytes, its errors and a training run."""
import json

import pytest
import torch
import torch.distributed as dist

import compress
import train
from conftest import run_ranks
from nanogeo.parallel import fsdp
from nanogeo.parallel.communicator import Options, ProductionCommunicator
from nanogeo.run.config import ConfigError
from nanogeo.wire import collective
from nanogeo.wire.collective import mean_over_ranks, mean_over_workers

SHAPES = [(33, 17), (5,), (300, 130), (1,), (7, 3, 5), (129,), (0,)]
# (stage 1's format, stage 2's, block, stochastic_stages or None: to nearest)
CASES = [("nvfp4", "e4m3", 128, None), ("nvfp4", "e4m3", 128, "1"), ("nvfp4", "e5m2", 32, None),
         ("e4m3", "nvfp4", 128, None), ("e4m3", "nvfp4", "row", None)]


def rank_tensors(rank):
    g = torch.Generator().manual_seed(40 + rank)
    return [torch.randn(s, generator=g) * 10.0 ** (i - 3) for i, s in enumerate(SHAPES)]


def by_hand(workers, fmt, stage2_fmt, block):
    """The mixed collective's mean built from compress.py's codec alone, piece by piece on the
    layout's pieces: each rank's piece through stage 1's format, the W decoded copies added in
    rank order in fp32, divided by W, through stage 2's format. Also each shard's bytes in the
    two stages."""
    W = len(workers)
    layout = collective.shard_layout(tuple(SHAPES), fmt, block, W, stage2_fmt)
    means = [torch.zeros(s).reshape(-1) for s in SHAPES]
    stage1, stage2 = [0] * W, [0] * W
    for j, (first, second) in enumerate(zip(layout.stage1_layout.pieces,
                                            layout.stage2_layout.pieces)):
        for p1, p2 in zip(first, second):
            assert (p1.index, p1.start, p1.end) == (p2.index, p2.start, p2.end)
            sent = [compress.quantize(w[p1.index].reshape(-1)[p1.start:p1.end].view(p1.shape),
                                      fmt, p1.block) for w in workers]
            stage1[j] += sent[0].buffer.numel()
            total = compress.dequantize(sent[0]).reshape(-1)
            for q in sent[1:]:
                total = total + compress.dequantize(q).reshape(-1)
            again = compress.quantize((total / W).view(p2.shape), stage2_fmt, p2.block)
            stage2[j] += again.buffer.numel()
            means[p1.index][p1.start:p1.end] = compress.dequantize(again).reshape(-1)
    return [m.view(s) for m, s in zip(means, SHAPES)], stage1, stage2


def feedback_communicator():
    """Stage 1's error feedback with stage 2 in its own format (decoded by KeptSends with stage
    1's layout)."""
    return ProductionCommunicator([(f"t{i}", s) for i, s in enumerate(SHAPES)],
                                  Options(geometry="euclidean", fmt="nvfp4", stage2_fmt="e4m3",
                                          error_feedback=True))


def feedback_steps(tensors, reduce):
    """Three steps of a worker's gradients (scaled per step) through `reduce`, in place: the means
    of each step."""
    out = []
    for step in range(3):
        grads = [t * (1 + step) for t in tensors]
        reduce(grads)
        out.append(grads)
    return out


def mixed_rank(rank, world_size, out_path):
    """mean_over_ranks for every case, with the bytes handed to the all_to_all and all_gather;
    and the communicator train.py runs (Options(stage2_fmt=...))."""
    dist.init_process_group("gloo")
    sent, all_gather = [], compress.all_gather_flat

    def record_all_gather(output, input, *args, **kwargs):
        sent.append(input.clone())
        return all_gather(output, input, *args, **kwargs)

    compress.all_gather_flat = record_all_gather
    results = {}
    for fmt, stage2_fmt, block, stages in CASES:
        sent.clear()
        means, nbytes = mean_over_ranks(rank_tensors(rank), fmt, block, stochastic=bool(stages),
                                        seed=3, stages=stages or "both", stage2_fmt=stage2_fmt)
        results[(fmt, stage2_fmt, block, stages)] = (means, nbytes, sent[0])
    comm = ProductionCommunicator([(f"t{i}", s) for i, s in enumerate(SHAPES)],
                                  Options(geometry="euclidean", fmt="nvfp4", stage2_fmt="e4m3"))
    grads = [t.clone() for t in rank_tensors(rank)]
    results["communicator"] = (grads, comm.reduce(grads))
    comm_fb = feedback_communicator()
    results["feedback"] = (feedback_steps(rank_tensors(rank), comm_fb.reduce),
                           comm_fb.residuals[rank])
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def test_mixed_collective_bit_identical_on_ranks_equal_to_simulator_and_by_hand(tmp_path):
    """(2 gloo ranks) Every rank's means are the simulator's, bit for bit, and the hand-built
    mean's (to nearest); the all_gather sends the hand-built stage-2 bytes' count, padded with
    zeros to the largest shard; the bytes each rank counts average to the simulator's."""
    out = str(tmp_path / "mixed")
    run_ranks(mixed_rank, 2, out)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    workers = [rank_tensors(r) for r in range(2)]
    for fmt, stage2_fmt, block, stages in CASES:
        key = (fmt, stage2_fmt, block, stages)
        sim, sim_bytes = mean_over_workers(workers, fmt, block, stochastic=bool(stages), seed=3,
                                           stages=stages or "both", stage2_fmt=stage2_fmt)
        hand, _, stage2 = by_hand(workers, fmt, stage2_fmt, block)
        for r in range(2):
            means, _, gathered = ranks[r][key]
            assert all(torch.equal(m, s) for m, s in zip(means, sim)), key
            assert gathered.numel() == max(stage2) and not gathered[stage2[r]:].any(), key
        if stages is None:
            assert all(torch.equal(m, h) for m, h in zip(sim, hand)), key
        assert (ranks[0][key][1] + ranks[1][key][1]) / 2 == sim_bytes, key
    sim = ProductionCommunicator([(f"t{i}", s) for i, s in enumerate(SHAPES)],
                                 Options(geometry="euclidean", fmt="nvfp4", stage2_fmt="e4m3"))
    means, nbytes = sim.reduce_workers([[t.clone() for t in w] for w in workers])
    for r in range(2):
        assert all(torch.equal(g, m) for g, m in zip(ranks[r]["communicator"][0], means))
    assert (ranks[0]["communicator"][1] + ranks[1]["communicator"][1]) / 2 == nbytes
    fb = feedback_communicator()            # error feedback: means and residuals alike too
    for step in range(3):
        grads = [[t * (1 + step) for t in w] for w in workers]
        means, _ = fb.reduce_workers(grads)
        for r in range(2):
            assert all(torch.equal(g, m) for g, m in zip(ranks[r]["feedback"][0][step], means))
    for r in range(2):
        kept = ranks[r]["feedback"][1]
        assert kept and all(torch.equal(kept[n], fb.residuals[r][n]) for n in kept)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_mixed_stage_bytes_are_each_formats_and_the_mean_is_the_hand_built_one(world):
    """In the simulator: the mean is the hand-built one (decode the NVFP4 copies, mean in fp32,
    e4m3 per piece, decode); stage 1's shards are NVFP4's bytes of the pieces, stage 2's e4m3's,
    and the stage-2 shards are plain e4m3's (the same cut: e4m3's groups of 128); a rank sends
    NVFP4 stage 1 + e4m3 stage 2 (compress.collective_bytes)."""
    workers = [rank_tensors(r) for r in range(world)]
    means, nbytes = mean_over_workers(workers, "nvfp4", 128, stage2_fmt="e4m3")
    hand, stage1, stage2 = by_hand(workers, "nvfp4", "e4m3", 128)
    assert all(torch.equal(m, h) for m, h in zip(means, hand))
    layout = collective.shard_layout(tuple(SHAPES), "nvfp4", 128, world, "e4m3")
    assert layout.nbytes == stage1 and layout.stage2_nbytes == stage2
    assert stage2 == collective.layout(SHAPES, "e4m3", 128, world).nbytes
    for rank in range(world):
        expected = sum(n for j, n in enumerate(stage1) if j != rank) + (world - 1) * max(stage2)
        assert compress.collective_bytes(layout, rank) == expected
    assert nbytes == (0 if world == 1 else
                      sum(compress.collective_bytes(layout, r) for r in range(world)) / world)


def llama_600m_block():
    """One transformer block of llama-600m (d 1280, ffn 3456): its matrices and two gains."""
    d, ffn = 1280, 3456
    return [(d, d)] * 4 + [(ffn, d), (ffn, d), (d, ffn), (d,), (d,)]


def test_mixed_wire_ratio_on_a_llama_600m_block():
    """NVFP4 all-to-all + e4m3 all-gather on a llama-600m block at W = 64: 0.3985x a bf16 ring
    all-reduce, between NVFP4's 0.281x and e4m3's 0.516x (the sum of its halves)."""
    shapes, world = llama_600m_block(), 64
    numel = sum(torch.Size(s).numel() for s in shapes)
    bf16 = collective.ring_allreduce_bytes(numel, 2, world)
    ratio = {name: compress.collective_bytes(
        collective.shard_layout(tuple(shapes), fmt, 128, world, stage2), 0) / bf16
        for name, fmt, stage2 in (("mixed", "nvfp4", "e4m3"), ("nvfp4", "nvfp4", ""),
                                  ("e4m3", "e4m3", ""))}
    assert ratio["nvfp4"] < ratio["mixed"] < ratio["e4m3"]
    assert ratio["mixed"] == pytest.approx((ratio["nvfp4"] + ratio["e4m3"]) / 2, abs=0.002)
    assert 0.39 < ratio["mixed"] < 0.41, ratio


@pytest.mark.parametrize("options, message", [
    (dict(fmt="e4m3", stage2_fmt="nvfp4", collective="fp8-sum"), "fp8-sum collective has none"),
    (dict(fmt="nvfp4", stage2_fmt="e4m3", stochastic_round=True), "stochastic_stages='1'"),
    (dict(fmt="nvfp4", stage2_fmt="e4m3", stochastic_round=True, stochastic_stages="2"),
     "stochastic_stages='1'"),
    (dict(fmt="nvfp4", stage2_fmt="e4m3", error_feedback=True, feedback_stages="both"),
     "feedback_stages='1'"),
    (dict(fmt="nvfp4", stage2_fmt="e4m3", block="row"), "integer block"),
    (dict(fmt="nvfp4", stage2_fmt="e2m1"), "stage2_fmt must be one of"),
])
def test_stage2_fmt_errors_name_the_fix(options, message):
    with pytest.raises(ValueError, match=message) as error:
        Options(geometry="euclidean", **options)
    assert "\n" not in str(error.value)


def test_stage2_fmt_supported_combinations_and_flags():
    assert Options(fmt="e4m3", stage2_fmt="e4m3").stage2_fmt == ""     # the same format: plain
    Options(fmt="nvfp4", stage2_fmt="e4m3", stochastic_round=True, stochastic_stages="1")
    Options(fmt="nvfp4", stage2_fmt="e4m3", error_feedback=True)      # stage 1's residuals
    with pytest.raises(ConfigError, match=r"--stage2_fmt=e3m4 is not one of '', e4m3"):
        train.parse_config(["--stage2_fmt=e3m4"])
    with pytest.raises(ConfigError, match="fp8-sum collective has none"):
        from nanogeo.run import config
        config.geo_options(train.parse_config(["--comm=fp8", "--stage2_fmt=nvfp4",
                                               "--collective=fp8-sum"]), 65)
    with pytest.raises(ValueError, match="no second stage to send in stage2_fmt"):
        fsdp.CompressedReduceScatter(None, geometry="euclidean", fmt="nvfp4", stage2_fmt="e4m3")


def test_stage2_fmt_refused_where_it_cannot_be_honoured():
    """The collective's own entry points, the fidelity tool and a resume refuse what they cannot
    do with a second format in one line, instead of a TypeError, silent rounding to nearest or
    a resume with other numerics; the same format under both names resumes."""
    from nanogeo.run import checkpoint
    from nanogeo.lab import fidelity
    from nanogeo.wire import packing
    tensors = [torch.randn(300)]
    for kwargs in (dict(stochastic=True, seed=1), dict(stochastic=True, seed=1, stages="2"),
                   dict(feedback=packing.ShardFeedback({}))):
        with pytest.raises(ValueError, match="stages='1' and feedback=None") as error:
            mean_over_workers([tensors, tensors], "nvfp4", stage2_fmt="e4m3", **kwargs)
        assert "\n" not in str(error.value)
    mean_over_workers([tensors, tensors], "nvfp4", stochastic=True, seed=1, stages="1",
                      stage2_fmt="e4m3")
    assert fidelity.method_options("nvfp4:stage2_fmt=e4m3", 65).stage2_fmt == "e4m3"
    old = {"config": {"preset": "char-study", "comm": "fp8", "fmt": "e4m3"}}   # before the flag
    with pytest.raises(ConfigError, match="is a --stage2_fmt='' run"):
        checkpoint.check_resumable(old, "ckpt.pt", train.parse_config(
            ["--preset=char-study", "--comm=fp8", "--stage2_fmt=nvfp4"]), 1)
    checkpoint.check_resumable(old, "ckpt.pt", train.parse_config(
        ["--preset=char-study", "--comm=fp8", "--stage2_fmt=e4m3", "--bucket_mb=0"]), 1)
    # (e4m3 both ways; and one bucket, as every checkpoint from before --bucket_mb)


def test_scale_groups_of_an_empty_tensor():
    assert compress.scale_groups(torch.empty(0), 128).shape == (0, 128)
    assert compress.scale_groups(torch.empty(0), compress.NVFP4_BLOCK).shape == (0, 16)


def test_train_with_an_e4m3_stage_2_logs_a_wire_between_nvfp4_and_e4m3(tiny_corpus, tmp_path):
    """train.py --fmt=nvfp4 --stage2_fmt=e4m3 with 4 simulated ranks finishes, and its logged
    wire ratio lies between plain NVFP4's and plain e4m3's."""
    wire = {}
    for name, extra in (("mixed", ["--fmt=nvfp4", "--stage2_fmt=e4m3"]),
                        ("nvfp4", ["--fmt=nvfp4"]), ("e4m3", [])):
        out = tmp_path / name
        summary = train.train(train.parse_config([
            "--preset=char-study", f"--data_dir={tiny_corpus}", f"--out_dir={out}",
            "--device=cpu", "--max_iters=2", "--batch_size=2", "--block_size=32",
            "--eval_iters=1", "--eval_interval=2", "--final_evals=1", "--warmup_iters=1",
            "--simulate_workers=4", "--comm=fp8", *extra]))
        steps = [json.loads(l) for l in open(out / "log.jsonl") if '"step"' in l]
        assert steps and summary["mean_wire_vs_bf16"] == steps[-1]["wire_vs_bf16"]
        wire[name] = summary["mean_wire_vs_bf16"]
    assert wire["nvfp4"] < wire["mixed"] < wire["e4m3"], wire


def test_fidelity_counts_each_stage_in_its_own_format():
    """The fidelity tool's bytes per tensor of the mixed wire: its stage-1 pieces in NVFP4 and
    its stage-2 pieces in e4m3, (W - 1) / W of both stages' shard sizes in all."""
    from nanogeo.lab import fidelity
    shapes, world = ((300, 7), (64,), (5, 130)), 4
    mixed = collective.shard_layout(shapes, "nvfp4", 128, world, "e4m3")
    total = sum(fidelity.tensor_bytes(mixed, i) for i in range(len(shapes)))
    assert total == (world - 1) / world * (sum(mixed.nbytes) + sum(mixed.stage2_nbytes))
    plain = collective.shard_layout(shapes, "nvfp4", 128, world)
    assert sum(fidelity.tensor_bytes(plain, i) for i in range(len(shapes))) < total
