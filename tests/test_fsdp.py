"""FP8 and GeoFP8 reduce-scatter under FSDP2 on models we did not write, against fp32 FSDP2
(gloo, CPU, 2 ranks)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import GPT2Block, GPT2Shaped, conv1d_weights, run_ranks

VOCAB, D = 300, 64


def encoder():
    layer = nn.TransformerEncoderLayer(D, nhead=4, dim_feedforward=128, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2)


def language_model():
    return nn.Sequential(nn.Embedding(VOCAB, D), encoder(), nn.Linear(D, VOCAB))


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for module in model.modules():
        if isinstance(module, (nn.TransformerEncoderLayer, GPT2Block)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def twins(build, world_size, init=True):
    """Join the gloo group (init); two identically initialised FSDP2 copies of build()."""
    from torch.distributed.device_mesh import init_device_mesh
    if init:
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size,))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(shard(build(), mesh))
    return models


def relative_error(ref_model, model):
    ref, got = ([p.grad.to_local() for p in m.parameters()] for m in (ref_model, model))
    num = sum((a - b).pow(2).sum() for a, b in zip(ref, got))
    den = sum(a.pow(2).sum() for a in ref)
    return (num / den).sqrt().item(), sum(a.numel() for a in ref)


def fp8_rank(rank, world_size, out, fmt):
    """The parameter-agnostic FP8ReduceScatter on a plain encoder."""
    from nanogeo.parallel.fsdp import FP8ReduceScatter
    ref, model = twins(encoder, world_size)
    comms = []
    for module in [*model.layers, model]:
        comms.append(FP8ReduceScatter(fmt=fmt))
        module.set_custom_reduce_scatter(comms[-1])
    x = torch.randn(4, 10, D, generator=torch.Generator().manual_seed(rank))
    for m in (ref, model):
        m(x).pow(2).mean().backward()
    err, numel = relative_error(ref, model)
    torch.save({"rel_err": err, "bytes": sum(c.bytes_sent for c in comms), "numel": numel},
               f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_fp8_reduce_scatter_close_to_fp32(tmp_path):
    out = str(tmp_path / "fsdp")
    run_ranks(fp8_rank, 2, out, "e4m3")
    for r in (0, 1):
        result = torch.load(f"{out}.{r}")
        assert 0 < result["rel_err"] < 0.05
        # one all_to_all: ~(1 + 4/128) bytes per element of this rank's shard, to one peer
        assert result["numel"] <= result["bytes"] <= 1.04 * result["numel"]


def test_fsdp2_nvfp4_reduce_scatter(tmp_path):
    out = str(tmp_path / "fsdp")
    run_ranks(fp8_rank, 2, out, "nvfp4")
    assert 0 < torch.load(f"{out}.0")["rel_err"] < 0.2


def geo_rank(rank, world_size, out, options):
    """CompressedReduceScatter on an embedding + encoder + head, trained a few steps with SGD; the
    fp32 reference model is re-synced to it every step and both see the same batch."""
    from nanogeo.parallel.fsdp import use_compressed_reduce_scatter
    import compress
    ref, model = twins(language_model, world_size)
    comms = use_compressed_reduce_scatter(model, min_numel=1024, vocab_size=VOCAB, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    errors, senders, quantize_bucket = [], set(), compress.quantize_bucket

    def recording(tensors, layout):         # whose stream each stage-1 send draws from
        senders.add(getattr(layout, "sender", None))
        return quantize_bucket(tensors, layout)
    compress.quantize_bucket = recording
    for step in range(8):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, VOCAB, (4, 16), generator=g)
        y = torch.roll(x, -1, dims=1)
        for m in (ref, model):
            m.zero_grad()
            loss_fn(m(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        errors.append(relative_error(ref, model)[0])
        opt.step()
        with torch.no_grad():
            for a, b in zip(ref.parameters(), model.parameters()):
                a.copy_(b)
    coords = {n: c.comm.coords(n) for c in comms for n in c.names}
    from nanogeo.parallel import fsdp
    fresh = use_compressed_reduce_scatter(twins(language_model, world_size, init=False)[1],
                                          min_numel=1024, vocab_size=VOCAB, **options)
    fsdp.load_state_dict(fresh, fsdp.state_dict(comms))     # the geometry survives a restart
    restored = all(torch.equal(a, b) for c, f in zip(comms, fresh)
                   for n in c.comm.layers if c.comm.layers[n].built
                   for a, b in zip(c.comm.layers[n].tensors(), f.comm.layers[n].tensors()))
    restored &= all(f.comm.coords(n) == coords[n] for f in fresh for n in f.names)
    compress.quantize_bucket = quantize_bucket
    full = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    torch.save({"errors": errors, "coords": coords, "params": full, "restored": restored,
                "senders": sorted(senders, key=str),
                "bytes": sum(c.bytes_sent for c in comms),
                "geometry_bytes": sum(c.geometry_bytes for c in comms),
                "fallbacks": sum(c.fallbacks for c in comms)}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_subspace_reduce_scatter_close_to_fp32(tmp_path):
    out = str(tmp_path / "geo")
    run_ranks(geo_rank, 2, out, {"geometry": "subspace", "geo_rank": 8, "geo_warmup": 1, "geo_refresh": 2,
                                     "sides": "both"})
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    print("subspace FSDP2 relative gradient error per step:", [f"{e:.4f}" for e in r0["errors"]])
    assert max(r0["errors"]) < 0.05 and max(r1["errors"]) < 0.05
    assert torch.equal(r0["params"], r1["params"])
    assert r0["coords"]["0.weight"] == "euclidean"         # the vocabulary dimension
    assert "geo" in r0["coords"].values()                  # some encoder matrices switched
    assert r0["geometry_bytes"] > 0 and r0["fallbacks"] == 0
    assert r0["restored"] and r1["restored"]
    # geometry-aware decoding costs r n fp32 numbers per matrix: small next to the gradients
    assert r0["geometry_bytes"] < 0.5 * r0["bytes"]


def test_fsdp2_stochastic_rounding_sends_from_each_ranks_stream(tmp_path):
    """--stochastic_round under FSDP2: each rank's send draws from its own stream (the layout
    is made for the rank that sends; one made without would refuse), the ranks agree on the
    parameters, and the gradients stay close to fp32's (unbiased rounding)."""
    out = str(tmp_path / "stochastic")
    run_ranks(geo_rank, 2, out, {"geometry": "euclidean", "stochastic_round": True})
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert max(r0["errors"]) < 0.05 and max(r1["errors"]) < 0.05
    assert torch.equal(r0["params"], r1["params"]) and r0["fallbacks"] == 0
    assert (r0["senders"], r1["senders"]) == ([0], [1])


def test_fsdp2_rejects_error_feedback(tmp_path):
    run_ranks(reject_rank, 1, str(tmp_path))


def test_the_fsdp_entry_point_is_named_for_what_it_runs():
    """use_compressed_reduce_scatter runs the rotation, the Hadamard control or Euclidean FP8;
    asked for the published GeoFP8 it says which geometries FSDP supports and why not this one.
    Its old name, use_geofp8, still works for a release, with a DeprecationWarning."""
    import pytest
    from nanogeo.parallel import fsdp
    for refused in (dict(geometry="geofp8"), dict(geometry="euclidean", collective="fp8-sum")):
        with pytest.raises(ValueError, match="supports geometry='subspace' .*'hadamard' or "
                                             "'euclidean'.*inputs' second moments.*DDP"):
            fsdp.CompressedReduceScatter(None, **refused)
    with pytest.warns(DeprecationWarning, match="use_compressed_reduce_scatter"), \
            pytest.raises(ValueError, match="call fully_shard first"):
        fsdp.use_geofp8(nn.Linear(8, 8))            # the alias reaches the new function
    with pytest.raises(ValueError, match="call fully_shard first"):
        fsdp.use_compressed_reduce_scatter(nn.Linear(8, 8))


def reject_rank(rank, world_size, out):
    import pytest
    from torch.distributed.device_mesh import init_device_mesh
    from nanogeo.parallel.fsdp import use_compressed_reduce_scatter
    dist.init_process_group("gloo")
    model = shard(language_model(), init_device_mesh("cpu", (world_size,)))
    with pytest.raises(ValueError, match="error_feedback"):
        use_compressed_reduce_scatter(model, error_feedback=True)
    dist.destroy_process_group()


def unaligned_rank(rank, world_size, out):
    """A matrix whose rank chunks (45 rows x 64) are not whole 128-element blocks: core
    scattering is turned off for it (with a notice), everything else as usual."""
    import warnings
    from nanogeo.parallel.fsdp import use_compressed_reduce_scatter

    def build():
        return nn.Sequential(nn.Linear(64, 90), nn.ReLU(), nn.Linear(90, 128), nn.ReLU(),
                             nn.Linear(128, 64))
    ref, model = twins(build, world_size)
    comms = use_compressed_reduce_scatter(model, min_numel=1024, select="all", sides="both",
                                          geo_warmup=0, geo_refresh=1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for m in (ref, model):
                m.zero_grad()
                m(x).pow(2).mean().backward()
    layers = {n: l for c in comms for n, l in c.comm.layers.items()}
    torch.save({"swaps": {n: l.swaps is not None for n, l in layers.items()},
                "notices": [str(w.message) for w in caught if "core scattering" in str(w.message)],
                "err": relative_error(ref, model)[0]}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_unaligned_chunks_turn_core_scattering_off(tmp_path):
    out = str(tmp_path / "unaligned")
    run_ranks(unaligned_rank, 2, out)
    r = torch.load(f"{out}.0")
    # per rank: 45 x 64 = 22.5 blocks; 64 x 90 = 45 blocks; 32 x 128 = 32 blocks
    assert r["swaps"] == {"0.weight": False, "2.weight": True, "4.weight": True}
    assert len(r["notices"]) == 1 and r["err"] < 0.05


def resume_rank(rank, world_size, out):
    """GPT-2 shapes under FSDP2 with its Conv1D weights named as candidates: six AdamW steps
    straight, and three + save (local shards, optimizer, reduce-scatters' state) + fresh models,
    optimizer and reduce-scatters + load + three. The same parameters, bit for bit."""
    import io
    from torch.distributed.device_mesh import init_device_mesh
    from nanogeo.parallel import fsdp
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size,))
    loss_fn = nn.CrossEntropyLoss()

    def fresh():
        torch.manual_seed(0)
        model = shard(GPT2Shaped(VOCAB, D), mesh)
        comms = fsdp.use_compressed_reduce_scatter(model, linear=conv1d_weights(model),
                                                   min_numel=1024, geo_rank=8, geo_warmup=1,
                                                   geo_refresh=2)
        return model, comms, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model, opt, steps):
        for step in steps:
            x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(
                1000 * step + rank))
            opt.zero_grad()
            loss_fn(model(x).reshape(-1, VOCAB), torch.roll(x, -1, 1).reshape(-1)).backward()
            opt.step()

    def weights(model):
        return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])

    model, comms, opt = fresh()
    train(model, opt, range(6))
    straight = weights(model)
    model, comms, opt = fresh()
    train(model, opt, range(3))
    buffer = io.BytesIO()                       # through torch.save, as a checkpoint goes
    torch.save({"model": [p.to_local().detach() for p in model.parameters()],
                "opt": opt.state_dict(), "comms": fsdp.state_dict(comms)}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model, comms, opt = fresh()
    with torch.no_grad():
        for p, local in zip(model.parameters(), saved["model"]):
            p.to_local().copy_(local)
    opt.load_state_dict(saved["opt"])
    fsdp.load_state_dict(comms, saved["comms"])
    train(model, opt, range(3, 6))
    geo = {n for c in comms for n in c.names if c.comm.sent_in_geometry(n)}
    torch.save({"equal": torch.equal(straight, weights(model)), "geo": geo,
                "conv1d": conv1d_weights(model)}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_resume_on_a_gpt2_shaped_model_is_bit_identical(tmp_path):
    out = str(tmp_path / "resume")
    run_ranks(resume_rank, 2, out)
    for rank in range(2):
        r = torch.load(f"{out}.{rank}")
        assert r["equal"]
        assert r["geo"] and r["geo"] <= r["conv1d"]     # only the named matrices rotate


def test_row_scaling_of_a_one_dimensional_chunk_is_one_scale():
    """block='row' on a 1-D parameter (a bias, FP8ReduceScatter's flat rows): one scale per
    rank's chunk, as compress.ShardLayout does - not one per element."""
    from nanogeo.parallel.fsdp import row_chunks
    assert row_chunks(((1000,),), "e4m3", "row", 2).nbytes == [1004, 1004]
    assert row_chunks(((4, 250),), "e4m3", "row", 2).nbytes == [4 * 4 + 1000] * 2
