"""Contracts of the measurement tools on small inputs: capture, bench, smoke, profile (the study
driver's: tests/test_study.py)."""
import json
import math

import torch
import torch.distributed as dist

from conftest import run_ranks
from nanogeo.lab import bench, capture


def test_capture_writes_the_gradient_file_contract(tiny_corpus, tmp_path):
    out = tmp_path / "grads.pt"
    capture.main([f"--out={out}", "--preset=char-study", f"--data_dir={tiny_corpus}", "--workers=2",
                  "--train_steps=2",
                  "--capture_steps=2", "--batch_size=2", "--block_size=16"])
    data = torch.load(out, weights_only=True)
    assert len(data["steps"]) == 2 and all(len(step) == 2 for step in data["steps"])
    names = set(data["steps"][0][0])
    assert "layers.0.attn.wq.weight" in names and set(data["optimizer_v"]) == names
    a, b = data["steps"][0][0]["lm_head.weight"], data["steps"][0][1]["lm_head.weight"]
    assert a.shape == b.shape and not torch.equal(a, b)  # each worker its own micro-batch
    assert all(v.dtype == torch.float32 for v in data["steps"][0][0].values())


def collective_rank(rank, world_size, out):
    dist.init_process_group("gloo")
    rows = bench.time_collective([0.02], 1, ["fp32", "bf16", "fp8", "subspace", "nvfp4"])
    torch.save(rows, f"{out}.{rank}")
    dist.destroy_process_group()


def test_bench_collective_reports_bytes(tmp_path):
    out = str(tmp_path / "rows")
    run_ranks(collective_rank, 2, out)
    rows = {r["method"]: r for r in torch.load(f"{out}.0")}
    assert rows["fp32"]["bytes_vs_bf16"] == 2.0 and rows["bf16"]["bytes_vs_bf16"] == 1.0
    assert 0.5 < rows["fp8"]["bytes_vs_bf16"] <= 0.52
    assert rows["subspace"]["bytes_sent"] == rows["fp8"]["bytes_sent"]
    assert rows["nvfp4"]["bytes_vs_bf16"] <= 0.30
    assert {"quantize", "reduce", "decode", "collectives"} <= set(rows["fp8"]["breakdown_ms"])


def test_bench_flops_and_overhead_shapes():
    flops = bench.analytic_flops("llama-600m", 8192, 16, refresh=4)
    assert 0 < flops["fraction"] < 0.02
    result = bench.measure_overhead(1, batch_size=1, block_size=16, refresh=4)
    assert result["geo_layers"] == 28 and math.isfinite(result["overhead_vs_fwd_bwd"])


def test_bench_step_profile_splits_a_step_by_op():
    """bench step: the ops' self times are parts of the step's time. (The profiler records aten
    ops on the thread that calls them; on the CPU autograd's backward runs there too.)"""
    result = bench.step_profile("cpu-tiny", steps=1, batch_size=1, block_size=16, top=4)
    ops = result["ops_ms_per_step"]
    assert result["parameters"] == 13_665_408 and result["tokens"] == 16 and len(ops) == 4
    assert all(ms > 0 for ms in ops.values()) and result["ms_per_step"] > 0
    assert sum(ops.values()) <= result["profiled_ms_per_step"]


def test_vocabulary_mismatch_is_refused(tmp_path):
    from prepare_data import ShardWriter
    for split in ("train", "val"):
        writer = ShardWriter(str(tmp_path / f"{split}.bin"), "bigtok", 60000)
        writer.write(list(range(1000)))
        writer.close()
    from prepare_data import ShardError, load_splits
    try:
        load_splits(str(tmp_path), 16, 50304)
    except ShardError as e:
        assert "60000 ids" in str(e) and "re-tokenize" in str(e)
    else:
        raise AssertionError("expected a vocabulary error")


def smoke_rank(rank, world_size, out):
    from nanogeo import smoke
    smoke.main(["--preset=cpu-tiny", "--numel=5000", "--iters=1", "--batch_size=2",
                "--block_size=16", "--no-compile", f"--out={out}"])


def test_smoke_test_runs_on_cpu(tmp_path):
    """The GPU smoke script's checks pass on CPU (gloo instead of NCCL, no CUDA stream): its
    main() with the README's line at toy size, so tests/test_readme.py does not run it again.
    Eager only (--no-compile): the compiled codec and model are checked against eager by
    test_compress.py::test_compiled_hot_path_equals_eager and test_train.py's compile test,
    and inductor's compile of both would cost this test about 2 minutes of a cold CI run."""
    out = str(tmp_path / "smoke.json")
    run_ranks(smoke_rank, 1, out)
    with open(out) as f:
        result = json.load(f)
    assert result["nccl"]["uint8_all_to_all"] and result["nccl"]["uint8_all_gather"]
    assert 0 < result["nccl"]["all_reduce_mean_rel_err"] < 0.05
    assert {(r["fmt"], r["compiled"]) for r in result["codec"]} == {
        ("e4m3", False), ("e5m2", False), ("nvfp4", False)}
    assert max(result["ddp"]["rel_err_per_step"]) < 0.05 and result["ddp"]["geo_matrices"] > 0
    assert result["step"]["eager_ms"] > 0 and "compiled_ms" not in result["step"]
    assert result["transform"]["matrices"] == 28


def test_capture_records_moments_and_optimizer(tiny_corpus, tmp_path):
    out = tmp_path / "grads.pt"
    capture.main(["--out", str(out), "--preset=char-study", f"--data_dir={tiny_corpus}", "--workers=2",
                  "--train_steps=1", "--capture_steps=2", "--batch_size=2", "--block_size=16",
                  "--optimizer=muon"])
    data = torch.load(out, weights_only=True)
    a = data["inputs"][0]["layers.0.mlp.w2.weight"]
    assert a.shape == (192, 192) and torch.allclose(a, a.T)        # the SwiGLU product's A
    assert data["outputs"][0]["layers.0.mlp.w2.weight"].shape == (64, 64)
    assert "lm_head.weight" not in data["inputs"][0]                 # vocabulary: no moments
    classes = {g["class"] for g in data["optimizer"]["groups"]}
    assert classes == {"Muon", "AdamW"} and data["vocab_size"] == 128
    muon = next(g for g in data["optimizer"]["groups"] if g["class"] == "Muon")
    assert "layers.0.attn.wq.weight" in muon["params"] and "lm_head.weight" not in muon["params"]
    from nanogeo.lab import fidelity
    report = fidelity.evaluate(str(out), ["fp8-block", "geofp8:select=all"], last=1)
    for method in report.values():      # real optimizer steps: FP8 moves them, but not wholly
        assert set(method["total"]["update_err"]) == {"muon", "adamw"}
        assert 0 < method["layers"]["layers.0.attn.wq.weight"]["update_err"]["muon"] < 1
        assert "adamw" in method["layers"]["lm_head.weight"]["update_err"]
    assert report["geofp8:select=all"]["layers"]["layers.0.mlp.w2.weight"]["coords"] == "geo"


def test_profile_and_tables(tiny_corpus, tmp_path):
    from nanogeo.lab import profile, tables
    out = tmp_path / "layers.json"
    profile.main([f"--out={out}", "--preset=char-study", f"--data_dir={tiny_corpus}", "--workers=4",
                  "--steps=2",
                  "--batch_size=1", "--block_size=16", "--top_k=3"])
    result = json.load(open(out))
    # per block wq, wo, w1, w3, w2; wk and wv (32 x 64) are under 4096 elements
    assert len(result["selected"]) == 3 and len(result["scores"]) == 2 * 5
    ranked = sorted(result["scores"].values(), reverse=True)
    assert [result["scores"][n] for n in result["selected"]] == ranked[:3]
    grads = tmp_path / "grads.pt"
    capture.main([f"--out={grads}", "--preset=char-study", f"--data_dir={tiny_corpus}", "--workers=2",
                  "--train_steps=0",
                  "--capture_steps=2", "--batch_size=2", "--block_size=16"])
    table = tables.tables(str(grads), "round-trip", last=1)
    rows = {r["row"]: r for r in table["rows"]}
    assert rows["Euclidean"]["all"]["vs_euclid"] == 1.0 and rows["Euclidean"]["geo_matrices"] == 0
    assert rows["low-rank A 32"]["geo_matrices"] == 2 * 7 and table["down_matrices"] == 2  # all 7




def test_the_frames_tool_reads_the_path_from_train_to_the_wire():
    """nanogeo.lab.frames keeps the frames from the innermost train.train on, outermost first."""
    import os
    from collections import namedtuple
    from nanogeo.lab import frames
    Frame = namedtuple("Frame", "filename function")
    at = lambda *parts: os.path.join(frames.ROOT, *parts)
    stack = [Frame(at("compress.py"), "all_reduce_mean"), Frame(at("compress.py"), "step"),
             Frame(at("train.py"), "reduce_gradients"), Frame(at("train.py"), "train"),
             Frame(at("train.py"), "main"), Frame(at("train.py"), "<module>")]    # innermost first
    assert frames.path_to_wire(stack) == ["train.py:train", "train.py:reduce_gradients",
                                          "compress.py:step", "compress.py:all_reduce_mean"]
