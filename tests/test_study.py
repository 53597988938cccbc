"""The study driver (nanogeo.lab.study): its statistics, tables, pooling of machines, the
answer's rule and its command line, on hand-made records; two tiny real studies."""
import importlib.metadata
import json
import math
import os

import pytest

from nanogeo.lab import study
from nanogeo.lab.study.rule import Multiplicity


def flat(text):
    """Generated text with its line breaks undone (notes are wrapped at 100 characters)."""
    return " ".join(text.split())


def test_study_t_interval_and_paired_fraction():
    """Hand-computed: [1, 2, 3] has mean 2, sd 1, half-width t(2) sd / sqrt(3); the recovered
    fraction is the mean of the per-seed fractions 1 - gap / reference gap (here 0.5, 0.4, 0.6:
    sd 0.1), not one minus the ratio of the mean gaps."""
    mean, half = study.mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and abs(half - 4.303 * 1.0 / math.sqrt(3)) < 1e-12
    point, lo, hi, interval = study.recovered([0.05, 0.06, 0.04], [0.1, 0.1, 0.1])
    half = 4.303 * 0.1 / math.sqrt(3)
    assert interval == "t" and abs(point - 0.5) < 1e-12
    assert abs(lo - (0.5 - half)) < 1e-12 and abs(hi - (0.5 + half)) < 1e-12
    point, lo, hi, _ = study.recovered([0.02, 0.06], [0.04, 0.08])   # fractions 0.5, 0.25
    half = 12.706 * (0.25 / math.sqrt(2)) / math.sqrt(2)
    assert abs(point - 0.375) < 1e-12 and abs(hi - (0.375 + half)) < 1e-12   # ratio: 0.333


def test_study_bootstrap_only_from_eight_seeds():
    gaps, reference = [0.05, 0.07, 0.04, 0.06, 0.05, 0.08, 0.03, 0.06], [0.1] * 8
    assert study.recovered(gaps[:7], reference[:7])[3] == "t"
    point, lo, hi, interval = study.recovered(gaps, reference)
    fractions = [1 - g / 0.1 for g in gaps]
    assert interval == "bootstrap" and min(fractions) <= lo < point < hi <= max(fractions)
    assert study.recovered(gaps, reference) == (point, lo, hi, interval)    # seeded


def test_study_reference_gap_must_be_established():
    assert study.reference_problem([0.1]) == "one seed"
    # mean 0.0067, sd 0.0153: the t interval (-0.031, 0.045) includes 0
    assert study.reference_problem([0.01, -0.01, 0.02]) == "reference gap not significant"
    # mean 0.9 +- 2.262 * 0.316 / sqrt(10) = 0.226 excludes 0, but seed 0's gap is 0
    assert study.reference_problem([0.0] + [1.0] * 9) == "reference gap <= 0 in a seed"
    assert study.reference_problem([-0.1, -0.12, -0.11]) == "reference better than fp32"
    assert study.reference_problem([0.1, float("nan")]) == "reference gap not finite"
    assert study.reference_problem([0.1, 0.12, 0.11]) is None


def study_run(comm, seed, val, flags=("--preset=char-study",)):
    return {"comm": comm, "optimizer": "adamw", "workers": 4, "simulated": True, "seed": seed,
            "command": ["train.py", f"--comm={comm}", f"--seed={seed}", *flags],
            "flags": list(flags), "commit": "0123456789abcdef", "dirty": False,
            "final_val_loss": val, "final_train_loss": val, "ms_per_step": 10.0,
            "mean_wire_bytes": 1, "mean_wire_vs_bf16": 0.5, "curve": [(1, val)]}


def test_study_table_rows():
    """Paired gaps to fp32 and to the reference, the recovered fraction with its t interval;
    a method run with one seed says so instead of printing an interval."""
    results = [study_run("fp32", s, 2.0 + 0.01 * s) for s in range(3)]
    results += [study_run("fp8", s, 2.2 + 0.01 * s) for s in range(3)]
    results += [study_run("subspace", s, 2.1 + 0.01 * s) for s in range(3)]
    results += [study_run("geofp8", 0, 2.15)]
    text = study.table(results, "fp8")
    assert "| fp32 | 3 | 2.0100 ± 0.0248 | — | — | — | 0.500 | 10 |" in text
    assert "| fp8 | 3 | 2.2100 ± 0.0248 | +0.2000 ± 0.0000 | — | — |" in text
    assert ("| subspace | 3 | 2.1100 ± 0.0248 | +0.1000 ± 0.0000 | -0.1000 ± 0.0000 | "
            "50 % (50 to 50 %, t) |") in text
    assert ("| geofp8 | 1 | 2.1500 (one seed) | +0.1500 (one seed) | -0.0500 (one seed) | "
            "one seed |") in text
    assert "nan" not in text and "train flags: `--preset=char-study`" in text


def test_study_gain_history():
    """Per arm (optimizer, W, method) and seed, the count of geometry-aware layers where it
    changes, and the layers ever geometry-aware (by name, across seeds); arms without a history
    are left out."""
    a = dict(study_run("subspace", 0, 2.0), geometry=[(25, ["a", "b"]), (50, ["a", "c"]),
                                                      (75, ["a"])])
    b = dict(study_run("subspace", 1, 2.0), geometry=[(25, []), (50, ["d"])])
    c = dict(a, workers=64, geometry=[(25, ["e"])])         # another W: a row of its own
    text = study.gain_history([a, b, c, study_run("fp8", 0, 2.0)])
    assert text.splitlines()[2:] == [
        f"| adamw | {a['workers']} | subspace | 0: 25:2 → 75:1; 1: 25:0 → 50:1 | 4 |",
        "| adamw | 64 | subspace | 0: 25:1 | 1 |"]
    assert study.gain_history([study_run("fp8", 0, 2.0)]) == ""


def test_study_flags_an_unestablished_reference_gap():
    gaps = [0.01, -0.01, 0.02]
    results = [study_run("fp32", s, 2.0) for s in range(3)]
    results += [study_run("fp8", s, 2.0 + g) for s, g in enumerate(gaps)]
    results += [study_run("subspace", s, 2.0 + g / 2) for s, g in enumerate(gaps)]
    text = study.table(results, "fp8")
    [row] = [line for line in text.splitlines() if line.startswith("| subspace |")]
    assert row.endswith("| reference gap not significant | 0.500 | 10 |") and "%" not in row
    assert "fp8's gap to fp32 is +0.0067 ± 0.0379: reference gap not significant" in text


def test_study_records_with_other_flags_never_mix():
    """The merge key is the whole command: a call with other flags adds records beside the
    earlier ones (its own table), a rerun of a command replaces its record, and a record of an
    older driver (no command) is kept on its own."""
    old = {k: v for k, v in study_run("fp32", 0, 3.0).items() if k not in ("command", "flags")}
    short = [study_run("fp32", 0, 2.5, ("--max_iters=300",))]
    earlier = [old, *short, study_run("fp32", 0, 2.0)]
    rerun = study_run("fp32", 0, 1.9)
    merged = study.merge(earlier, [rerun])
    assert merged == [old, *short, rerun]
    text = study.table(merged, "fp8")
    assert text.count("### adamw, W = 4") == 3 and "train flags not recorded" in text
    assert "| fp32 | 1 | 1.9000 (one seed) |" in text and "| fp32 | 1 | 2.5000 (one seed) |" in text


def test_study_pools_seeds_of_two_machines_never_pairing_across_them():
    """A seed is a block on its machine: every arm of it ran there. Seeds of two machines are
    pooled into one table (both machines and their seeds in the heading), each pair taken on one
    machine - here the same seed numbers on both, B's losses a whole unit higher, so a pair across
    machines would show a gap near 1 - with each machine's mean beside the pooled one and a
    machine whose mean differs flagged. Records of an unrecorded machine stay on their own."""
    here, there = "CPU A, torch 2.13.0, OMP_NUM_THREADS 1", "CPU B, torch 2.13.0, OMP_NUM_THREADS 1"
    results = []
    for machine, base, gaps in ((here, 2.0, (0.10, 0.11, 0.09)), (there, 3.0, (0.20, 0.21, 0.19))):
        results += [dict(study_run("fp32", s, base + 0.01 * s), machine=machine) for s in range(3)]
        results += [dict(study_run("fp8", s, base + 0.01 * s + g), machine=machine)
                    for s, g in enumerate(gaps)]
    results[-1]["commit"] = "fedcba9876543210"
    text = study.table(results, "fp8")
    assert text.count("### adamw, W = 4") == 1 and "(**2 commits**" in text
    assert f"machines M1 = {here} (seeds 0-2); M2 = {there} (seeds 0-2)" in text
    [row] = [line for line in text.splitlines() if line.startswith("| fp8 |")]
    # pooled: six within-machine gaps, mean 0.15, sd 0.0555: t(5) 2.571 * 0.0555 / sqrt(6)
    assert row.startswith("| fp8 | 6 | ") and "| +0.1500 ± 0.0583 |" in row
    assert row.endswith("| M1 +0.1000 (3, differs); M2 +0.2000 (3, differs) |")
    assert "| fp32 | 6 |" in text
    answer = study.answer(results, workers=4)
    assert f"adamw: seeds of 2 machines pooled, M1 = {here} (seeds 0-2); M2 = {there}" in flat(answer)
    assert "a machine's mean differs from the others' (Welch t, 5 %) in fp8 − fp32" in flat(answer)
    # one machine: no by-machine column
    one = study.table([r for r in results if r["machine"] == here], "fp8")
    assert f"machine M1 = {here} (seeds 0-2)" in one and "by machine" not in one
    # records of an older driver (machine not recorded) are a group of their own, never pooled,
    # and do not outvote the recorded ones in the answer
    older = [dict(study_run(c, s, 2.0), machine=None) for c in ("fp32", "fp8") for s in range(5)]
    text = study.table(older + results, "fp8")
    assert text.count("### adamw, W = 4") == 2 and "| fp8 | 5 | 2.0000 ± 0.0000 |" in text
    assert "machine not recorded (pairs may mix machines)" in text
    assert "seeds of 2 machines pooled" in flat(study.answer(older + results, 4))
    assert "adamw: machine not recorded: pairs may mix machines." in flat(study.answer(older, 4))


def test_study_reads_several_results_files_as_one(tmp_path, capsys):
    """--table and --answer take several results files, comma-separated: the records are
    concatenated, and a run in two files (the same command on the same machine) counts once."""
    a = [dict(study_run(c, s, 2.0 + s / 10 + (c == "fp8") * 0.01), machine="A")
         for c in ("fp32", "fp8") for s in range(2)]
    b = [dict(study_run(c, s, 3.0 + s / 10 + (c == "fp8") * 0.03), machine="B")
         for c in ("fp32", "fp8") for s in range(2, 4)]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "ab.json").write_text(json.dumps(a + b))
    both = study.load_results(f"{tmp_path / 'a.json'},{tmp_path / 'ab.json'}")
    assert both == json.loads(json.dumps(a + b))
    study.main(["--table", f"{tmp_path / 'a.json'},{tmp_path / 'ab.json'}"])
    out = capsys.readouterr().out
    assert out == study.table(a + b, "fp8") and "| fp8 | 4 |" in out
    study.main(["--answer", f"{tmp_path / 'ab.json'},{tmp_path / 'a.json'}", "--answer_workers",
                "4"])
    assert capsys.readouterr().out == study.answer(a + b, 4)


def test_study_stage_table_intervals_over_seeds_and_sensitivity():
    """--stages: per seed the mean of its logged steps after the first quarter, then the mean
    over seeds +- the 95 % t half-width (seeds are the blocks: a seed's steps are not
    independent); under 4 seeds a row says so. --sensitivity: the same runs of two results
    files, their differences."""
    def staged(seed, s1):
        early = {"l2": {"stage1": 9.0, "stage2": 9.0, "total": 9.0}}      # step 25: left out
        late = {"l2": {"stage1": s1, "stage2": 1.0, "total": 1.1}}
        return dict(study_run("nvfp4", seed, 2.0), steps=100,
                    stages=[(25, early), (50, late), (100, late)])
    text = study.stage_table([staged(0, 0.4)])
    assert "| adamw | nvfp4 | 4 | l2 | 0.400 (one seed) | 1.000 (one seed) | 1.100 (one seed) | " \
           "1 (too few) | 2 |" in text and "under 4 seeds" in text
    # stage 1 over seeds: 0.4, 0.5, 0.6, 0.7: mean 0.55, sd 0.1291, t(3) 3.182 * 0.1291 / 2
    text = study.stage_table([staged(s, 0.4 + s / 10) for s in range(4)])
    assert "| adamw | nvfp4 | 4 | l2 | 0.550 ± 0.205 | 1.000 ± 0.000 | 1.100 ± 0.000 | 4 | 2 |" \
        in text and "too few" not in text
    assert study.stage_table([study_run("fp32", 0, 2.0)]) == ""
    a = [dict(study_run("nvfp4", s, 2.0 + s / 100), steps=300) for s in range(2)]
    b = [dict(r, final_val_loss=r["final_val_loss"] + d) for r, d in zip(a, (0.01, -0.03))]
    text = study.sensitivity(a, b + [dict(study_run("fp32", 0, 1.0), steps=300)])
    assert "| nvfp4 | adamw | 4 | 2 | 0.0200 | 0.0300 | -0.0100, +0.0300 |" in text
    assert "| fp32 |" not in text                               # in one file only


def test_study_sweep_summary_and_lr_from(tmp_path):
    """The best value: the lowest mean over the seeds every value has (a diverged value, nan,
    is worst); at an end of the grid it is flagged. --lr_from passes it to that optimizer's
    runs, and names the fix when the file has no sweep for an optimizer."""
    def swept(value, seed, val):
        flags = ["--preset=char-study", f"--muon_lr={value}"]
        return {**study_run("fp32", seed, val, flags), "optimizer": "muon",
                "sweep": ["muon_lr", value]}
    results = [swept("1e-3", 0, 2.4), swept("1e-3", 1, 2.5), swept("3e-3", 0, 2.2),
               swept("3e-3", 1, 2.3), swept("1e-2", 0, float("nan")), swept("1e-2", 1, 2.0),
               swept("3e-3", 2, 1.0)]            # seed 2: only one value has it, not counted
    [entry] = study.sweep_summary(results)
    assert entry["seeds"] == [0, 1] and entry["best"] == "3e-3" and not entry["best_at_edge"]
    assert entry["train_flags"] == ["--preset=char-study"]
    assert "| 3e-3 (best) | 2.2500 ± 0.6353 | — |" in study.sweep_table([entry])
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"sweeps": [entry]}))
    assert study.lr_flags(str(path), "muon", 4) == ["--muon_lr=3e-3"]
    with pytest.raises(ValueError, match="no sweep for adamw at W = 4"):
        study.lr_flags(str(path), "adamw", 4)
    with pytest.raises(ValueError, match="no sweep for muon at W = 8"):
        study.lr_flags(str(path), "muon", 8)
    results = [swept("1e-3", 0, 2.4), swept("3e-3", 0, 2.2), swept("1e-2", 0, 2.1)]
    assert study.sweep_summary(results)[0]["best_at_edge"]


@pytest.mark.parametrize("options,extra,message", [
    (["--sweep", "muon_lr=1e-3,1e-2"], [], "applies to --optimizers muon, not adamw"),
    (["--sweep", "learning_rate=1e-3"], [], "two or more positive numbers"),
    (["--sweep", "beta2=0.9,0.99"], [], "sweep one of learning_rate, muon_lr"),
    (["--sweep", "learning_rate=1e-3,1e-2", "--comms", "fp8"], [], "fp32 only"),
    (["--sweep", "learning_rate=1e-3,1e-2"], ["--learning_rate=1e-3"], "drop one of them"),
    (["--lr_from", "missing.json"], [], "not a sweep.json"),
])
def test_study_sweep_errors(options, extra, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        study.main([*options, "--out_dir", str(tmp_path), "--", *extra])
    assert message in capsys.readouterr().err


def test_study_refuses_a_method_train_py_does_not_have(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(study.COMMS, "int2", ["--comm=int2"])
    with pytest.raises(SystemExit):
        study.main(["--comms", "fp32,int2", "--out_dir", str(tmp_path)])
    assert "method int2 needs train.py --comm=int2" in capsys.readouterr().err


def test_study_records_the_machine(tmp_path, monkeypatch):
    """machine(): the CPU's name, family and model (x86) or implementer and part (ARM), torch's
    version and OMP_NUM_THREADS; no cpuinfo still names the platform. provenance() of a run
    from before machines were recorded says None."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
                   "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n")
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n"
                   "CPU part\t: 0xd0c\n")
    torch_version = importlib.metadata.version("torch")
    assert study.machine(x86) == (f"AMD EPYC cpu family 26 model 2, torch {torch_version}, "
                                  "OMP_NUM_THREADS 1")
    assert study.machine(arm).startswith("CPU implementer 0x41 CPU part 0xd0c, torch ")
    assert study.machine(tmp_path / "none").split(",")[0].strip()     # platform's name
    old = tmp_path / "old_run"
    old.mkdir()
    (old / "provenance.json").write_text('{"commit": "abc", "dirty": false}')
    assert study.provenance(old) == {"commit": "abc", "dirty": False, "machine": None}


def test_study_runs_a_grid_and_resumes(tiny_corpus, tmp_path, capsys):
    """Two methods x two seeds of simulated 2-rank runs; a second call skips all four. Each
    record holds the whole command, the commit and machine, preset, steps, learning rates and
    the bytes per step averaged over the run."""
    extra = ["--preset=char-study", f"--data_dir={tiny_corpus}", "--max_iters=2", "--batch_size=2",
             "--block_size=16", "--eval_iters=1", "--eval_interval=2", "--warmup_iters=1", "--final_evals=2"]
    argv = ["--comms", "fp32,fp8", "--seeds", "0,1", "--workers", "2", "--out_dir",
            str(tmp_path), "--", *extra]
    study.main(argv)
    records = json.load(open(tmp_path / "results.json"))
    assert sorted((r["comm"], r["seed"]) for r in records) == [
        ("fp32", 0), ("fp32", 1), ("fp8", 0), ("fp8", 1)]
    for r in records:
        assert r["workers"] == 2 and r["curve"] and r["flags"] == extra
        assert r["command"][:2] == ["train.py", "--simulate_workers=2"]
        assert r["command"][-len(extra):] == extra
        assert r["commit"] is None or (len(r["commit"]) == 40 and isinstance(r["dirty"], bool))
        assert r["machine"] == study.machine()      # CPU model and torch version
        assert (r["preset"], r["steps"], r["learning_rates"]) == (
            "char-study", 2, {"learning_rate": 3e-3, "min_lr": 3e-4})
        assert [s for s, _ in r["final_val_losses"]] == [1, 2]
    wire = {r["comm"]: r["mean_wire_vs_bf16"] for r in records}
    assert wire["fp32"] == 2.0 and 0.5 < wire["fp8"] < 0.6
    assert "recovers of fp8's gap" in (tmp_path / "study.md").read_text()
    capsys.readouterr()
    study.main(argv)
    assert capsys.readouterr().out.count("done before, skipped") == 4


def test_study_sweep_then_study_with_its_best_value(tiny_corpus, tmp_path):
    """A toy sweep (2 values, 1 seed, 2 steps) writes sweep.json; a study with --lr_from trains
    fp32 at the best value."""
    extra = ["--", "--preset=char-study", f"--data_dir={tiny_corpus}", "--max_iters=2", "--batch_size=2",
             "--block_size=16", "--eval_iters=1", "--eval_interval=2", "--warmup_iters=1"]
    sweep = tmp_path / "sweep"
    study.main(["--sweep", "learning_rate=1e-3,1e-2", "--seeds", "0", "--workers", "1",
                "--out_dir", str(sweep), *extra])
    [entry] = json.load(open(sweep / "sweep.json"))["sweeps"]
    assert (entry["optimizer"], entry["workers"], entry["flag"]) == ("adamw", 1, "learning_rate")
    losses = {v["value"]: v["mean"] for v in entry["values"]}
    assert set(losses) == {"1e-3", "1e-2"} and entry["best"] == min(losses, key=losses.get)
    assert os.path.exists(sweep / "learning_rate=1e-2" / "fp32" / "adamw" / "sim1" / "seed0")
    out = tmp_path / "study"
    study.main(["--comms", "fp32", "--seeds", "0", "--workers", "1", "--lr_from",
                str(sweep / "sweep.json"), "--out_dir", str(out), *extra])
    [r] = json.load(open(out / "results.json"))
    assert f"--learning_rate={entry['best']}" in r["command"]
    assert r["learning_rates"]["learning_rate"] == float(entry["best"])


def study_record(comm, seed, loss, wire, ms=100.0):
    return {"comm": comm, "optimizer": "adamw", "workers": 32, "simulated": True, "seed": seed,
            "flags": ["--learning_rate=0.003"], "final_val_loss": loss, "ms_per_step": ms,
            "mean_wire_vs_bf16": wire}


def test_study_answer_recommends_the_cheapest_unless_a_costlier_one_is_shown_lower(tmp_path):
    """Hand-made study: subspace's gap to fp32 (0.0183) is below fp8's (0.02), but their paired
    difference (-0.005, +0.005, -0.005) includes 0, so plain fp8 is the FP8 answer; at 4 bits the
    rotation is lower than nvfp4 in every seed by 0.05, so it is the answer there, with the
    fraction of nvfp4's gap it recovers; the Hadamard controls, even the one lower than all, are
    never candidates and in no row."""
    losses = {"fp32": (2.00, 2.10, 2.20, 2.0), "bf16": (2.01, 2.11, 2.21, 1.0),
              "fp8": (2.02, 2.12, 2.22, 0.5), "subspace": (2.015, 2.125, 2.215, 0.5),
              "nvfp4": (2.10, 2.20, 2.30, 0.28), "subspace-nvfp4": (2.05, 2.15, 2.25, 0.28),
              "hadamard16-nvfp4-all": (2.01, 2.11, 2.21, 0.28)}
    records = [study_record(comm, seed, values[seed], values[3],
                            ms=130.0 if comm == "subspace-nvfp4" else 100.0)
               for comm, values in losses.items() for seed in range(3)]
    records.append(dict(study_record("fp8", 0, 9.0, 0.5), flags=["--learning_rate=1"]))  # other group
    records += [study_record("hadamard-nvfp4", s, v, 0.28) for s, v in ((0, 2.10), (1, 2.15))]
    text = study.answer(records)
    fp8_budget, four_bit = text.splitlines()[2:4]
    assert fp8_budget == ("| adamw | FP8 | fp8 | 3 (provisional) | +0.0200 ± 0.0000 | "
                          "+0.0100 ± 0.0000 | — | "
                          "0.500 | 1.00× | subspace -0.0017 ± 0.0143 (3) |")
    assert four_bit == ("| adamw | 4-bit | subspace-nvfp4 | 3 (provisional) | +0.0500 ± 0.0000 | "
                        "+0.0400 ± 0.0000 | 50 % (50 to 50 %, t) of nvfp4's | 0.280 | 1.30× | "
                        "nvfp4 +0.0500 ± 0.0000 (3) |")
    assert "hadamard" not in text.split("Run this:")[0]
    assert ("adamw, FP8: run fp8. fp8: higher than fp32 at 95 % (fp8 − fp32 = +0.0200 ± 0.0000, "
            "3 seeds); fp8: higher than bf16 at 95 % (fp8 − bf16 = +0.0100 ± 0.0000, 3 seeds); "
            "subspace: no difference detected from fp8 (± 0.0143; subspace − fp8 = -0.0017 ± "
            "0.0143, 3 seeds).") in flat(text)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{study.ANSWER_BEGIN}\nold\n{study.ANSWER_END}\nrest\n")
    (tmp_path / "results.json").write_text(json.dumps(records))
    assert study.write_blocks(str(tmp_path / "results.json"), str(readme)) == ["answer"]
    assert readme.read_text() == (f"intro\n{study.ANSWER_BEGIN}\n{study.answer(records)}"
                                  f"{study.ANSWER_END}\nrest\n")
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="answer: begin"):
        study.write_blocks(str(tmp_path / "results.json"), str(readme))


def four_bit_arms(seeds, gains, w=32, offset=0.0):
    """Records of fp32, nvfp4 (+0.014) and each arm in gains {comm: per-seed change from
    nvfp4} over `seeds` at W = w."""
    out = []
    for k, s in enumerate(seeds):
        base = 2.0 + s / 10 + offset
        out += [dict(study_record("fp32", s, base, 2.0), workers=w),
                dict(study_record("nvfp4", s, base + 0.014, 0.29), workers=w)]
        out += [dict(study_record(c, s, base + 0.014 + g[k], 0.29), workers=w)
                for c, g in gains.items() if k < len(g)]
    return out


def test_study_rule_compares_candidates_only_on_the_seeds_they_share():
    """The W = 64 case of issue 44: the rotation has 8 seeds (-0.004 on seeds 0-3, -0.012 on
    4-7: mean -0.008 from nvfp4), stage-2 error feedback 4 (-0.006 on seeds 0-3). Over its own
    seeds the rotation looks ahead; on the seeds both share, error feedback is (-0.006 against
    -0.004), and it is cheaper: the rule picks nvfp4-ef2."""
    jitter = (0.0003, -0.0003, 0.0002, -0.0002)
    records = four_bit_arms(range(8), {
        "subspace-nvfp4": [-0.004 + j for j in jitter] + [-0.012 + j for j in jitter],
        "nvfp4-ef2": [-0.006 - j for j in jitter]})
    by_comm = study.study_groups(records, 32)["adamw"]
    choice = study.recommend(by_comm, "4-bit", Multiplicity(records, (32,), []), "adamw", 32)
    assert (choice.comm, choice.fits) == ("nvfp4-ef2", ["nvfp4", "nvfp4-ef2", "subspace-nvfp4"])
    row = study.answer(records).splitlines()[3]
    assert row.startswith("| adamw | 4-bit | nvfp4-ef2 | 4 (provisional) | ")
    assert row.endswith("| nvfp4 +0.0060 ± 0.0005 (4); subspace-nvfp4 +0.0020 ± 0.0009 (4) |")
    # a forced control lower than everything is still no candidate
    control = [dict(r, comm="subspace-nvfp4-all", final_val_loss=r["final_val_loss"] - 0.01)
               for r in records if r["comm"] == "nvfp4-ef2"]
    by_comm = study.study_groups(records + control, 32)["adamw"]
    tests = Multiplicity(records + control, (32,), [])
    assert study.recommend(by_comm, "4-bit", tests, "adamw", 32).comm == "nvfp4-ef2"
    assert study.is_control("subspace-nvfp4-all") and study.is_control("hadamard")
    assert not study.is_control("subspace-nvfp4") and not study.is_control("nvfp4-ef2")


def test_study_tost_welch_and_t_quantiles_by_hand():
    """t quantiles reproduce the printed tables (and go past df 30, where 1.96 was used); TOST
    on hand-computed cases: [1, -1, 2, 0] x 1e-3 has mean 0.0005, sd 0.001291, 90 % half-width
    t(3) 2.353 * 0.001291 / 2 = 0.001519: (-0.001019, +0.002019), just outside +-0.002, inside
    +-0.0025; halved, it is inside +-0.002; 95 % half-width 3.182 * 0.001291 / 2 = 0.0021."""
    assert [study.t_quantile(0.975, df) for df in (1, 2, 10, 30)] == [12.706, 4.303, 2.228, 2.042]
    assert study.t_quantile(0.975, 35) == 2.030 and study.t_quantile(0.95, 3) == 2.353
    diffs = [0.001, -0.001, 0.002, 0.0]
    lo, hi, equivalent = study.tost(diffs, 0.002)
    assert abs(lo + 0.001019) < 2e-6 and abs(hi - 0.002019) < 2e-6 and not equivalent
    assert study.tost(diffs, 0.0025)[2] and study.tost([0.001], 0.002) is None
    assert study.verdict(diffs, 0.002) == "no difference detected (± 0.0021)"
    assert study.verdict([d / 2 for d in diffs], 0.002) == "equivalent within ±0.002 (TOST)"
    small = [0.0010, 0.0012, 0.0011, 0.0009]        # 95 %: 0.00105 +- 0.00021, excludes 0
    assert study.verdict(small) == "equivalent within ±0.002 (TOST); higher at 95 %"
    assert study.verdict([-0.006, -0.005, -0.007, -0.006]) == "lower at 95 %"
    assert study.words("a", "b", [d / 2 for d in diffs]) == (
        "a: equivalent to b within ±0.002 (TOST; a − b = +0.0003 ± 0.0010, 4 seeds)")
    assert study.words("a", "b", diffs).startswith("a: no difference detected from b (± 0.0021;")
    # Welch: means 1 and 2.5, variances 1: t = 1.837 with 4 df (t(4) = 2.776); 3 apart: 3.674
    assert study.welch_differs([0.0, 1.0, 2.0], [1.5, 2.5, 3.5]) is False
    assert study.welch_differs([0.0, 1.0, 2.0], [3.0, 4.0, 5.0]) is True
    assert study.welch_differs([0.0], [1.0, 2.0]) is None


def test_study_rule_is_order_independent_and_per_w():
    """Issue 59's rule: the cheapest candidate no other is lower than after Holm. Stage-2
    feedback gains a noisy -0.003 on nvfp4 (not significant), the rotation a steady -0.006
    (significant), and the rotation is not lower than feedback on their shared seeds. The old
    sequential rule (start at nvfp4, replace the pick by each costlier candidate lower than it)
    ended at the rotation; here nvfp4 is beaten, feedback is not, and feedback is cheaper - in
    whatever order the records come. Each W on its own seeds: at W = 64 feedback gains nothing
    and the rotation beats both, so W = 64 picks it while W = 32 keeps feedback."""
    j = (0.0003, -0.0003, 0.0002, -0.0002)
    records = four_bit_arms(range(4), {"nvfp4-ef2": [0.001, -0.007, 0.002, -0.008],
                                       "subspace-nvfp4": [-0.006 - x for x in j]})
    records += four_bit_arms(range(4), {"nvfp4-ef2": [x for x in j],
                                        "subspace-nvfp4": [-0.006 - x for x in j]}, w=64)
    picks = {w: c[("adamw", "4-bit")].comm for w, c in study.choices(records, (32, 64)).items()}
    assert picks == {32: "nvfp4-ef2", 64: "subspace-nvfp4"}
    for shuffled in (records[::-1], records[1::2] + records[::2]):
        again = study.choices(shuffled, (32, 64))
        assert {w: c[("adamw", "4-bit")].comm for w, c in again.items()} == picks
    text = study.answers(records, (32, 64))
    assert "| adamw | 4-bit | nvfp4-ef2 | 4 (provisional) |" in text.split("**W = 64")[0]
    assert "| adamw | 4-bit | subspace-nvfp4 | 4 (provisional) |" in text.split("**W = 64")[1]
    assert "pooled" not in text.split("Run this:")[0]


def test_paired_t_p_value():
    """The two-sided p of the paired t test, against closed forms: with 2 degrees of freedom
    P(|T| > t) = 1 - t / sqrt(2 + t^2); p < 0.05 exactly where the 95 % interval excludes 0."""
    from nanogeo.lab.study import stats
    t = 2 / (1 / math.sqrt(3))                                  # [1, 2, 3]: mean 2, sd 1
    assert stats.p_value([1.0, 2.0, 3.0]) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-9)
    assert stats.p_value([0.5, -0.5]) == pytest.approx(1.0)
    assert math.isnan(stats.p_value([0.1])) and stats.p_value([0.2, 0.2]) == 0.0
    for shift in (0.0, 0.3, 0.45, 0.6, 1.0):
        diffs = [shift + x for x in (-1.0, -0.4, 0.1, 0.5, 0.9, 1.3)]
        mean, half = stats.mean_ci(diffs)
        assert (stats.p_value(diffs) < 0.05) == (abs(mean) > half), shift


def test_study_comparisons_table():
    """--comparisons: each arm against its Euclidean twin, the rotation against stage-2 error
    feedback, bf16 against fp32, and every arm that is not a control against bf16 and fp32 - on
    shared seeds, with the 90 % interval and the TOST verdict; controls only against their twin."""
    j = (0.0003, -0.0003, 0.0002, -0.0002)
    records = four_bit_arms(range(4), {"nvfp4-ef2": [-0.006 + x for x in j],
                                       "subspace-nvfp4": [-0.006 - x for x in j],
                                       "hadamard16-nvfp4-all": [0.0 + x for x in j]})
    records += [dict(r, comm="bf16", final_val_loss=r["final_val_loss"] + 0.0005 * (k % 2))
                for k, r in enumerate(x for x in records if x["comm"] == "fp32")]
    records = [dict(r, machine="CPU A") for r in records]
    text = study.comparisons(records, (32,), margin=0.002)
    rows = [line for line in text.splitlines() if line.startswith("| adamw |")]
    names = [line.split(" | ")[3] for line in rows]
    assert names == ["subspace-nvfp4 − nvfp4", "hadamard16-nvfp4-all − nvfp4",
                     "nvfp4-ef2 − nvfp4", "subspace-nvfp4 − nvfp4-ef2", "bf16 − fp32",
                     "nvfp4 − fp32", "nvfp4 − bf16", "subspace-nvfp4 − fp32",
                     "subspace-nvfp4 − bf16", "nvfp4-ef2 − fp32", "nvfp4-ef2 − bf16"]
    [row] = [line for line in rows if "| subspace-nvfp4 − nvfp4-ef2 |" in line]
    assert ("| 4 | +0.0000 ± 0.0009 | -0.0007 to +0.0007 | 1.000 | 1.000 (exploratory: AdamW, W "
            "= 32, 4-bit) | 1.000 | exploratory | equivalent within ±0.002 (TOST) | — |") in row
    [row] = [line for line in rows if "| nvfp4 − fp32 |" in line]
    assert "| 4 | +0.0140 ± 0.0000 |" in row and "higher at 95 %" in row
    assert "Equivalent within ±0.002 (TOST): the 90 % paired t interval" in flat(text)
    [row] = [line for line in rows if "| bf16 − fp32 |" in line]
    assert "| none | bf16 − fp32 | 4 | +0.0003 ± " in row
    assert "| fp32 − " not in text and "| bf16 − nvfp4" not in text   # baselines have no twin


def test_study_answer_edge_cases(tmp_path, capsys):
    """A diverged method is never recommended; a plain method whose interval against fp32
    includes 0 is "no difference detected", never "the same" (and "lower" when significantly
    better); a recommendation that sends more than its format's goal allows says so; --margin
    changes the TOST's margin; a wrong W, a missing file, a bad margin and --readme without
    --answer are one-line errors."""
    fp32 = [study_record("fp32", s, 2.0 + s / 10, 2.0) for s in range(3)]
    better = [study_record("fp8", s, 1.97 + s / 10 + (0.001, -0.001, 0.0)[s], 0.543) for s in range(3)]
    diverged = [study_record("subspace", s, float("nan"), 0.5) for s in range(3)]
    heavy = [study_record("geofp8", s, 2.0 + s / 10, 0.537) for s in range(3)]
    text = study.answer(fp32 + better + diverged + heavy)
    row = text.splitlines()[2]
    assert row.startswith("| adamw | FP8 | fp8 | 3 (provisional) | -0.0300 ± ")
    assert "fp8: lower than fp32 at 95 % (fp8 − fp32 = -0.0300 ± 0.0025, 3 seeds)" in flat(text)
    assert "fp8 sends 0.543× bf16's bytes here, above the 0.52× the goal allows" in flat(text)
    assert "Not finite in some run, so in no row: subspace." in flat(text)
    assert "nothing measured yet" in text.splitlines()[3]       # 4-bit: no run
    same = [study_record("fp8", s, 2.0 + s / 10 + (0.001, -0.001, 0.0)[s], 0.5) for s in range(3)]
    # fp8 - fp32: 0.001, -0.001, 0: 95 % half-width 4.303 * 0.001 / sqrt(3) = 0.0025; 90 %:
    # 2.920 * 0.001 / sqrt(3) = 0.0017, inside +-0.002 but not +-0.001
    assert ("fp8: equivalent to fp32 within ±0.002 (TOST; fp8 − fp32 = +0.0000 ± 0.0025, 3 "
            "seeds)") in flat(study.answer(fp32 + same))
    assert ("fp8: no difference detected from fp32 (± 0.0025; fp8 − fp32 = +0.0000 ± 0.0025, 3 "
            "seeds)") in flat(study.answer(fp32 + same, margin=0.001))
    # a method run on fewer seeds is compared on the seeds it shares: equal to nvfp4 on seeds 0
    # and 1, it is not "better" because nvfp4's seed 2 was its worst
    nvfp4 = [study_record("nvfp4", s, 2.0 + s / 10 + (0.01, 0.012, 0.03)[s], 0.29) for s in range(3)]
    twin = [dict(r, comm="nvfp4-ef2") for r in nvfp4[:2]]
    assert study.answer(fp32 + nvfp4 + twin).splitlines()[3].startswith("| adamw | 4-bit | nvfp4 |")
    with pytest.raises(ValueError, match="--answer_workers"):
        study.answer(fp32, workers=64)
    (tmp_path / "r.json").write_text(json.dumps(fp32 + same))
    for argv, message in ((["--readme", "README.md"], "give both"),
                          (["--answer", str(tmp_path / "r.json"), "--answer_workers", "8"],
                           "--answer_workers"),
                          (["--answer", str(tmp_path / "r.json"), "--answer_workers", "32,x"],
                           "comma-separated"),
                          (["--answer", str(tmp_path / "r.json"), "--answer_workers", "32,32"],
                           "names a W twice"),
                          (["--answer_workers", "32"], "give both"),
                          (["--answer", str(tmp_path / "none.json")], "no such results file"),
                          (["--answer", str(tmp_path / "r.json"), "--margin", "0"],
                           "a positive loss difference")):
        with pytest.raises(SystemExit) as e:
            study.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    study.main(["--answer", str(tmp_path / "r.json")])
    assert capsys.readouterr().out == study.answer(fp32 + same)
    study.main(["--answer", str(tmp_path / "r.json"), "--margin=0.001"])
    assert capsys.readouterr().out == study.answer(fp32 + same, margin=0.001)
    study.main(["--comparisons", str(tmp_path / "r.json")])
    assert capsys.readouterr().out == study.comparisons(fp32 + same)
    # several W: one table per W, in the order asked
    both = fp32 + same + [dict(r, workers=64) for r in fp32 + same]
    (tmp_path / "r2.json").write_text(json.dumps(both))
    study.main(["--answer", str(tmp_path / "r2.json"), "--answer_workers", "64,32"])
    assert capsys.readouterr().out == (f"**W = 64 ranks**\n\n{study.answer(both, 64)}\n"
                                       f"**W = 32 ranks**\n\n{study.answer(both, 32)}")
    study.main(["--table", str(tmp_path / "r.json"), "--reference", "fp8"])
    assert capsys.readouterr().out == study.table(fp32 + same, "fp8")


def test_study_a_mixed_wire_is_a_row_of_its_own_with_no_byte_goal():
    """nvfp4-e4m3s2 (NVFP4 all-to-all, e4m3 all-gather) is neither budget's wire: every arm's
    wire format is a BUDGETS row or None; the mixed arm is never a 4-bit candidate (though it is
    lower than nvfp4 in every seed), gets a row of its own with its bytes and no goal (0.41x is
    above the 4-bit goal: no "above the goal" note), and is compared with nvfp4; without it the
    table has no such row."""
    from nanogeo.lab.study import arms, compare
    assert {arms.wire_format(c) for c in study.COMMS} - {None} <= {n for n, _ in study.BUDGETS}
    assert arms.wire_format("nvfp4-e4m3s2") == "4-bit + FP8"
    assert compare.twin("nvfp4-e4m3s2", ["nvfp4", "nvfp4-e4m3s2"]) is None
    assert ("nvfp4-e4m3s2", "nvfp4") in compare.pairs(["fp32", "nvfp4", "nvfp4-e4m3s2"])
    records = four_bit_arms(range(3), {})
    plain = study.answer(records)
    assert "4-bit + FP8" not in plain
    records += [study_record("nvfp4-e4m3s2", s, 2.0 + s / 10 + 0.004 + 0.001 * s, 0.41)
                for s in range(3)]
    text = study.answer(records)
    rows = [line for line in text.splitlines() if line.startswith("| adamw |")]
    assert [r.split(" | ")[1] for r in rows] == ["FP8", "4-bit", "4-bit + FP8"]
    assert rows[1].split(" | ")[2] == "nvfp4" and rows[2].split(" | ")[2] == "nvfp4-e4m3s2"
    assert "| 0.410 |" in rows[2]
    assert "a mixed wire, 0.410× bf16's bytes, reported with no byte goal" in flat(text)
    assert "above the" not in text


def test_fieller_holm_and_power_by_hand():
    """Fieller, by hand: numerators [1, 2, 3], denominators [3, 4, 5] (means 2 and 4; each mean's
    variance and their covariance 1/3), t(2) = 4.303, t^2 = 18.515809: (16 - t^2/3) R^2 -
    2 (8 - t^2/3) R + (4 - t^2/3) = 0, i.e. 9.828064 R^2 - 3.656128 R - 2.171936 = 0, roots
    (1.828064 -+ 4.968677) / 9.828064 = -0.319556 and 0.691565 around the ratio 0.5 - not the
    symmetric interval a mean of per-seed ratios would give; with a constant denominator [4, 4, 4]
    (no variance, no covariance) (2 -+ t / sqrt(3)) / 4 = -0.121085, 1.121085. A denominator
    whose mean is not clear of 0 has no bounded interval. Holm: p = 0.01, 0.04, 0.03 of a family
    of three -> 0.03 (0.01 x 3), 0.06 (0.03 x 2), 0.06 (0.04 x 1, raised to the one before it).
    Power: at sd = effect, n = 10 passes, (t(.975, 9) 2.262 + t(.8, 9) 0.883)^2 = 9.89 <= 10,
    and n = 9 does not, (2.306 + 0.889)^2 = 10.21 > 9 (a simulation of normal tests gave 80.3 %
    and 74.9 % power)."""
    ratio, low, high = study.fieller([1.0, 2.0, 3.0], [3.0, 4.0, 5.0])
    assert ratio == 0.5 and low == pytest.approx(-0.319556, abs=1e-6)
    assert high == pytest.approx(0.691565, abs=1e-6)
    _, low, high = study.fieller([1.0, 2.0, 3.0], [4.0, 4.0, 4.0])
    assert (low, high) == (pytest.approx(-0.121085, abs=1e-6), pytest.approx(1.121085, abs=1e-6))
    assert study.fieller([1.0, 2.0, 3.0], [-1.0, 0.5, 1.0])[1:] == (None, None)
    with pytest.raises(ValueError, match="paired"):
        study.fieller([1.0], [2.0])
    assert study.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert study.holm([0.5, 0.9]) == [1.0, 1.0]
    assert study.seeds_for_power(1.0, 1.0) == 10 and study.seeds_for_power(0.002, 0.001) > 30
    with pytest.raises(ValueError, match="positive"):
        study.seeds_for_power(0.0, 0.001)


def test_tost_at_the_edge():
    """[1, -1, 2, 0] x 1e-3: 90 % interval (-0.001019, +0.002019). Within +-0.0021 it passes with
    its upper bound within 5 % of the margin (0.002019 >= 0.95 x 0.0021): "at the edge", said in
    the verdict and the words; within +-0.0025 it passes clear of the edge; within +-0.002 it
    does not pass."""
    diffs = [0.001, -0.001, 0.002, 0.0]
    assert study.edge(diffs, 0.0021) == pytest.approx(0.002019, abs=2e-6)
    assert study.edge(diffs, 0.0025) is None and study.edge(diffs, 0.002) is None
    assert study.verdict(diffs, 0.0021) == ("equivalent within ±0.0021 (TOST at the edge, 90 % "
                                            "bound +0.00202)")
    assert study.verdict(diffs, 0.0025) == "equivalent within ±0.0025 (TOST)"
    assert study.words("a", "b", diffs, 0.0021).startswith(
        "a: equivalent to b within ±0.0021 (TOST at the edge, 90 % bound +0.00202; a − b = ")


def namesake_records(gains, seeds=range(6)):
    """Muon, W = 32 records of fp32, bf16 (+0.0005 on odd seeds), fp8 (+0.002, jittered) and each
    arm in gains {comm: per-seed difference from fp8}, on one machine."""
    jitter = (0.0004, -0.0004, 0.0002, -0.0002, 0.0001, -0.0001)
    out = []
    for k, s in enumerate(seeds):
        base = 2.0 + s / 10
        loss = {"fp32": base, "bf16": base + 0.0005 * (k % 2), "fp8": base + 0.002 + jitter[k % 6]}
        loss.update({c: loss["fp8"] + g[k] for c, g in gains.items()})
        out += [dict(study_record(c, s, v, 0.525 if c not in ("fp32", "bf16") else 1.0),
                     optimizer="muon", machine="CPU A", preset="char-study")
                for c, v in loss.items()]
    return out


def test_study_findings_in_words_from_the_numbers():
    """The findings block: the rotation lower than fp8 at 95 % gets the fraction of fp8's gap it
    recovers with Fieller's interval (here the fraction is uncertain: about the gap) and the
    remark that the margin is wider than that gap; Holm over the planned family (the two FP8
    geometry tests of Muon at W = 32) with the adjusted p of holm(); power from the paired sd;
    an optimizer with no 4-bit run says so."""
    from nanogeo.lab.study import stats
    gains = {"subspace": [-0.001, -0.004, -0.0005, -0.003, -0.002, -0.0015],
             "geofp8": [0.001, -0.002, 0.0, -0.001, 0.002, -0.001]}
    records = namesake_records(gains)
    text = flat(study.findings(records, (32,)))
    by_comm = study.study_groups(records, 32)["muon"]
    gain = stats.paired(by_comm["fp8"], by_comm["subspace"])[1]
    gap = stats.paired(by_comm["fp8"], by_comm["fp32"])[1]
    ratio, low, high = study.fieller(gain, gap)
    assert (f"It recovers {100 * ratio:.0f} % of `fp8`'s gap to fp32 (6 seeds; 95 % Fieller "
            f"interval {100 * low:.0f} % to {100 * high:.0f} %): about the size of that gap, the "
            "fraction uncertain.") in text
    assert "the margin is wider than `fp8`'s whole gap (+0.0020)" in text
    p = [stats.p_value(stats.paired(by_comm[c], by_comm["fp8"])[1]) for c in ("geofp8", "subspace")]
    assert ('Holm over the family "FP8 geometry, Muon W = 32", fixed before the runs (`geofp8` − '
            f"`fp8`, `subspace` − `fp8`): the smallest adjusted p is {min(study.holm(p)):.3f}") in text
    sd = stats.mean_sd(stats.paired(by_comm["subspace"], by_comm["fp8"])[1])[1]
    assert (f"`subspace` − `fp8` under Muon: sd {sd:.4f}, {study.seeds_for_power(sd, 0.002)} seeds "
            "(6 ran)") in text
    assert "- 4-bit: not measured in these results" in text
    assert all(len(line) <= 100 for line in study.findings(records, (32,)).splitlines())


def test_study_findings_say_whether_a_wire_under_the_goal_reaches_bf16():
    """The goal paragraph: a method of <= 0.42x bf16's bytes equivalent to bf16 (TOST at the
    margin) is named as reaching it; otherwise the closest one (smallest upper 90 % bound) and
    how far past the margin it ends; methods above 0.42x are not in it."""
    from nanogeo.lab.study import stats
    from nanogeo.lab.study.findings import goal_findings
    records = namesake_records({})          # fp32, bf16, fp8 (0.525x: not under the goal)
    mixed = {"nvfp4-e4m3s2": [0.006, 0.007, 0.005, 0.006, 0.008, 0.006],
             "nvfp4-e4m3s2-ef1": [0.003, 0.002, 0.004, 0.003, 0.002, 0.003]}
    for comm, gaps in mixed.items():
        for k, s in enumerate(range(6)):
            base = 2.0 + s / 10 + 0.0005 * (k % 2)          # bf16's loss on that seed
            records.append(dict(study_record(comm, s, base + gaps[k], 0.411), optimizer="muon",
                                machine="CPU A"))
    text = flat("\n".join(goal_findings(records, (32,))))
    by_comm = study.study_groups(records, 32)["muon"]
    low, high, _ = stats.tost(stats.paired(by_comm["nvfp4-e4m3s2-ef1"], by_comm["bf16"])[1])
    assert (f"Muon, W = 32: not reached: the closest, `nvfp4-e4m3s2-ef1`, ends "
            f"{high - 0.002:+.4f} past the margin at its upper 90 % bound") in text
    assert f"90 % {low:+.4f} to {high:+.4f}, 6 seeds" in text and "`fp8`" not in text
    for r in records:                       # ef1 now within 0.0005 of bf16 on every seed
        if r["comm"] == "nvfp4-e4m3s2-ef1":
            r["final_val_loss"] -= 0.0027
    assert "Muon, W = 32: reached by `nvfp4-e4m3s2-ef1`" in flat(
        "\n".join(goal_findings(records, (32,))))
    # the budget is the wire's bytes at W = 32: at W = 64 the same wire sends 0.422x and stays in
    records += [dict(r, workers=64, mean_wire_vs_bf16=0.422 if "e4m3s2" in r["comm"] else
                     r["mean_wire_vs_bf16"]) for r in records]
    text = flat("\n".join(goal_findings(records, (32, 64))))
    assert "Muon, W = 64: reached by `nvfp4-e4m3s2-ef1`" in text and "(0.422×)" in text


def test_study_summary_the_readmes_table():
    """The README's what-to-run table: per optimizer (Muon first), W and wire format the method
    to run, its bytes, its paired gaps, seeds and why in words: lower than the cheaper one it
    replaced (with p), where it stands against fp32 and bf16; a W whose recommendation is the
    pooled one says so."""
    losses = {"fp32": (2.00, 2.10, 2.20, 2.0), "bf16": (2.01, 2.11, 2.21, 1.0),
              "fp8": (2.02, 2.12, 2.22, 0.5), "subspace": (2.015, 2.125, 2.215, 0.5),
              "nvfp4": (2.10, 2.20, 2.30, 0.28), "subspace-nvfp4": (2.05, 2.15, 2.25, 0.28)}
    records = [study_record(comm, seed, values[seed], values[3])
               for comm, values in losses.items() for seed in range(3)]
    records += [dict(r, optimizer="muon") for r in records if r["comm"] in ("fp32", "fp8")]
    rows = study.summary(records).splitlines()
    assert rows[2] == ("| Muon, W = 32 | FP8 | `fp8` | 0.500× | +0.0200 ± 0.0000 | — | — | 3 | "
                       "provisional (3 seeds); the only candidate; above fp32 at 95 % |")
    assert rows[3] == ("| AdamW, W = 32 | FP8 | `fp8` | 0.500× | +0.0200 ± 0.0000 | +0.0100 ± "
                       "0.0000 | — | 3 | provisional (3 seeds); no other candidate lower; above "
                       "fp32 and bf16 at 95 % |")
    assert rows[4] == ("| AdamW, W = 32 | 4-bit | `subspace-nvfp4` | 0.280× | +0.0500 ± 0.0000 "
                       "| +0.0400 ± 0.0000 | — | 3 | provisional (3 seeds); lower than `nvfp4` "
                       '(p < 0.001, Holm in "exploratory: AdamW, W = 32, 4-bit"; tail mean: not '
                       "recorded); above fp32 and bf16 at 95 % |")
    assert all(len(line) <= 100 for line in rows[6:])
    # the tail mean: where it does not separate what the final val loss does, the words say so
    gains = {"subspace": [-0.001, -0.004, -0.0005, -0.003, -0.002, -0.0015] * 2}
    records = namesake_records(gains, range(12))
    for k, r in enumerate(records):
        r["tail_val_loss"] = r["final_val_loss"] + (0.004 * (k % 3 - 1) if r["comm"] == "subspace"
                                                    else 0.0)
    row = study.summary(records).splitlines()[2]
    assert row.startswith("| Muon, W = 32 | FP8 | `subspace` | 0.525× |")
    assert ", not significant there); on the tail mean the rule picks `fp8`;" in row


def test_study_figure_values_are_the_comparisons(tmp_path, monkeypatch, capsys):
    """forest(): per optimizer and W a panel - bf16 and each candidate against fp32, each
    geometry against its Euclidean twin - whose means and 95 % half-widths are the comparisons
    table's; --figure writes the PNG and its values beside it, and without matplotlib draws
    nothing and says so in one line (the tables and the values are still written)."""
    gains = {"subspace": [-0.001, -0.004, -0.0005, -0.003, -0.002, -0.0015],
             "geofp8": [0.001, -0.002, 0.0, -0.001, 0.002, -0.001]}
    records = namesake_records(gains)
    data = study.forest(records, (32,))
    [panel] = data["panels"]
    assert panel["title"] == "Muon, W = 32" and data["margin"] == study.MARGIN
    assert [(r["a"], r["b"]) for r in panel["rows"]] == [
        ("bf16", "fp32"), ("fp8", "fp32"), ("geofp8", "fp32"), ("subspace", "fp32"),
        ("geofp8", "fp8"), ("subspace", "fp8")]
    table = study.comparisons(records, (32,))
    for row in panel["rows"]:
        half = (row["high"] - row["low"]) / 2
        assert (f"| {row['a']} − {row['b']} | {row['seeds']} | {row['mean']:+.4f} ± {half:.4f} |"
                in table)
        assert row["provisional"] and row["label"] == (
            f"{row['a']} − {row['b']}  ({row['wire']:.3f}×, 6 seeds, provisional)")
    (tmp_path / "r.json").write_text(json.dumps(records))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)   # import fails
    study.main(["--answer", str(tmp_path / "r.json"), "--figure", str(tmp_path / "f.png")])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"matplotlib not installed: {tmp_path / 'f.png'} not drawn")
    assert [p.name for p in tmp_path.glob("f.*")] == ["f.json"]
    assert json.loads((tmp_path / "f.json").read_text()) == json.loads(json.dumps(data))
    with pytest.raises(SystemExit):
        study.main(["--figure", str(tmp_path / "f.png")])
    assert "--figure goes with --answer" in capsys.readouterr().err
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    study.main(["--answer", str(tmp_path / "r.json"), "--figure", str(tmp_path / "f.png")])
    assert (tmp_path / "f.png").stat().st_size > 0
    assert json.loads((tmp_path / "f.json").read_text()) == json.loads(json.dumps(data))


def test_study_writes_every_block_a_file_holds(tmp_path, capsys):
    """--readme FILE (repeatable) rewrites every generated block FILE holds, from one read of
    the results: the README's what-to-run table and the study page's answer, findings,
    comparisons and machines (which file, machine, commits, W and seeds)."""
    records = namesake_records({"subspace": [-0.001, -0.004, -0.0005, -0.003, -0.002, -0.0015]})
    records = [dict(r, commit="0123456789abcdef") for r in records]
    (tmp_path / "r.json").write_text(json.dumps(records))
    from nanogeo.lab.study import page
    readme, docs = tmp_path / "README.md", tmp_path / "page.md"
    readme.write_text("top\n" + "\n".join(page.marker("what to run")) + "\nend\n")
    docs.write_text("\n".join(x for n in ("findings", "comparisons", "machines")
                              for x in page.marker(n)) + "\n")
    study.main(["--answer", str(tmp_path / "r.json"), "--readme", str(readme),
                "--readme", str(docs)])
    assert capsys.readouterr().out == (f"{readme}: what to run\n"
                                       f"{docs}: findings, comparisons, machines\n")
    assert study.summary(records) in readme.read_text()
    text = docs.read_text()
    assert study.findings(records) in text and study.comparisons(records) in text
    assert (f"| {tmp_path / 'r.json'} | M1 | 24 | 0123456 | 32 | 0-5 |\n\n- M1 = CPU A\n"
            in text)


def test_generated_lines_keep_numbers_with_their_units():
    """wrap(): lines of at most 100 characters that never part "23 %" or "± 0.0017" (a bare
    "%" or "0.0017" opening a line reads as another number), bullets hanging under their dash."""
    from nanogeo.lab.study.stats import wrap
    assert wrap("x" * 96 + " 23 %").splitlines() == ["x" * 96, "23 %"]
    assert wrap("x" * 97 + " ± 0.0017").splitlines() == ["x" * 97, "± 0.0017"]
    assert wrap("- " + "word " * 30).splitlines()[1].startswith("  word")


def test_benjamini_hochberg_holm_and_tost_p_by_hand():
    """BH, by hand: p = 0.01, 0.04, 0.03, 0.20 (m = 4) sorted times m / rank: 0.04, 0.06, 0.0533,
    0.20; made non-increasing from the top: 0.20, 0.0533, 0.0533, 0.04 - in the order given
    [0.04, 0.0533, 0.0533, 0.20]; a nan p (no test) stays nan and does not count in m. Holm of
    the namesake family's two p's 0.013 and 0.225: 0.026 (x 2) and 0.225. TOST p of [1, 2, 3] x
    1e-3 at +-0.003 (df 2, P(T > t) = 1/2 - t / (2 sqrt(2 + t^2))): the upper test's t = -sqrt(3)
    gives 1/2 - sqrt(3) / (2 sqrt(5)) = 0.112702, the lower one's t = 5 sqrt(3) gives 0.0065;
    the TOST's p is the larger."""
    from nanogeo.lab.study import stats
    q = stats.benjamini_hochberg([0.01, 0.04, 0.03, 0.20])
    assert q == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.20])
    q = stats.benjamini_hochberg([float("nan"), 0.01, 0.02])
    assert math.isnan(q[0]) and q[1:] == pytest.approx([0.02, 0.02])
    assert study.holm([0.013, 0.225]) == pytest.approx([0.026, 0.225])
    diffs = [0.001, 0.002, 0.003]
    assert stats.tost_p(diffs, 0.003) == pytest.approx(0.5 - math.sqrt(3) / (2 * math.sqrt(5)),
                                                       abs=1e-6)
    assert stats.one_sided_p(diffs, -0.003) == pytest.approx(
        0.5 - 5 * math.sqrt(3) / (2 * math.sqrt(2 + 75)), abs=1e-6)
    assert (stats.tost_p(diffs, 0.01) < 0.05) == stats.tost(diffs, 0.01)[2]


def test_standing_words_follow_the_90_and_95_percent_intervals():
    """"No difference detected" only where the 90 % interval holds 0; where only the 90 %
    interval excludes 0 the words give the direction and that interval (issue 59: the mixed
    wire against bf16 at +0.0020 ± 0.0021 was "no difference detected")."""
    from nanogeo.lab.study import stats
    base = [-1.0, -0.4, 0.1, 0.5, 0.9, 1.3]
    for shift in (0.0, 0.2, 0.45, 0.55, 0.8, 1.5):
        diffs = [(shift + x) * 0.01 for x in base]
        mean, half = stats.mean_ci(diffs)
        low, high, _ = stats.tost(diffs, 0.0001)
        said = stats.standing(diffs, 0.0001)
        if abs(mean) > half:
            assert said == "higher"
        elif low > 0:
            assert said == "likely higher" and "likely higher than b (90 % interval " in \
                study.words("a", "b", diffs, 0.0001)
        else:
            assert said == "no difference detected" and low <= 0 <= high
    assert {stats.standing([(s + x) * 0.01 for x in base], 0.0001) for s in (0.0, 0.55, 1.5)} \
        == {"no difference detected", "likely higher", "higher"}


PLAN_TEXT = """# plan

## study A

Written before the runs.

| id | comparison | preset | optimizer | W | test | margin | seeds | endpoint | family |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| A1 | subspace - fp8 | char-study | muon | 32 | less | - | 6 | final | geometry |
| A2 | geofp8 - fp8 | char-study | muon | 32 | less | - | 6 | final | geometry |

## study B: retrospective

| id | comparison | preset | optimizer | W | test | margin | seeds | endpoint | family |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| B1 | fp8 - fp32 | char-study | muon | 32 | equivalent | 0.002 | 6 | final | baselines |
| B2 | bf16 - fp32 | char-study | muon | 32 | report | - | 6 | final | - |
"""


def test_plan_is_read_and_labels_every_comparison():
    """plan.md's tables, read: a section's rows with their test, margin and family; a section
    that says "retrospective" marks its rows so; every comparison the tool prints is labelled
    planned (id), retrospective (id) or exploratory; Holm adjusts the plan's family together
    (here the two geometry tests: the smaller p doubled). A row with a test and no family, or
    one comparison named with two families, fails with the row's id."""
    from nanogeo.lab.study import plan
    rows = plan.parse(PLAN_TEXT)
    assert [(r.id, r.a, r.b, r.test, r.family, r.retrospective) for r in rows] == [
        ("A1", "subspace", "fp8", "less", "geometry", False),
        ("A2", "geofp8", "fp8", "less", "geometry", False),
        ("B1", "fp8", "fp32", "equivalent", "baselines", True),
        ("B2", "bf16", "fp32", "report", None, True)]
    assert rows[2].margin == 0.002 and rows[0].margin is None and rows[0].seeds == 6
    assert plan.label(plan.lookup(rows, "char-study", "muon", 32, "fp8", "subspace")) == \
        "planned (A1)"
    assert plan.label(plan.lookup(rows, "char-study", "muon", 64, "subspace", "fp8")) == \
        "exploratory"
    a1 = plan.lookup(rows, "char-study", "muon", 32, "fp8", "subspace")     # 6 seeds planned
    assert plan.label(a1, 6) == "planned (A1)"
    assert plan.label(a1, 4) == "planned (A1), interim: 4 of 6 seeds"      # a look before the end
    assert plan.label(a1, 9) == "planned (A1), 9 seeds, 6 planned"         # grown past the plan
    assert plan.label(rows[2], 9) == "retrospective (B1)"                  # fixed after the runs
    with pytest.raises(ValueError, match="B1"):
        plan.parse(PLAN_TEXT.replace("0.002 | 6 | final | baselines", "0.002 | 6 | final | -"))
    with pytest.raises(ValueError, match="A1 and A3"):
        plan.parse(PLAN_TEXT + "| A3 | subspace - fp8 | char-study | muon | 32 | less | - | 6 | "
                               "final | other |\n")
    gains = {"subspace": [-0.001, -0.004, -0.0005, -0.003, -0.002, -0.0015],
             "geofp8": [0.001, -0.002, 0.0, -0.001, 0.002, -0.001]}
    records = namesake_records(gains)
    tests = Multiplicity(records, (32,), rows)
    by_comm = study.study_groups(records, 32)["muon"]
    p = {c: study.stats.p_value(study.stats.paired(by_comm[c], by_comm["fp8"])[1])
         for c in ("subspace", "geofp8")}
    assert tests.adjusted("muon", 32, "subspace", "fp8")[1:] == (
        pytest.approx(min(1.0, 2 * min(p.values()))), "geometry")
    table = study.comparisons(records, (32,), tests=tests)
    label = lambda pair: next(l for l in table.splitlines() if f"| {pair} |" in l).split(" | ")[10]
    assert label("subspace − fp8") == "planned (A1)" and label("fp8 − fp32") == \
        "retrospective (B1)"
    assert label("subspace − bf16") == "exploratory" and label("bf16 − fp32") == \
        "retrospective (B2)"
    holm_cell = next(l for l in table.splitlines() if "| fp8 − fp32 |" in l).split(" | ")[8]
    assert holm_cell.endswith(" TOST (baselines)")
