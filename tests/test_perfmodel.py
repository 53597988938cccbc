import dataclasses
import math
from dataclasses import replace

import pytest

from nanogeo.lab import perfmodel
from nanogeo.lab.perfmodel import Cluster


def test_ring_allreduce_known_answers():
    single = Cluster(nodes=1, gpus_per_node=1)
    assert perfmodel.ring_allreduce_seconds(1e9, 2, single) == 0.0
    c = Cluster(nodes=2, gpus_per_node=4, inter_gbps=10.0, alpha_us=0.0)
    # 8 GPUs: 2 * 7/8 of 1e9 bf16 elements (2e9 bytes) at 10 GB/s
    assert perfmodel.ring_allreduce_seconds(1e9, 2, c) == pytest.approx(2 * 7 / 8 * 2e9 / 10e9)
    c1 = Cluster(nodes=1, gpus_per_node=4, intra_gbps=100.0, alpha_us=0.0)
    assert perfmodel.ring_allreduce_seconds(1e9, 4, c1) == pytest.approx(2 * 3 / 4 * 4e9 / 100e9)


def test_fp8_collective_known_answers():
    c1 = Cluster(nodes=1, gpus_per_node=4, intra_gbps=100.0, alpha_us=0.0)
    stage = 3 / 4 * 1e9 * 1.03125
    # one node: all_to_all and all_gather both over NVLink
    assert perfmodel.fp8_collective_seconds(1e9, 1.03125, c1) == pytest.approx(2 * stage / 100e9)
    c = Cluster(nodes=4, gpus_per_node=4, intra_gbps=1e9, inter_gbps=10.0, alpha_us=0.0)
    stage = 15 / 16 * 1e9
    inter = 12 / 15 * stage  # 12 of the 15 peers live on other nodes
    assert perfmodel.fp8_collective_seconds(1e9, 1.0, c) == pytest.approx(inter / 10e9 + stage / 10e9)
    assert perfmodel.wire_bytes_per_element("e4m3") == pytest.approx(1.03125)
    assert perfmodel.wire_bytes_per_element("nvfp4") == pytest.approx(0.5625)


def test_ring_bytes_fp32_twice_bf16_four_times_fp8():
    w = perfmodel.paper_workload()
    c = perfmodel.paper_cluster(alpha_us=0.0)
    fp32, bf16, fp8 = (perfmodel.collective_seconds(m, w, c)[0] for m in ("fp32", "bf16", "fp8-sum"))
    assert fp32 == pytest.approx(2 * bf16)
    assert fp32 == pytest.approx(4 * fp8, rel=1e-5)   # fp8-sum also all-reduces one scale per tensor
    # one GPU per node: all of the ring crosses the NIC, 2 (P-1)/P N bytes
    assert fp32 == pytest.approx(2 * 63 / 64 * w.numel * 4 / (c.inter_gbps * 1e9))
    # the two-stage collective sends (1 + 4/128) bytes per element twice, all of it over the NIC
    two_stage = perfmodel.collective_seconds("fp8", w, c)[0]
    assert two_stage == pytest.approx(2 * 63 / 64 * w.numel * (1 + 4 / 128) / (c.inter_gbps * 1e9))


def test_paper_workload_shapes():
    w = perfmodel.paper_workload()
    d, ffn, layers, vocab = 1280, 3456, 32, 32000
    per_layer = 4 * d * d + 3 * d * ffn + 2 * d        # attention (no GQA), SwiGLU, two norms
    assert w.numel == layers * per_layer + d + vocab * d  # final norm, one tied embedding
    assert w.tokens == 16384 and w.whitened == [(d, ffn)] * 13


def test_step_time_parts():
    w = perfmodel.workload("cpu-tiny", tokens_per_gpu=1000)
    c = Cluster(nodes=1, gpus_per_node=1, mfu=0.5, peak_tflops=100.0)
    row = perfmodel.step_time(w, "bf16", c)
    assert row["compute_s"] == pytest.approx(w.train_flops / 50e12)
    assert row["comm_s"] == row["exposed_comm_s"] == 0.0 and row["step_s"] == row["compute_s"]
    hidden = Cluster(nodes=4, overlap=1.0, inter_gbps=1e6)  # fast links, fully overlapped
    assert perfmodel.step_time(perfmodel.workload("llama-300m"), "bf16", hidden)["exposed_comm_s"] == 0.0
    fraction = Cluster(nodes=4, overlap=0.25, overlap_model="fraction")
    row = perfmodel.step_time(w, "bf16", fraction)
    assert row["exposed_comm_s"] == pytest.approx(0.75 * row["comm_s"])


def test_transform_costs_scale_as_stated():
    dense = perfmodel.whitening_flops("dense", 1280, 3456, 32, 16384)
    wider = perfmodel.whitening_flops("dense", 1280, 2 * 3456, 32, 16384)
    assert dense["apply"] == 2 * 1280 * 3456 ** 2 and wider["apply"] == 4 * dense["apply"]  # m n^2
    assert wider["eigh"] == 8 * dense["eigh"]                                               # n^3
    low = perfmodel.whitening_flops("lowrank", 1280, 3456, 32, 16384)
    low2 = perfmodel.whitening_flops("lowrank", 1280, 3456, 64, 16384)
    assert low["apply"] == 8 * 1280 * 3456 * 32 and low2["apply"] == 2 * low["apply"]       # r
    rand = perfmodel.whitening_flops("lowrank-rand", 1280, 3456, 32, 16384)
    assert rand["eigh"] == 0 and rand["refresh"] < low["refresh"] + low["eigh"]
    # seconds: the eigensolver counts only when it is on the critical path
    c = perfmodel.paper_cluster()
    w_in, w_off = perfmodel.paper_workload(eigh_in_step=True), perfmodel.paper_workload()
    on, off = (perfmodel.step_time(w, "geofp8-dense", c) for w in (w_in, w_off))
    assert on["eigh_s"] == off["eigh_s"] and on["eigh_s"] > 0
    assert on["step_s"] - off["step_s"] == pytest.approx(on["eigh_s"])
    t = perfmodel.whitening_seconds("dense", w_off, c)
    assert t["eigh"] == pytest.approx(13 * 9 * 3456 ** 3 / (c.eigh_tflops * 1e12) / 50)


def test_parse_method():
    assert perfmodel.parse_method("geofp8") == ("fp8-sum", "dense")
    assert perfmodel.parse_method("geofp8-dense") == ("fp8-sum", "dense")
    assert perfmodel.parse_method("fp8+lowrank") == ("fp8", "lowrank")
    assert perfmodel.parse_method("subspace") == ("fp8", "subspace")
    assert perfmodel.parse_method("bf16") == ("bf16", None)
    with pytest.raises(ValueError, match="unknown method"):
        perfmodel.parse_method("fp8+magic")


def test_solve_1d():
    assert perfmodel.solve_1d(lambda x: x * x - 2, 0.1, 10) == pytest.approx(math.sqrt(2))
    assert perfmodel.solve_1d(lambda x: x - 0.3, 0.0, 1.0) == pytest.approx(0.3)
    assert perfmodel.solve_1d(lambda x: x + 1, 0.1, 10) is None
    assert perfmodel.solve_1d(lambda x: None if x < 5 else x - 7, 0.1, 10) == pytest.approx(7)


@pytest.mark.parametrize("unknowns,overrides", [
    (("overlap", "mfu"), {}),
    (("overlap", "linalg_efficiency"), {"mfu": 0.3}),
    (("inter_gbps", "mfu"), {"overlap": 0.5}),
    (("overlap", "mfu"), {"overlap_model": "fraction"}),
])
def test_calibration_reproduces_both_targets(unknowns, overrides):
    w, start = perfmodel.paper_workload(), perfmodel.paper_cluster(**overrides)
    solved = perfmodel.calibrate(w, start, *unknowns)
    assert solved is not None
    for method, target in perfmodel.PAPER_TARGETS.items():
        assert perfmodel.change_vs(w, solved, method, "fp32") == pytest.approx(target, abs=1e-6)
    for name, value in dataclasses.asdict(solved).items():   # only the two unknowns moved
        assert (value == getattr(start, name)) == (name not in unknowns)


def test_transform_budget_bounds_the_calibration():
    """The FP8 figure caps the fp32 step at its value with nothing hidden; with the transform
    above the resulting budget, no MFU and overlap reproduce both figures."""
    w, c = perfmodel.paper_workload(), perfmodel.paper_cluster()
    longest, budget = perfmodel.transform_budget(w, c)
    unhidden = perfmodel.calibrate(w, replace(c, overlap=0.0), "mfu", "linalg_efficiency")
    assert perfmodel.step_time(w, "fp32", unhidden)["step_s"] == pytest.approx(longest, rel=1e-6)
    assert perfmodel.step_time(w, "geofp8-dense", unhidden)["transform_s"] == pytest.approx(budget, rel=1e-5)
    slow = perfmodel.paper_workload(eigh_in_step=True)
    assert perfmodel.step_time(slow, "geofp8-dense", c)["transform_s"] > budget
    assert perfmodel.calibrate(slow, c, "overlap", "mfu") is None


def test_geofp8_flop_share_at_llama_600m():
    """Target: the subspace rotation <= 2 % of step flops at llama-600m shapes, 8192 tokens per rank."""
    geo, net = perfmodel.geo_flops("llama-600m", 32, refresh=1)  # the costliest settings
    share = geo / (net.flops_per_token(net.config.block_size) * 8192)
    assert 0 < share <= 0.02


def test_solving_for_a_bandwidth():
    w = perfmodel.workload("llama-600m")
    gbps = perfmodel.solve_inter_bandwidth(w, Cluster(nodes=16), -0.076)
    assert gbps is not None
    rows = perfmodel.compare(w, Cluster(nodes=16, inter_gbps=gbps), comms=("bf16", "subspace"))
    assert rows[1]["vs_first"] == pytest.approx(-0.076, abs=1e-4)
    # faster links shrink the gain
    fast = perfmodel.compare(w, Cluster(nodes=16, inter_gbps=4 * gbps), comms=("bf16", "subspace"))
    assert fast[1]["vs_first"] > -0.076


def test_cli_scan_and_paper(capsys):
    rows = perfmodel.main(["--nodes", "2", "--preset", "llama-300m", "--comms=bf16,fp8,geofp8,geo-nvfp4"])
    assert math.isfinite(rows[0]["step_s"]) and len(rows) == 4
    solved, rows = perfmodel.main(["paper", "--solve=overlap,mfu", "--linalg_efficiency", "0.7"])
    out = capsys.readouterr().out
    assert "solved:  mfu" in out and "projection on the calibrated cluster" in out
    by_name = {r["comm"]: r for r in rows}
    assert by_name["geofp8-dense"]["vs_first"] == pytest.approx(-0.076, abs=1e-6)
    assert {"fp32", "bf16", "geofp8-lowrank", "fp8", "subspace"} <= set(by_name)
    with pytest.raises(SystemExit):
        perfmodel.main(["paper", "--solve", "mfu"])
