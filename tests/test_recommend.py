"""--comm=auto, train.py's default: the study's pick for the optimizer in force (nanogeo/run/
recommend.py), read from the file the study tool writes with the README's table."""

import json
import os

import pytest

import train
from conftest import ROOT
from nanogeo.lab.study import recommended
from nanogeo.lab.study.report import load_results
from nanogeo.run import config, recommend
from nanogeo.run.config import ConfigError

ROWS = [{"optimizer": "muon", "workers": 32, "wire": "FP8", "arm": "subspace",
         "flags": ["--comm=subspace"]},
        {"optimizer": "muon", "workers": 64, "wire": "FP8", "arm": "fp8-ef",
         "flags": ["--comm=fp8", "--error_feedback"]},
        {"optimizer": "muon", "workers": 32, "wire": "4-bit", "arm": "nvfp4",
         "flags": ["--comm=fp8", "--fmt=nvfp4"]},
        {"optimizer": "adamw", "workers": 32, "wire": "FP8", "arm": "fp8-paper",
         "flags": ["--comm=fp8", "--fmt=e5m2", "--block=tensor", "--collective=fp8-sum"]}]


@pytest.fixture
def picks(tmp_path):
    path = tmp_path / "recommended.json"
    path.write_text(json.dumps({"picks": ROWS}))
    return str(path)


def resolve(argv, ranks, path):
    cfg = train.parse_config(argv)
    return recommend.resolve(cfg, ranks, train.TrainConfig(**config.TRAIN_PRESETS[cfg.preset]),
                             path)


def test_auto_is_the_default_and_runs_fp32_on_one_rank(picks):
    assert train.parse_config([]).comm == "auto"
    cfg, why = resolve(["--optimizer=muon"], 1, picks)
    assert cfg.comm == "fp32" and "one data-parallel rank" in why


def test_auto_takes_the_pick_of_the_optimizer_at_the_nearest_w(picks):
    cfg, why = resolve(["--optimizer=muon"], 4, picks)              # 4 ranks: W = 32's row
    assert cfg.comm == "subspace" and "subspace" in why and "W = 32" in why
    cfg, why = resolve(["--optimizer=muon"], 48, picks)             # 48 is nearer 64 in ratio
    assert (cfg.comm, cfg.error_feedback) == ("fp8", True) and "W = 64" in why
    cfg, _ = resolve([], 8, picks)                                  # AdamW, the default
    assert (cfg.comm, cfg.fmt, cfg.block, cfg.collective) == ("fp8", "e5m2", "tensor", "fp8-sum")


def test_auto_takes_the_row_of_the_wire_the_flags_choose(picks):
    cfg, why = resolve(["--optimizer=muon", "--fmt=nvfp4"], 16, picks)
    assert (cfg.comm, cfg.fmt) == ("fp8", "nvfp4") and "on the 4-bit wire" in why
    with pytest.raises(ConfigError, match="4-bit \\+ FP8 wire"):     # no such row in ROWS
        resolve(["--optimizer=muon", "--fmt=nvfp4", "--stage2_fmt=e4m3"], 16, picks)
    with pytest.raises(ConfigError, match="FP8 \\+ 4-bit wire"):     # not the FP8 row's pick
        resolve(["--optimizer=muon", "--stage2_fmt=nvfp4"], 16, picks)


def test_an_explicit_flag_wins_over_the_pick(picks):
    cfg, why = resolve(["--block=row"], 8, picks)
    assert (cfg.fmt, cfg.block, cfg.collective) == ("e5m2", "row", "fp8-sum")
    assert "your --block kept" in why
    explicit, _ = resolve(["--comm=bf16", "--optimizer=muon"], 8, picks)
    assert explicit.comm == "bf16"                                  # not auto: untouched


def test_auto_without_a_pick_names_the_fix(tmp_path):
    path = tmp_path / "recommended.json"
    path.write_text(json.dumps({"picks": ROWS[:1]}))
    with pytest.raises(ConfigError, match="pass --comm explicitly"):
        resolve(["--optimizer=adamw"], 8, str(path))


def test_the_shipped_picks_are_the_tables():
    """recommended.json is what the study tool's rule picks from the results it names: the
    default run and the README's what-to-run table cannot disagree."""
    shipped = json.load(open(recommend.RECOMMENDED))
    results = load_results([os.path.join(ROOT, p) for p in shipped["results"]])
    workers = sorted({r["workers"] for r in shipped["picks"]})
    assert recommended.picks(results, workers) == shipped["picks"]
    rows = {(r["optimizer"], r["wire"]): r["arm"] for r in shipped["picks"] if r["workers"] == 32}
    assert rows[("muon", "FP8")] == "subspace" and rows[("adamw", "FP8")] == "fp8"


def test_a_run_says_what_auto_chose(tiny_corpus, tmp_path, capsys):
    summary = train.train(train.parse_config(
        [f"--data_dir={tiny_corpus}", f"--out_dir={tmp_path}", "--preset=char-study",
         "--optimizer=muon", "--simulate_workers=2", "--max_iters=2", "--eval_iters=1"]))
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("comm=auto: subspace") and summary["config"]["comm"] == "subspace"


def test_the_study_writes_the_picks_only_when_asked(tmp_path, capsys):
    """--picks FILE writes the picks; --answer ... --readme alone never touches train.py's file."""
    from nanogeo.lab import study
    paths = [os.path.join(ROOT, p) for p in json.load(open(recommend.RECOMMENDED))["results"]]
    before = open(recommend.RECOMMENDED).read()
    out = tmp_path / "picks.json"
    study.main(["--answer", ",".join(paths), "--answer_workers", "32,64", "--picks", str(out)])
    assert json.load(open(out))["picks"] == json.load(open(recommend.RECOMMENDED))["picks"]
    assert open(recommend.RECOMMENDED).read() == before
    with pytest.raises(SystemExit):
        study.main(["--picks", str(out)])
    assert "--picks goes with --answer" in capsys.readouterr().err
