"""The GPU figures of `make gpu-smoke` (issue 50, item 7) at toy size on gloo: the code path a
GPU run takes, so that it cannot break unseen."""
import json

import torch

from conftest import run_ranks


def figures_rank(rank, world_size, out):
    import torch.distributed as dist
    from nanogeo.smoke import figures
    dist.init_process_group("gloo")
    result = figures.gpu_figures(torch.device("cpu"), 1, sizes=(0.01, 0.02), preset="char-study",
                                 batch_size=2, block_size=32)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_gpu_figures_run_at_toy_size_on_gloo(tmp_path):
    """The figures a GPU run prints (item 7), through the same functions at toy size on 2 gloo
    ranks: every collective against bf16 at each size, every step's comm against bf16, and the
    markdown rows BENCHMARKS.md takes."""
    out = str(tmp_path / "figures")
    run_ranks(figures_rank, 2, out)
    result = json.load(open(f"{out}.0"))
    exchange = result["exchange"]
    assert [(r["million_elements"], r["method"]) for r in exchange] == [
        (size, method) for size in (0.01, 0.02) for method in ("bf16", "fp8", "nvfp4")]
    for r in exchange:
        assert r["ms"] > 0 and r["bus_gb_per_s"] > 0 and r["world"] == 2
        assert (r["vs_bf16"] == 1.0) == (r["method"] == "bf16")
    bf16 = {r["million_elements"]: r["bytes_sent"] for r in exchange if r["method"] == "bf16"}
    for r in exchange:       # the wire: ~0.52x (e4m3) and ~0.3x (NVFP4) of bf16's, plus headers
        assert r["bytes_sent"] < {"bf16": 1.01, "fp8": 0.6, "nvfp4": 0.4}[r["method"]] * bf16[
            r["million_elements"]]
    assert [r["comm"] for r in result["step"]] == ["bf16", "fp8", "subspace"]
    assert all(r["ms"] > 0 and r["peak_memory_gib"] is None for r in result["step"])
    table = result["markdown"]
    assert sum(line.startswith("| two-stage") for line in table) == 4
    assert sum(line.startswith("| char-study") for line in table) == 3
