"""Kernel launches and host waits inside train.py's reduce_gradients (issue 50, items 2 and 3):
its communicator's step counted on rank 0 of 2 gloo ranks by nanogeo.lab.launches
(nanogeo.lab.probes.OpCounter), over steps 10-30 of a run that logs and evaluates only after
them. Deterministic counts: no timing.

Before issue 50, `--comm=subspace` at cpu-tiny (this file's setting) made 7.14 syncing calls per
step (an SVD per matrix and refresh, and two tensors made from Python lists at each agreement
check) and 2,947 kernel launches per step (6,301 on a refresh step); now its matrices of one
shape go through together (nanogeo.geometry.batched): 0.95 syncing calls (one SVD per shape
group and refresh, whatever the number of matrices) and 498 launches (677)."""
import pytest

from conftest import run_ranks
from nanogeo.lab import launches
from test_train import tiny_args

FIRST, LAST = 10, 30


def counted(tmp_path, corpus, *flags, model=None):
    """nanogeo.lab.launches.summarize of rank 0's reductions over steps FIRST..LAST; `model`:
    changes to --preset's model shapes (model.PRESETS) in the ranks."""
    out_dir = tmp_path / "-".join(f.strip("-").replace("=", "_") for f in flags)
    argv = [*tiny_args(corpus, out_dir), *flags,
            *launches.step_flags(FIRST, LAST, out_dir)]
    out = str(out_dir) + ".jsonl"
    run_ranks(counted_rank, 2, model or {}, argv, out)
    return launches.summarize(launches.read_records(out))


def counted_rank(rank, world_size, changes, argv, out):
    """train.train on one rank inside launches.counting, its --preset's model shapes changed
    by `changes`."""
    import model
    import train
    preset = next(a.split("=", 1)[1] for a in reversed(argv) if a.startswith("--preset="))
    model.PRESETS[preset] = {**model.PRESETS[preset], **changes}
    with launches.counting(out, FIRST, LAST):
        train.train(train.parse_config(argv))


@pytest.fixture(scope="module")
def cpu_tiny(bpe_corpus, tmp_path_factory):
    """--comm=subspace at cpu-tiny (28 candidate matrices of 4 shapes; GPT-2's vocabulary)."""
    return counted(tmp_path_factory.mktemp("launches"), bpe_corpus, "--preset=cpu-tiny",
                   "--comm=subspace")


def test_subspace_syncs_at_most_two_per_step(cpu_tiny):
    """Item 2: at most 2 syncing calls per step (svd, eigh, cholesky without _ex, host reads,
    tensors from Python lists) averaged over steps 10-30, and none made from a Python list."""
    print(launches.report(["cpu-tiny", "--comm=subspace"], cpu_tiny))
    assert cpu_tiny["syncing_per_step"] <= 2, cpu_tiny["syncing_by_name"]
    assert "lift_fresh" not in cpu_tiny["syncing_by_name"]


# two widths of char-study's model: its own (2 layers, 64 wide: 10 candidate matrices, wk and wv
# too small) and 4 layers 128 wide (28 candidates; a vocabulary of 256, as 128 would exempt
# every matrix with a side of 128), full multi-head attention so that wk and wv are wq's shape:
# 3 shapes each
WIDER = dict(n_layer=4, n_embd=128, n_kv_head=4, vocab_size=256)


def test_subspace_syncs_do_not_grow_with_the_matrices(tiny_corpus, tmp_path):
    """Item 2: the syncing calls per step at two widths, 10 and 28 candidate matrices of 3
    shapes each, are the same (one SVD per shape group and refresh) and at most 2."""
    narrow = counted(tmp_path, tiny_corpus, "--preset=char-study", "--comm=subspace")
    wide = counted(tmp_path / "wide", tiny_corpus, "--preset=char-study", "--comm=subspace",
                   model=WIDER)
    print(launches.report(["char-study", "--comm=subspace"], narrow))
    print(launches.report(["char-study", "wider", "--comm=subspace"], wide))
    assert narrow["refresh_steps"] == wide["refresh_steps"] >= 4
    assert narrow["syncing_per_step"] == wide["syncing_per_step"] <= 2


def test_subspace_launches_per_step(cpu_tiny):
    """Item 3: at most 1,500 kernel launches per step averaged over steps 10-30, and at most
    3,000 on a refresh step, at cpu-tiny (OpCounter.total: the ops that launch a kernel)."""
    assert cpu_tiny["refresh_steps"] >= 4
    assert cpu_tiny["ops_per_step"] <= 1500, cpu_tiny
    assert cpu_tiny["ops_refresh_step"] <= 3000 and cpu_tiny["ops_most"] <= 3000, cpu_tiny


def test_a_compiled_codec_call_counts_as_the_kernels_it_runs():
    """Under a dispatch mode, torch.compile'd code falls back to its eager ops, so OpCounter alone
    would count the compiled codec's ~11 ops an encode. Inside probes.compiled_kernels_seen each
    compiled call runs compiled and counts the fused kernels the profiler saw it run (inductor's
    C++ kernels on the CPU), and MemoryPeak still tracks what it returns. An ordinary step of
    char-study, one bucket, rank 0 of 2 (nanogeo.lab.reduce_memory's Loopback)."""
    import torch.distributed as dist
    from nanogeo.lab import reduce_memory
    reduce_memory.join_loopback(2)
    try:
        options = dict(geometry="euclidean", bucket_mb=0)
        _, (_, _, eager) = reduce_memory.reduce_peaks("char-study", options, steps=2)
        _, (peak, _, compiled) = reduce_memory.reduce_peaks(
            "char-study", options, steps=2, compiled=True)
    finally:
        dist.destroy_process_group()
    encodes = eager.counts["amax"]                  # stage 1 and stage 2: one encode each
    assert encodes == 2 and eager.counts["_to_copy"] == 4       # and two decodes
    # compiled: stage 1's encode, stage 2's decode-sum-divide-encode and the last decode, one
    # fused kernel each (inductor's C++ kernels: one a compiled call)
    assert [compiled.counts[f"compiled {name}"] for name in
            ("encode_packed", "average_packed", "decode_packed")] == [1, 1, 1]
    assert not {"amax", "abs", "reciprocal"} & set(compiled.counts)     # not counted eagerly
    assert compiled.total < eager.total and peak > 0
