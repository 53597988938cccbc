"""Contracts of the measurement tools on small inputs: capture, bench, ablate, smoke."""
import json
import math

import torch
import torch.distributed as dist

from conftest import run_ranks
from nanogeo import ablate, bench, capture


def test_capture_writes_the_gradient_file_contract(tiny_corpus, tmp_path):
    out = tmp_path / "grads.pt"
    capture.main([f"--out={out}", f"--data_dir={tiny_corpus}", "--workers=2", "--train_steps=2",
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
    assert {"quantize", "all_to_all", "reduce", "all_gather", "decode"} <= set(rows["fp8"]["breakdown_ms"])


def test_bench_flops_and_overhead_shapes():
    flops = bench.analytic_flops("llama-600m", 8192, 16, refresh=4)
    assert 0 < flops["fraction"] < 0.02
    result = bench.measure_overhead(1, batch_size=1, block_size=16, refresh=4)
    assert result["geo_layers"] == 28 and math.isfinite(result["overhead_vs_fwd_bwd"])


def test_ablate_statistics():
    """Means with Student-t intervals; gaps paired by seed; the recovered fraction of the
    reference's gap with a bootstrap interval."""
    mean, half = ablate.mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and abs(half - 4.303 * 1.0 / math.sqrt(3)) < 1e-9
    point, lo, hi = ablate.recovered([0.05, 0.05, 0.05], [0.1, 0.1, 0.1])
    assert point == lo == hi == 0.5
    def run(comm, seed, val):
        return {"comm": comm, "optimizer": "adamw", "workers": 4, "seed": seed,
                "final_val_loss": val, "final_train_loss": val, "ms_per_step": 10.0,
                "wire_bytes": 1, "wire_vs_bf16": 0.5, "curve": [(1, val)]}
    results = [run("fp32", s, 2.0 + 0.01 * s) for s in range(3)]
    results += [run("fp8", s, 2.2 + 0.01 * s) for s in range(3)]
    results += [run("subspace", s, 2.1 + 0.01 * s) for s in range(3)]
    text = ablate.table(results, "fp8")
    assert "| fp8 | 3 | 2.2100 ± 0.0248 | +0.2000 ± 0.0000 | — |" in text
    assert "| subspace | 3 | 2.1100 ± 0.0248 | +0.1000 ± 0.0000 | 50 % (50 to 50 %) |" in text


def test_ablate_runs_a_grid_and_resumes(tiny_corpus, tmp_path, capsys):
    """Two methods x two seeds of simulated 2-rank runs; a second call skips all four."""
    argv = ["--comms", "fp32,fp8", "--seeds", "0,1", "--workers", "2", "--out_dir",
            str(tmp_path), "--", f"--data_dir={tiny_corpus}", "--max_iters=2", "--batch_size=2",
            "--block_size=16", "--eval_iters=1", "--eval_interval=2", "--warmup_iters=1"]
    ablate.main(argv)
    records = json.load(open(tmp_path / "results.json"))
    assert sorted((r["comm"], r["seed"]) for r in records) == [
        ("fp32", 0), ("fp32", 1), ("fp8", 0), ("fp8", 1)]
    assert all(r["workers"] == 2 and r["curve"] for r in records)
    assert "recovers of fp8's gap" in (tmp_path / "study.md").read_text()
    capsys.readouterr()
    ablate.main(argv)
    assert capsys.readouterr().out.count("done before, skipped") == 4


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
                "--block_size=16", f"--out={out}"])


def test_smoke_test_runs_on_cpu(tmp_path):
    """The GPU smoke script's checks pass on CPU (gloo instead of NCCL, no CUDA stream)."""
    out = str(tmp_path / "smoke.json")
    run_ranks(smoke_rank, 1, out)
    with open(out) as f:
        result = json.load(f)
    assert result["nccl"]["uint8_all_to_all"] and result["nccl"]["uint8_all_gather"]
    assert 0 < result["nccl"]["all_reduce_mean_rel_err"] < 0.05
    assert {(r["fmt"], r["compiled"]) for r in result["codec"]} == {
        ("e4m3", False), ("e4m3", True), ("e5m2", False), ("e5m2", True), ("nvfp4", False)}
    assert max(result["ddp"]["rel_err_per_step"]) < 0.05 and result["ddp"]["geo_matrices"] > 0
    assert result["step"]["eager_ms"] > 0 and result["transform"]["matrices"] == 28


def test_capture_records_moments_and_optimizer(tiny_corpus, tmp_path):
    out = tmp_path / "grads.pt"
    capture.main(["--out", str(out), f"--data_dir={tiny_corpus}", "--workers=2",
                  "--train_steps=1", "--capture_steps=2", "--batch_size=2", "--block_size=16",
                  "--optimizer=muon"])
    data = torch.load(out, weights_only=True)
    a = data["inputs"][0]["layers.0.mlp.w2.weight"]
    assert a.shape == (384, 384) and torch.allclose(a, a.T)        # the SwiGLU product's A
    assert data["outputs"][0]["layers.0.mlp.w2.weight"].shape == (128, 128)
    assert "lm_head.weight" not in data["inputs"][0]                 # vocabulary: no moments
    classes = {g["class"] for g in data["optimizer"]["groups"]}
    assert classes == {"Muon", "AdamW"} and data["vocab_size"] == 50304
    muon = next(g for g in data["optimizer"]["groups"] if g["class"] == "Muon")
    assert "layers.0.attn.wq.weight" in muon["params"] and "lm_head.weight" not in muon["params"]
    from nanogeo import fidelity
    report = fidelity.evaluate(str(out), ["fp8-block", "geofp8:select=all"], last=1)
    for method in report.values():      # real optimizer steps: FP8 moves them, but not wholly
        assert set(method["total"]["update_err"]) == {"muon", "adamw"}
        assert 0 < method["layers"]["layers.0.attn.wq.weight"]["update_err"]["muon"] < 1
        assert "adamw" in method["layers"]["lm_head.weight"]["update_err"]
    assert report["geofp8:select=all"]["layers"]["layers.0.mlp.w2.weight"]["coords"] == "geo"


def test_profile_and_tables(tiny_corpus, tmp_path):
    from nanogeo import profile, tables
    out = tmp_path / "layers.json"
    profile.main([f"--out={out}", f"--data_dir={tiny_corpus}", "--workers=4", "--steps=2",
                  "--batch_size=1", "--block_size=16", "--top_k=3"])
    result = json.load(open(out))
    assert len(result["selected"]) == 3 and len(result["scores"]) == 4 * 7
    ranked = sorted(result["scores"].values(), reverse=True)
    assert [result["scores"][n] for n in result["selected"]] == ranked[:3]
    grads = tmp_path / "grads.pt"
    capture.main([f"--out={grads}", f"--data_dir={tiny_corpus}", "--workers=2", "--train_steps=0",
                  "--capture_steps=2", "--batch_size=2", "--block_size=16"])
    table = tables.tables(str(grads), "round-trip", last=1)
    rows = {r["row"]: r for r in table["rows"]}
    assert rows["Euclidean"]["all"]["vs_euclid"] == 1.0 and rows["Euclidean"]["geo_matrices"] == 0
    assert rows["low-rank A 32"]["geo_matrices"] == 4 * 7 and table["down_matrices"] == 4
