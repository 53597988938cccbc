"""FP8 reduce-scatter under FSDP2 on a model we did not write, against fp32 FSDP2 (gloo, CPU)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import run_ranks


def build():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=128, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2)


def fsdp_rank(rank, world_size, out, fmt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from nanogeo.fsdp import FP8ReduceScatter
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size,))
    models = []
    comms = []
    for custom in (False, True):
        model = build()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if custom:
            for module in [*model.layers, model]:
                comm = FP8ReduceScatter(fmt=fmt)
                module.set_custom_reduce_scatter(comm)
                comms.append(comm)
        models.append(model)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 10, 64, generator=g)
    for model in models:
        model(x).pow(2).mean().backward()
    ref, got = ([p.grad.to_local() for p in m.parameters()] for m in models)
    num = sum((a - b).pow(2).sum() for a, b in zip(ref, got))
    den = sum(a.pow(2).sum() for a in ref)
    torch.save({"rel_err": (num / den).sqrt().item(), "bytes": sum(c.bytes_sent for c in comms),
                "numel": sum(a.numel() for a in ref)}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_fp8_reduce_scatter_close_to_fp32(tmp_path):
    out = str(tmp_path / "fsdp")
    run_ranks(fsdp_rank, 2, out, "e4m3")
    for r in (0, 1):
        result = torch.load(f"{out}.{r}")
        assert 0 < result["rel_err"] < 0.05
        # one all_to_all: ~(1 + 4/128) bytes per element of this rank's shard, to one peer
        assert result["numel"] <= result["bytes"] <= 1.04 * result["numel"]


def test_fsdp2_nvfp4_reduce_scatter(tmp_path):
    out = str(tmp_path / "fsdp")
    run_ranks(fsdp_rank, 2, out, "nvfp4")
    assert 0 < torch.load(f"{out}.0")["rel_err"] < 0.2
