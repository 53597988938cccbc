import json

import torch

from nanogeo.lab import fidelity
from test_compress import planted_workers


def input_moment(d, seed):
    """An anisotropic input second moment (d x d): a few large directions over a small floor."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4096, d, generator=g) * torch.logspace(0, -2, d)
    return a.T @ a / 4096


def write_gradient_file(path, steps=3, world=2, inputs=True):
    planted = planted_workers(96, 128, world, steps)
    g = torch.Generator().manual_seed(0)
    data = {"vocab_size": 500,
            "steps": [[{"layers.0.attn.wq.weight": planted[s][w],
                        "layers.0.attn_norm.weight": torch.randn(128, generator=g),
                        "tok_embeddings.weight": torch.randn(500, 32, generator=g) * 1e-3}
                       for w in range(world)] for s in range(steps)],
            "optimizer_v": {"layers.0.attn.wq.weight": torch.rand(96, 128) * 1e-4,
                            "layers.0.attn_norm.weight": torch.rand(128) * 1e-4,
                            "tok_embeddings.weight": torch.rand(500, 32) * 1e-6}}
    if inputs:
        data["inputs"] = [{"layers.0.attn.wq.weight": input_moment(128, s)} for s in range(steps)]
    torch.save(data, path)


def test_fidelity_contract(tmp_path, capsys):
    path, out = str(tmp_path / "grads.pt"), str(tmp_path / "report.json")
    write_gradient_file(path)
    methods = ["bf16", "fp8-tensor", "fp8-row", "fp8-block", "fp8-paper", "geofp8", "geofp8-paper",
               "geofp8:whiten_factor=diag:select=all", "subspace", "subspace-full", "nvfp4", "geo-nvfp4",
               "subspace-nvfp4", "subspace:geo_rank=4:sides=left"]
    fidelity.main([path, "--methods", ",".join(methods), "--json", out])
    report = json.load(open(out))
    assert set(report) == set(methods)
    for method, result in report.items():
        assert {"rel_err", "cos", "bytes"} <= set(result["total"])
        assert set(result["layers"]) == {"layers.0.attn.wq.weight", "layers.0.attn_norm.weight",
                                         "tok_embeddings.weight"}
        for layer in result["layers"].values():
            assert {"rel_err", "cos", "bytes", "ref_norm", "coords"} <= set(layer)
    wq = "layers.0.attn.wq.weight"
    # the geometry-aware methods use geo coordinates from the second step on (no warm-up here)
    assert report["subspace"]["layers"][wq]["coords"] == "geo"
    assert report["geofp8:whiten_factor=diag:select=all"]["layers"][wq]["coords"] == "geo"
    assert report["subspace"]["layers"]["tok_embeddings.weight"]["coords"] == "euclidean"
    assert report["subspace"]["layers"][wq]["rel_err"] < 0.6 * report["fp8-block"]["layers"][wq]["rel_err"]
    assert report["subspace-nvfp4"]["layers"][wq]["rel_err"] < report["nvfp4"]["layers"][wq]["rel_err"]
    # the paper's collective: one byte per element in a ring, no block scales
    assert report["fp8-paper"]["total"]["bytes"] < report["fp8-block"]["total"]["bytes"]
    assert report["bf16"]["total"]["rel_err"] < report["fp8-block"]["total"]["rel_err"]
    assert report["fp8-block"]["total"]["bytes"] < 0.52 * report["bf16"]["total"]["bytes"]
    assert report["nvfp4"]["total"]["bytes"] < 0.30 * report["bf16"]["total"]["bytes"]
    assert "adam_rel_err" in report["geofp8"]["total"]
    assert "TOTAL rel_err" in capsys.readouterr().out


def test_whitening_needs_inputs(tmp_path):
    path = str(tmp_path / "grads.pt")
    write_gradient_file(path, steps=1, inputs=False)
    try:
        fidelity.main([path, "--methods", "geofp8"])
    except SystemExit as e:
        assert "no 'inputs'" in str(e) and "nanogeo.lab.capture" in str(e)
    else:
        raise AssertionError("expected an error")


def test_fidelity_bad_method(tmp_path):
    path = str(tmp_path / "grads.pt")
    write_gradient_file(path, steps=1)
    try:
        fidelity.main([path, "--methods", "int4"])
    except SystemExit as e:
        assert "unknown method" in str(e)
    else:
        raise AssertionError("expected an error")
