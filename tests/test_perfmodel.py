import math

import pytest

from nanogeo import perfmodel
from nanogeo.perfmodel import Cluster


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


def test_step_time_parts():
    c = Cluster(nodes=1, gpus_per_node=1, mfu=0.5, peak_tflops=100.0)
    row = perfmodel.step_time("cpu-tiny", "bf16", c, tokens_per_gpu=1000)
    _, net = perfmodel.geo_flops("cpu-tiny", 16)
    flops = net.flops_per_token(net.config.block_size) * 1000
    assert row["compute_s"] == pytest.approx(flops / 50e12)
    assert row["comm_s"] == row["exposed_comm_s"] == 0.0 and row["step_s"] == row["compute_s"]
    hidden = Cluster(nodes=4, overlap=1.0, inter_gbps=1e6)  # fast links, fully overlapped
    assert perfmodel.step_time("llama-300m", "bf16", hidden)["exposed_comm_s"] == 0.0


def test_geofp8_flop_share_at_llama_600m():
    """Target: GeoFP8 <= 2 % of step flops at llama-600m shapes with 8192 tokens per rank."""
    geo, net = perfmodel.geo_flops("llama-600m", 32, refresh=1)  # the costliest settings
    share = geo / (net.flops_per_token(net.config.block_size) * 8192)
    assert 0 < share <= 0.02


def test_solving_for_the_papers_gain():
    c = Cluster(nodes=16)
    gbps = perfmodel.solve_inter_bandwidth("llama-600m", c, -0.076)
    assert gbps is not None
    rows = perfmodel.compare("llama-600m", Cluster(nodes=16, inter_gbps=gbps), comms=("bf16", "geofp8"))
    assert rows[1]["vs_first"] == pytest.approx(-0.076, abs=1e-4)
    # faster links shrink the gain, more nodes (at fixed links) do not remove it
    fast = perfmodel.compare("llama-600m", Cluster(nodes=16, inter_gbps=4 * gbps), comms=("bf16", "geofp8"))
    assert fast[1]["vs_first"] > -0.076
    assert math.isfinite(perfmodel.main(["--nodes", "2", "--preset", "llama-300m"])[0]["step_s"])
