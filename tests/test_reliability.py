"""Non-finite gradients are skipped on every rank; ranks that drift apart are caught."""
import json
import os

import pytest
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


@pytest.mark.parametrize("method", [("--comm=subspace", "--geo_rank=4", "--stochastic_round"),
                                    ("--comm=geofp8", "--geo_refresh=2", "--whiten_rank=4")])
def test_resume_is_exact(tiny_corpus, tmp_path, monkeypatch, method):
    """Interrupted at step 4 and resumed from the step-3 checkpoint = never interrupted, bit for
    bit, with the geometry (rotation bases; or whitening moments and factors, refreshed across
    the interruption), error feedback and (once) stochastic rounding in play."""
    extra = ("--max_iters=6", "--ckpt_interval=3", "--geo_warmup=1", *method, "--error_feedback")
    whole, resumed = interrupted_and_resumed(tiny_corpus, tmp_path, monkeypatch, extra)
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["final_train_loss"] == whole["final_train_loss"]


def test_resume_is_exact_with_muon(tiny_corpus, tmp_path, monkeypatch):
    """The same with --optimizer=muon: Muon's momentum buffers and AdamW's moments both come
    back from the checkpoint; an AdamW resume of it is refused."""
    extra = ("--max_iters=6", "--ckpt_interval=3", "--optimizer=muon")
    whole, resumed = interrupted_and_resumed(tiny_corpus, tmp_path, monkeypatch, extra)
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["muon"]["state"]
    with pytest.raises(train.ConfigError, match="--optimizer=muon run"):
        train.train(train.parse_config(tiny_args(tiny_corpus, tmp_path / "b", "--resume")))


def interrupted_and_resumed(tiny_corpus, tmp_path, monkeypatch, extra):
    """(summary of the whole run in tmp_path/a, summary of the run in tmp_path/b that crashed at
    step 4 and was resumed from its step-3 checkpoint)."""
    whole = train.train(train.parse_config(tiny_args(tiny_corpus, tmp_path / "a", *extra)))
    assert sorted(os.listdir(tmp_path / "a")) == ["ckpt-0000003.pt", "ckpt.pt", "log.jsonl"]

    schedule = train.learning_rate

    def crash_at_step_4(cfg, step):
        if step == 4:
            raise KeyboardInterrupt("simulated crash")
        return schedule(cfg, step)
    monkeypatch.setattr(train, "learning_rate", crash_at_step_4)
    try:
        train.train(train.parse_config(tiny_args(tiny_corpus, tmp_path / "b", *extra)))
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(train, "learning_rate", schedule)
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["step"] == 3
    resumed = train.train(train.parse_config(tiny_args(tiny_corpus, tmp_path / "b", *extra,
                                                       "--resume")))
    return whole, resumed


def test_elastic_restart_resumes_and_finishes(tiny_corpus, tmp_path):
    """torchrun --max-restarts=3: SIGKILL one worker mid-run; the group restarts, resumes from
    the last checkpoint and ends exactly where an uninterrupted run ends."""
    import signal
    import subprocess
    import sys
    import time
    from conftest import ROOT
    argv = tiny_args(tiny_corpus, tmp_path / "whole", "--max_iters=30", "--ckpt_interval=5",
                     "--eval_interval=30", "--log_interval=1")
    run_ranks(train_rank_summary, 2, argv, str(tmp_path))
    whole = json.load(open(tmp_path / "rank0.json"))

    out = tmp_path / "elastic"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=3", "train.py",
           *tiny_args(tiny_corpus, out, "--max_iters=30", "--ckpt_interval=5",
                      "--eval_interval=30", "--log_interval=1")]
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    killed, deadline = False, time.time() + 240
    while not killed and time.time() < deadline and launcher.poll() is None:
        log = out / "log.jsonl"
        steps = [json.loads(l).get("step", 0) for l in open(log)] if log.exists() else []
        if steps and max(steps) >= 12 and (out / "ckpt.pt").exists():
            workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                     text=True).stdout.split()
            if workers:
                os.kill(int(workers[-1]), signal.SIGKILL)
                killed = True
        time.sleep(0.05)
    output, _ = launcher.communicate(timeout=240)
    assert killed, "the run ended before a worker could be killed"
    assert launcher.returncode == 0, output[-3000:]
    assert "(elastic restart " in output
    summary = [json.loads(l) for l in open(out / "log.jsonl")][-1]["summary"]
    assert summary["param_sha256"] == whole["param_sha256"]
    assert summary["final_val_loss"] == whole["final_val_loss"]


def train_rank_summary(rank, world_size, argv, result_dir):
    result = train.train(train.parse_config(argv))
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def crashing_rank(rank, world_size, argv, result_dir, crash_at):
    """train.py on one rank; with crash_at, every rank dies at that step (after the checkpoint
    before it), as a node failure would end the job."""
    import torch.distributed as dist
    if crash_at is not None:
        schedule = train.learning_rate

        def crash(cfg, step):
            if step == crash_at:
                raise KeyboardInterrupt("simulated crash")
            return schedule(cfg, step)
        train.learning_rate = crash
    try:
        result = train.train(train.parse_config(argv))
    except KeyboardInterrupt:
        result = {}
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_two_rank_resume_with_error_feedback_is_exact(tiny_corpus, tmp_path):
    """Error feedback keeps one residual per rank; each rank checkpoints its own (residuals-
    rankR-stepS.pt next to ckpt.pt), so a 2-rank run that crashed at step 4 and resumed from
    step 3 ends bit-identical to an uninterrupted one. A resume on another world size or
    without the residual files is refused."""
    extra = ("--max_iters=6", "--ckpt_interval=3", "--comm=subspace", "--geo_rank=4",
             "--geo_warmup=1", "--error_feedback")
    run_ranks(crashing_rank, 2, tiny_args(tiny_corpus, tmp_path / "a", *extra), str(tmp_path), None)
    whole = json.load(open(tmp_path / "rank0.json"))
    b = tmp_path / "b"
    run_ranks(crashing_rank, 2, tiny_args(tiny_corpus, b, *extra), str(tmp_path), 4)
    assert sorted(f for f in os.listdir(b) if f.startswith("residuals")) == [
        "residuals-rank00000-step0000003.pt", "residuals-rank00001-step0000003.pt"]
    r1 = torch.load(b / "residuals-rank00001-step0000003.pt", weights_only=True)
    assert any(t.abs().sum() > 0 for t in r1.values())            # rank 1's own, not zeros
    with pytest.raises(train.ConfigError, match="residuals for 2 ranks"):
        train.train(train.parse_config(tiny_args(tiny_corpus, b, *extra, "--resume")))
    run_ranks(crashing_rank, 2, tiny_args(tiny_corpus, b, *extra, "--resume"), str(tmp_path), None)
    resumed = json.load(open(tmp_path / "rank0.json"))
    assert resumed["param_sha256"] == whole["param_sha256"]


def test_resume_refuses_other_numerics_and_overwrite_moves_the_old_run_aside(tiny_corpus, tmp_path):
    out = tmp_path / "out"
    train.train(train.parse_config(tiny_args(tiny_corpus, out, "--max_iters=2", "--comm=fp8")))
    for flag, value in (("comm", "subspace"), ("fmt", "e5m2"), ("geo_rank", "8")):
        with pytest.raises(train.ConfigError, match=f"--{flag}="):
            train.train(train.parse_config(tiny_args(tiny_corpus, out, "--max_iters=4", "--resume",
                                                     "--comm=fp8", f"--{flag}={value}")))
    before = (out / "ckpt.pt").read_bytes()
    train.train(train.parse_config(tiny_args(tiny_corpus, out, "--max_iters=1", "--overwrite")))
    assert (out / "ckpt.pt.old").read_bytes() == before     # an elastic restart cannot find it
