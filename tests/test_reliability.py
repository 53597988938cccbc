"""Non-finite gradients are skipped on every rank; ranks that drift apart are caught."""
import json
import os

import torch

import model as model_lib
import train
from conftest import run_ranks
from test_train import tiny_args


def patch_optimizer_setup(rank, action):
    """Let `action(model, optimizer)` tamper with rank's model once it is built."""
    original = model_lib.Llama.configure_optimizers

    def patched(self, *args, **kwargs):
        optimizer = original(self, *args, **kwargs)
        action(rank, self, optimizer)
        return optimizer
    model_lib.Llama.configure_optimizers = patched


def poison_third_backward(rank, model, optimizer):
    if rank != 1:
        return
    calls = {"n": 0}

    def hook(grad):
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 3 else grad
    model.norm.weight.register_hook(hook)


def perturb_after_second_step(rank, model, optimizer):
    if rank != 1:
        return
    step, calls = optimizer.step, {"n": 0}

    def tampered(*args, **kwargs):
        out = step(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            with torch.no_grad():
                model.norm.weight[0] += 1e-3
        return out
    optimizer.step = tampered


def tampered_rank(rank, world_size, argv, result_dir, action):
    patch_optimizer_setup(rank, action)
    try:
        result = train.train(train.parse_config(argv))
    except train.RankMismatch as e:
        result = {"error": str(e)}
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_nan_gradient_is_skipped_on_every_rank(tiny_corpus, tmp_path, capfd):
    argv = tiny_args(tiny_corpus, tmp_path / "out", "--max_iters=6", "--comm=geofp8",
                     "--geo_warmup=0", "--geo_rank=4", "--log_interval=1")
    run_ranks(tampered_rank, 2, argv, str(tmp_path), poison_third_backward)
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["param_sha256"] == r1["param_sha256"]
    assert torch.isfinite(torch.tensor(r0["final_val_loss"]))
    assert "step 3: warning: non-finite gradient" in capfd.readouterr().out
    steps = [json.loads(l)["step"] for l in open(tmp_path / "out" / "log.jsonl") if '"step"' in l]
    assert steps == [1, 2, 4, 5, 6]
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert ckpt["communicator"]["step"] == 5  # the skipped step never reached the geometry


def test_rank_divergence_is_caught(tiny_corpus, tmp_path):
    argv = tiny_args(tiny_corpus, tmp_path / "out", "--max_iters=6", "--check_every=2")
    run_ranks(tampered_rank, 2, argv, str(tmp_path), perturb_after_second_step)
    for r in (0, 1):
        result = json.load(open(tmp_path / f"rank{r}.json"))
        assert "parameters differ across ranks at step 2" in result["error"]
