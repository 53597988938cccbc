"""Non-finite gradients are skipped on every rank; ranks that drift apart are caught; a resumed
run ends where an uninterrupted one does, also past a damaged checkpoint."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import model as model_lib
import train
from conftest import ROOT, run_ranks
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
                     "--geo_warmup=0", "--geo_rank=4", "--log_interval=1", "--geo_layers=all")
    run_ranks(tampered_rank, 2, argv, str(tmp_path), poison_third_backward)
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["param_sha256"] == r1["param_sha256"]
    assert torch.isfinite(torch.tensor(r0["final_val_loss"]))
    assert "step 3: warning: non-finite gradient" in capfd.readouterr().out
    steps = [json.loads(l)["step"] for l in open(tmp_path / "out" / "log.jsonl") if '"step"' in l]
    assert steps == [1, 2, 4, 5, 6]
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert ckpt["communicator"]["step"] == 5  # the skipped step never reached the geometry


def test_a_skipped_last_step_is_still_evaluated(tiny_corpus, tmp_path):
    """The final val loss is measured even when the last step is skipped (before: the step-0
    evaluation was reported as the final one - a diverged run looked untrained, not diverged)."""
    argv = tiny_args(tiny_corpus, tmp_path / "out", "--max_iters=3", "--eval_interval=3",
                     "--log_interval=1")
    run_ranks(tampered_rank, 2, argv, str(tmp_path), poison_third_backward)
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    [(step, loss)] = r0["final_val_losses"]
    assert step == 3 and loss == r1["final_val_losses"][0][1] and loss < r0["initial_val_loss"]


def test_rank_divergence_is_caught(tiny_corpus, tmp_path):
    argv = tiny_args(tiny_corpus, tmp_path / "out", "--max_iters=6", "--check_every=2")
    run_ranks(tampered_rank, 2, argv, str(tmp_path), perturb_after_second_step)
    for r in (0, 1):
        result = json.load(open(tmp_path / f"rank{r}.json"))
        assert "parameters differ across ranks at step 2" in result["error"]


# forced (--geo_layers=all): on the char-study model no layer passes the gain check within 6 steps
@pytest.mark.parametrize("method", [("--comm=subspace", "--geo_rank=4", "--stochastic_round"),
                                    ("--comm=geofp8", "--geo_refresh=2", "--whiten_rank=4")])
def test_resume_is_exact(tiny_corpus, tmp_path, monkeypatch, method):
    """Interrupted at step 4 and resumed from the step-3 checkpoint = never interrupted, bit for
    bit, with the geometry (rotation bases; or whitening moments and factors, refreshed across
    the interruption), error feedback and (once) stochastic rounding in play."""
    extra = ("--max_iters=6", "--ckpt_interval=3", "--geo_warmup=1", *method, "--error_feedback",
             "--geo_layers=all")
    whole, resumed = interrupted_and_resumed(tiny_corpus, tmp_path, monkeypatch, extra)
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    for name in ("ckpt-0000003.pt", "ckpt.pt"):     # geometry in use before and after the crash
        layers = torch.load(tmp_path / "b" / name, weights_only=True)["communicator"]["layers"]
        assert any(layer["use_geo"] for layer in layers.values())


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
    # 200 steps of tens of milliseconds: seconds between the kill at step >= 12 and the end,
    # however fast or loaded the machine (the outcome does not depend on when it is killed)
    argv = tiny_args(tiny_corpus, tmp_path / "whole", "--max_iters=200", "--ckpt_interval=5",
                     "--eval_interval=200", "--log_interval=1")
    run_ranks(train_rank_summary, 2, argv, str(tmp_path))
    whole = json.load(open(tmp_path / "rank0.json"))

    out = tmp_path / "elastic"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=3", "train.py",
           *tiny_args(tiny_corpus, out, "--max_iters=200", "--ckpt_interval=5",
                      "--eval_interval=200", "--log_interval=1")]
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


@pytest.mark.parametrize("stages", ["1", "both"])
def test_two_rank_resume_with_error_feedback_is_exact(tiny_corpus, tmp_path, stages):
    """Error feedback keeps one residual per rank (stage 2's: the rank's own shard's, beside);
    each rank checkpoints its own (residuals-rankR-stepS.pt next to ckpt.pt), so a 2-rank run
    that crashed at step 4 and resumed from step 3 ends bit-identical to an uninterrupted one.
    A resume on another world size or without the residual files is refused."""
    extra = ("--max_iters=6", "--ckpt_interval=3", "--comm=subspace", "--geo_rank=4",
             "--geo_warmup=1", "--error_feedback", f"--feedback_stages={stages}")
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


def test_a_damaged_ckpt_pt_resumes_from_the_kept_one_on_every_rank(tiny_corpus, tmp_path, capfd):
    """ckpt.pt cut in half (a full disk, a copy cut short): --resume on 2 ranks warns once,
    naming the file, keeps it as ckpt.pt.damaged.2 (an earlier ckpt.pt.damaged stays as it
    was) and continues from the kept ckpt-0000002.pt with the per-rank residuals of step 2:
    bit-identical to a resume from that file directly, and to the uninterrupted run."""
    extra = ("--max_iters=4", "--ckpt_interval=2", "--comm=subspace", "--geo_rank=4",
             "--geo_warmup=1", "--error_feedback")
    a, direct = tmp_path / "a", tmp_path / "direct"
    run_ranks(crashing_rank, 2, tiny_args(tiny_corpus, a, *extra), str(tmp_path), None)
    whole = json.load(open(tmp_path / "rank0.json"))
    shutil.copytree(a, direct)
    os.replace(direct / "ckpt-0000002.pt", direct / "ckpt.pt")
    run_ranks(crashing_rank, 2, tiny_args(tiny_corpus, direct, *extra, "--resume"), str(tmp_path),
              None)
    from_kept = json.load(open(tmp_path / "rank0.json"))

    cut = (a / "ckpt.pt").read_bytes()
    cut = cut[: len(cut) // 2]
    (a / "ckpt.pt").write_bytes(cut)
    (a / "ckpt.pt.damaged").write_bytes(b"an earlier damaged checkpoint")
    capfd.readouterr()
    run_ranks(crashing_rank, 2, tiny_args(tiny_corpus, a, *extra, "--resume"), str(tmp_path), None)
    out = capfd.readouterr().out
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["param_sha256"] == r1["param_sha256"] == from_kept["param_sha256"]
    assert r0["param_sha256"] == whole["param_sha256"]
    [warning] = [line for line in out.splitlines() if "warning" in line]
    assert warning.startswith(f"train.py: warning: {a / 'ckpt.pt'} does not load (")
    assert warning.endswith(f"; kept as {a / 'ckpt.pt.damaged.2'}; resuming from "
                            f"{a / 'ckpt-0000002.pt'}")
    assert f"resumed from {a / 'ckpt-0000002.pt'} at step 2" in out
    assert (a / "ckpt.pt.damaged.2").read_bytes() == cut
    assert (a / "ckpt.pt.damaged").read_bytes() == b"an earlier damaged checkpoint"
    assert torch.load(a / "ckpt.pt", weights_only=True)["step"] == 4


def test_without_a_checkpoint_that_loads_resume_is_one_error_naming_the_files(tiny_corpus,
                                                                              tmp_path, capsys):
    """A missing ckpt.pt: resumed from the kept one, with a warning. ckpt.pt and the kept one
    both cut short: one error line naming both, exit 2, every file left as it was; a fresh run
    with --overwrite then moves both aside."""
    out = tmp_path / "out"
    args = tiny_args(tiny_corpus, out, "--max_iters=2", "--ckpt_interval=1")
    train.train(train.parse_config(args))
    os.remove(out / "ckpt.pt")
    assert train.train(train.parse_config(args + ["--resume"]))["steps"] == 1
    assert (f"train.py: warning: {out / 'ckpt.pt'} is missing; resuming from "
            f"{out / 'ckpt-0000001.pt'}") in capsys.readouterr().out

    names = ("ckpt.pt", "ckpt-0000001.pt")
    for name in names:
        (out / name).write_bytes((out / name).read_bytes()[:1000])
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    result = subprocess.run([sys.executable, "train.py", *args, "--resume"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith(f"train.py: error: --resume but no checkpoint in {out} loads: "
                                    f"{out / 'ckpt.pt'} (")
    assert f"{out / 'ckpt-0000001.pt'} (" in result.stderr and "--overwrite=true" in result.stderr
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before

    train.train(train.parse_config(tiny_args(tiny_corpus, out, "--max_iters=1", "--overwrite")))
    for name in names:
        assert (out / (name + ".old")).read_bytes() == before[name]
    assert not (out / "ckpt-0000001.pt").exists()
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 1


def first_intact_rank(rank, world_size, paths, result_dir):
    """checkpoint.first_intact on one rank of two; rank 1 cannot read the first file (a flaky
    mount, a stale cache), which loads on rank 0."""
    import torch.distributed as dist
    from nanogeo.run import checkpoint
    dist.init_process_group("gloo")
    if rank == 1:
        load = checkpoint.load_checkpoint
        checkpoint.load_checkpoint = lambda path, device: (
            (None, "Input/output error") if path == paths[0] else load(path, device))
    chosen, ckpt, unreadable = checkpoint.first_intact(paths, torch.device("cpu"))
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"chosen": chosen, "step": ckpt["step"], "unreadable": unreadable}, f)
    dist.destroy_process_group()


def test_every_rank_resumes_from_the_same_file(tmp_path):
    """A checkpoint counts only if it loads on every rank: rank 0, which could read the newer
    one, resumes from the older one too."""
    paths = [str(tmp_path / name) for name in ("ckpt.pt", "ckpt-0000003.pt")]
    for path, step in zip(paths, (6, 3)):
        torch.save({"model": {}, "step": step, "config": {}}, path)
    run_ranks(first_intact_rank, 2, paths, str(tmp_path))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["chosen"] == r1["chosen"] == paths[1] and r0["step"] == r1["step"] == 3
    assert r0["unreadable"] == [[paths[0], "does not load on another rank"]]
    assert r1["unreadable"] == [[paths[0], "Input/output error"]]


def test_a_kept_checkpoint_is_a_copy_where_there_are_no_hard_links(tmp_path, monkeypatch):
    from nanogeo.run import checkpoint

    def no_hard_links(src, dst):
        raise OSError("hard links are not supported here")
    monkeypatch.setattr(os, "link", no_hard_links)
    (tmp_path / "ckpt.pt").write_bytes(b"the step-3 checkpoint")
    checkpoint.keep_copy(str(tmp_path / "ckpt.pt"), str(tmp_path / "ckpt-0000003.pt"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000003.pt", "ckpt.pt"]
    assert (tmp_path / "ckpt-0000003.pt").read_bytes() == b"the step-3 checkpoint"
    assert (tmp_path / "ckpt.pt").read_bytes() == b"the step-3 checkpoint"


def own_disk_rank(rank, world_size, argv, result_dir, elastic, shared=False):
    """train.py on one of two ranks that each see only their own out_dir (two nodes without a
    shared filesystem; shared: argv's out_dir); its ConfigError, if any, to rankR.json. A hang
    ends the process after a minute (faulthandler), failing the test."""
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)
    if elastic:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    own = [] if shared else [f"--out_dir={result_dir}/rank{rank}"]
    try:
        train.train(train.parse_config([*argv, *own]))
        error = None
    except train.ConfigError as e:
        error = str(e)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error}, f)


@pytest.mark.parametrize("elastic", [False, True])
def test_resume_without_a_shared_filesystem_fails_fast_on_every_rank(tiny_corpus, tmp_path,
                                                                      elastic):
    """Two ranks, each with its own disk: rank 0's out_dir holds a checkpoint, rank 1's is
    empty. A resume (--resume, or an elastic restart) stops on both ranks with one line naming
    the shared-filesystem requirement - before, rank 1 took the fresh-run branch (or failed to
    load) while rank 0 waited for it in a collective."""
    argv = tiny_args(tiny_corpus, tmp_path / "rank0", "--max_iters=2")
    train.train(train.parse_config(argv))
    run_ranks(own_disk_rank, 2, [a for a in argv if not a.startswith("--out_dir")]
              + ([] if elastic else ["--resume"]), str(tmp_path), elastic)
    for rank in (0, 1):
        error = json.load(open(tmp_path / f"rank{rank}.json"))["error"]
        assert error == (f"rank 1 cannot see {tmp_path / 'rank1' / 'ckpt.pt'}, which rank 0 "
                         "resumes from: a resume needs --out_dir on a filesystem that every rank "
                         "shares (on several nodes: a shared mount; docs/guide.md)")


def test_a_missing_residual_file_stops_every_rank(tiny_corpus, tmp_path):
    """With --error_feedback each rank resumes its own residual file, looking for it alone (no
    rank needs another's file on its disk); a missing one stops every rank, naming it."""
    argv = tiny_args(tiny_corpus, tmp_path / "out", "--max_iters=2", "--comm=fp8",
                     "--error_feedback")
    run_ranks(crashing_rank, 2, argv, str(tmp_path), None)
    missing = tmp_path / "out" / "residuals-rank00001-step0000002.pt"
    os.remove(missing)
    run_ranks(own_disk_rank, 2, [*argv, "--max_iters=3", "--resume"], str(tmp_path), False, True)
    for rank in (0, 1):
        assert json.load(open(tmp_path / f"rank{rank}.json"))["error"] == (
            f"{missing} is missing: with --error_feedback every rank resumes its own residual; "
            "restore the file or start a new run")
