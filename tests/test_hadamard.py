"""The randomized Hadamard transform, the geometry-agnostic control (nanogeo/geometry/hadamard.py): exact
and orthonormal, equal to its dense definition, the same on every rank, incoherent (it spreads
an outlier), and used only where the gain check measured it better - like every geometry."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from nanogeo.geometry.hadamard import HadamardLayer, hadamard_cuts
from conftest import ROOT, run_ranks
from nanogeo.run import config, summary
from nanogeo.parallel.communicator import Options, ProductionCommunicator


def hadamard_layer(shape, block=128, sides="right", seed=3):
    layer = HadamardLayer(shape, seed, Options(geometry="hadamard", hadamard_block=block,
                                                  hadamard_sides=sides))
    layer.refresh(torch.zeros(shape))           # the mean gives only the device
    return layer


@pytest.mark.parametrize("shape, block, sides", [((64, 256), 128, "right"),
                                                 ((48, 192), 128, "both"),    # 192 = 128 + 64
                                                 ((37, 2736), 128, "both"),   # 21 x 128 + 32 + 16
                                                 ((5, 7), 4, "right"),        # 4 + 2 + 1
                                                 ((64, 200), 16, "both")])    # NVFP4's blocks
def test_round_trip_is_exact_and_keeps_the_norm(shape, block, sides):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    layer = hadamard_layer(shape, block, sides)
    H = layer.encode(G)
    assert (layer.decode(H) - G).norm() <= 1e-6 * G.norm()
    assert abs(H.norm() / G.norm() - 1) < 1e-6


def sylvester(size):
    """H_size by its closed form, H[i, j] = (-1)^popcount(i & j), not by the recursion."""
    i = torch.arange(size)
    bits = (i[:, None] & i[None, :]).tolist()
    return torch.tensor([[(-1.0) ** bin(x).count("1") for x in row] for row in bits])


def dense_transform(signs, blocks):
    """diag(signs) @ blockdiag(H_b / sqrt(b) for b in blocks): the matrix that multiplies a
    row, built element by element."""
    B = torch.block_diag(*[sylvester(b) / math.sqrt(b) for b in blocks])
    return torch.diag(signs) @ B


def test_transform_equals_its_dense_definition():
    m, n, block = 12, 28, 8                           # 28 = 3 x 8 + 4: blocks 8, 8, 8, 4
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(1))
    right = hadamard_layer((m, n), block)
    Dc = dense_transform(right.column_signs, [8, 8, 8, 4])
    assert torch.allclose(right.encode(G), G @ Dc, atol=1e-6)
    assert set(right.column_signs.tolist()) == {-1.0, 1.0}
    both = hadamard_layer((m, n), block, "both")      # rows 12 = 8 + 4
    Dr = dense_transform(both.row_signs, [8, 4])
    assert torch.equal(both.column_signs, right.column_signs)     # the same seed, the same draw
    assert torch.allclose(both.encode(G), Dr.T @ G @ Dc, atol=1e-6)
    assert hadamard_cuts(2736, 128) == ((2688, 128), (32, 32), (16, 16))


def test_spreads_an_outlier_column():
    """Incoherence: a column 100x the others sets every block's scale in original coordinates;
    after the transform each 128-block's largest entry is close to its RMS."""
    plain = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    G = plain.clone()
    G[:, 7] *= 100

    def peak_to_rms(X):                              # the worst 128-entry block of any row
        blocks = X.reshape(-1, 128)
        return (blocks.abs().amax(1) / blocks.pow(2).mean(1).sqrt()).max().item()

    assert peak_to_rms(G) > 10 and peak_to_rms(plain) < 4
    # as flat as Gaussian noise without the outlier
    assert peak_to_rms(hadamard_layer(G.shape).encode(G)) < 1.1 * peak_to_rms(plain)


def flush_prone(world, steps, seed=0):
    """Gradients that NVFP4 rounds badly in original coordinates and the Hadamard transform
    helps: in every 16-value scaling block one entry 24x the others, which then sit at 6/24 of
    the block's scale, where e2m1's grid (0, 0.5, 1, ...) rounds half of them to zero."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        workers = []
        for _ in range(world):
            magnitude = 1 + 0.1 * torch.rand(128, 256, generator=g)
            G = torch.randn(128, 256, generator=g).sign() * magnitude
            G[:, ::16] *= 24
            workers.append(G)
        out.append(workers)
    return out


def outlier_column(world, steps, seed=1):
    """Gaussian gradients with one column 50x the others."""
    g = torch.Generator().manual_seed(seed)
    out = [[torch.randn(128, 256, generator=g) for _ in range(world)] for _ in range(steps)]
    for workers in out:
        for G in workers:
            G[:, 7] *= 50
    return out


def run(options, steps, name="layers.0.mlp.w1.weight"):
    """Each step's relative error of the mean, the coordinates it was sent in, and whether a
    candidate awaits its measurement after it."""
    comm = ProductionCommunicator([(name, steps[0][0].shape)], options)
    errors, coords, proposed = [], [], []
    for workers in steps:
        coords.append(comm.coords(name))
        means, _ = comm.reduce_workers([[w] for w in workers])
        exact = sum(workers) / len(workers)
        errors.append(((means[0] - exact).norm() / exact.norm()).item())
        proposed.append(name in comm.proposals)
    return errors, coords, comm, proposed


def test_enters_only_after_a_measurement():
    """Do no harm: the signs drawn after step 0 are a candidate, measured on step 1's gradients
    (still sent in Euclidean coordinates, bit for bit), and used from step 2 where they measured
    better; a refresh step proposes them again to be re-judged."""
    steps = flush_prone(world=2, steps=6)
    euclid, _, _, _ = run(Options(geometry="euclidean", fmt="nvfp4"), steps)
    errors, coords, comm, proposed = run(Options(geometry="hadamard", fmt="nvfp4"), steps)
    assert coords == ["euclidean", "euclidean", "geo", "geo", "geo", "geo"]
    assert errors[:2] == euclid[:2]
    assert sum(errors[2:]) < 0.9 * sum(euclid[2:])
    assert comm.layers["layers.0.mlp.w1.weight"].gain >= 1.10
    assert proposed == [True, False, False, True, False, False]     # refresh=4: re-judged
    # where it measures worse it is never used (an outlier column under e4m3 block scales:
    # floating point already keeps the other entries' relative precision), unless forced
    outlier = outlier_column(world=2, steps=4)
    _, coords, comm, _ = run(Options(geometry="hadamard"), outlier)
    assert coords == ["euclidean"] * 4 and comm.layers["layers.0.mlp.w1.weight"].gain < 1
    _, coords, _, _ = run(Options(geometry="hadamard", select="all"), outlier)
    assert coords == ["euclidean", "geo", "geo", "geo"]          # forced: at once, no measurement


def test_forced_at_nvfp4_blocks_acts_on_every_step_after_the_first():
    """The 4-bit control as NVIDIA's NVFP4 recipe applies it: 16-entry Walsh-Hadamard blocks,
    one per NVFP4 scaling block, forced (select="all", no gain check): every step after the one
    that draws the signs is sent in Hadamard coordinates, and the mean then differs from
    Euclidean NVFP4's (the control acts) - on flush-prone blocks, closer to the exact mean."""
    steps = flush_prone(world=4, steps=4)
    euclid, _, _, _ = run(Options(geometry="euclidean", fmt="nvfp4"), steps)
    errors, coords, comm, _ = run(Options(geometry="hadamard", fmt="nvfp4", select="all",
                                          hadamard_block=16), steps)
    assert coords == ["euclidean", "geo", "geo", "geo"]
    assert errors[0] == euclid[0] and all(e != g for e, g in zip(errors[1:], euclid[1:]))
    assert sum(errors[1:]) < sum(euclid[1:])
    assert comm.layers["layers.0.mlp.w1.weight"].r == 16


def test_state_dict_table_and_options():
    steps = flush_prone(world=2, steps=3)
    options = Options(geometry="hadamard", fmt="nvfp4", hadamard_sides="both")
    _, _, comm, _ = run(options, steps)
    other = ProductionCommunicator([("layers.0.mlp.w1.weight", (128, 256))], options)
    other.load_state_dict(comm.state_dict())
    nxt = flush_prone(world=2, steps=1, seed=5)[0]
    a, _ = comm.reduce_workers([[w] for w in nxt])
    b, _ = other.reduce_workers([[w] for w in nxt])
    assert torch.equal(a[0], b[0]) and comm.coords("layers.0.mlp.w1.weight") == "geo"
    # the table: r is the block size, no core energy; the state: one sign per row and column
    row = summary.layer_table(comm).splitlines()[1].split()
    assert row[2:4] == ["128", "geo"] and row[-1] == "-"
    assert summary.geometry_state_bytes(comm) == 4 * (128 + 256)
    for bad in (dict(hadamard_block=100), dict(hadamard_block=1), dict(hadamard_sides="left")):
        with pytest.raises(ValueError, match="hadamard_"):
            Options(geometry="hadamard", **bad)
    import train
    opts = config.geo_options(train.parse_config(
        ["--comm=hadamard", "--hadamard_block=64", "--hadamard_sides=both"]), 50304)
    assert (opts.geometry, opts.hadamard_block, opts.hadamard_sides) == ("hadamard", 64, "both")


def two_ranks(rank, world_size, out_path):
    """Rank `rank` of 2 gloo ranks: each rank's communicator (geometry "hadamard", gain-checked
    and forced) on its own gradients - its signs, a fixed matrix's encoding and the means - then
    Hadamard coordinates (forced) in FSDP2's reduce-scatter of a small language model, three
    steps against an fp32 twin (test_fsdp's models and helpers). One process group for both:
    each start of two processes costs seconds."""
    from nanogeo.parallel.fsdp import use_compressed_reduce_scatter
    from test_fsdp import VOCAB, language_model, relative_error, twins
    dist.init_process_group("gloo")
    steps = flush_prone(world_size, 4)
    G = torch.randn(128, 256, generator=torch.Generator().manual_seed(9))
    saved = {}
    for select in ("gain", "all"):
        comm = ProductionCommunicator([("a.weight", (128, 256)), ("b", (7,))],
                                  Options(geometry="hadamard", fmt="nvfp4", select=select,
                                             hadamard_sides="both", seed=11))
        means = []
        for workers in steps:
            grads = [workers[rank].clone(), torch.full((7,), float(rank))]
            coords = comm.coords("a.weight")                    # as this step is sent
            comm.reduce(grads)
            means.append((grads[0], coords))
        layer = comm.layers["a.weight"]
        saved[select] = {"signs": layer.tensors(), "encoded": layer.encode(G), "means": means}
    ref, model = twins(language_model, world_size, init=False)
    comms = use_compressed_reduce_scatter(model, geometry="hadamard", select="all", geo_warmup=0,
                                          min_numel=1024, vocab_size=VOCAB)
    errors = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randint(0, VOCAB, (4, 16), generator=g)
        for m in (ref, model):
            m.zero_grad()
            m(x).pow(2).mean().backward()
        errors.append(relative_error(ref, model)[0])
    saved["fsdp"] = {"errors": errors,
                     "coords": {n: c.comm.coords(n) for c in comms for n in c.names},
                     "geometry_bytes": sum(c.geometry_bytes for c in comms)}
    torch.save(saved, f"{out_path}.{rank}")
    dist.destroy_process_group()


def test_two_ranks_agree_and_fsdp2_decodes_rows_locally(tmp_path):
    """The signs and the encodings are bit-identical on every rank, and the means equal the
    simulator's. Under FSDP2 the column-side transform is row-local: each rank decodes its own
    rows of the mean with the layer's decode, no geometry collective."""
    out = str(tmp_path / "hadamard")
    run_ranks(two_ranks, 2, out)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for select in ("gain", "all"):
        a, b = ranks[0][select], ranks[1][select]
        assert all(torch.equal(x, y) for x, y in zip(a["signs"], b["signs"]))
        assert len(a["signs"]) == 2                                    # columns and rows
        assert torch.equal(a["encoded"], b["encoded"])                 # bit-identical
        sim = ProductionCommunicator([("a.weight", (128, 256)), ("b", (7,))],
                                 Options(geometry="hadamard", fmt="nvfp4", select=select,
                                            hadamard_sides="both", seed=11))
        for step, workers in enumerate(flush_prone(2, 4)):
            coords = sim.coords("a.weight")
            means, _ = sim.reduce_workers([[workers[r], torch.full((7,), float(r))]
                                           for r in range(2)])
            for r in range(2):
                assert torch.equal(ranks[r][select]["means"][step][0], means[0])
                assert ranks[r][select]["means"][step][1] == coords
        assert sim.coords("a.weight") == "geo"
    fsdp = [r["fsdp"] for r in ranks]
    # steps 1 and 2 in Hadamard coordinates: each rank's rows decoded right
    assert 0 < max(fsdp[0]["errors"] + fsdp[1]["errors"]) < 0.05
    assert fsdp[0]["coords"]["0.weight"] == "euclidean" and "geo" in fsdp[0]["coords"].values()
    assert fsdp[0]["geometry_bytes"] == 0


def test_fsdp2_refuses_the_rows_option():
    """hadamard_sides="both" mixes rows that FSDP keeps on different ranks."""
    from nanogeo.parallel.fsdp import CompressedReduceScatter
    with pytest.raises(ValueError, match="hadamard_sides='right'"):
        CompressedReduceScatter(torch.nn.Linear(4, 4), geometry="hadamard", hadamard_sides="both")


def test_fidelity_cli_runs_the_hadamard_methods(tmp_path):
    from test_fidelity import write_gradient_file
    path, report = str(tmp_path / "grads.pt"), str(tmp_path / "report.json")
    write_gradient_file(path, steps=3)
    methods = "fp8-block,hadamard,hadamard-paper,hadamard-nvfp4,hadamard:select=all"
    result = subprocess.run([sys.executable, "-m", "nanogeo.lab.fidelity", path, "--methods", methods,
                             "--json", report], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "TOTAL rel_err" in result.stdout
    report = json.load(open(report))
    wq = "layers.0.attn.wq.weight"
    assert set(report) == set(methods.split(","))
    assert report["hadamard:select=all"]["layers"][wq]["coords"] == "geo"
    assert report["hadamard"]["layers"]["tok_embeddings.weight"]["coords"] == "euclidean"
    # the same bytes as the codec it runs on: the transform sends nothing of its own
    assert report["hadamard"]["total"]["bytes"] == report["fp8-block"]["total"]["bytes"]


def test_train_with_hadamard_coordinates(tiny_corpus, tmp_path, capsys):
    """train.py --comm=hadamard, forced (--geo_layers=all) on two simulated ranks: it learns, the
    checkpoint holds each matrix's signs, the layer table shows the block size."""
    import train
    from test_train import tiny_args
    out = tmp_path / "out"
    result = train.train(train.parse_config(tiny_args(
        tiny_corpus, out, "--max_iters=3", "--eval_interval=3", "--eval_iters=1",
        "--simulate_workers=2", "--comm=hadamard", "--geo_layers=all", "--geo_warmup=1",
        "--hadamard_block=64", "--log_interval=1")))
    assert result["final_val_loss"] < result["initial_val_loss"]
    layers = torch.load(out / "ckpt.pt", weights_only=True)["communicator"]["layers"]
    assert layers and all(l["use_geo"] and l["row_signs"] is None for l in layers.values())
    assert re.search(r"layers\.0\.mlp\.w2\.weight +64x192 +64 +geo/right", capsys.readouterr().out)
    # the gain history: coordinates as sent - Euclidean through the warm-up step and the step
    # the signs are drawn, then every layer (forced)
    history = [json.loads(l) for l in open(out / "log.jsonl") if "geometry_at" in l]
    assert [h["geometry_at"] for h in history] == [1, 2, 3]
    assert all(set(h["coords"]) == set(layers) for h in history)
    assert [{c for c, _ in h["coords"].values()} for h in history] == [
        {"euclidean"}, {"euclidean"}, {"geo"}]
