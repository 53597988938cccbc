"""
`--comm=auto` (train.py's default): run the method the study recommends for the optimizer in
force, on the wire chosen (FP8 unless --fmt=nvfp4 says 4 bits, with --stage2_fmt=e4m3 the mixed
4-bit + FP8 wire).

The recommendations are recommended.json beside this file, written by the study tool from the
same rule and the same results as the README's what-to-run table
(`python -m nanogeo.lab.study --answer RESULTS --picks FILE`, nanogeo/lab/study/
recommended.py): one row per optimizer, W and wire format, each with the study arm it picks
and that arm's train.py flags. Today that is Muon -> the subspace rotation on the two-stage
FP8 collective at W = 32 but Euclidean FP8 at W = 64 (nothing detected there: from 46 ranks a
run takes that row), AdamW -> Euclidean FP8.

How a run resolves `auto`:
  * one data-parallel rank: nothing is communicated, so fp32 (no rounding at all);
  * otherwise the row of the optimizer in force and the wire, at the W nearest the run's ranks
    (in ratio: 4 GPUs take the study's W = 32 row); its flags are applied except where the run
    already sets a flag the pick sets (an explicit flag wins).
The run's first line says what runs and why.
"""

import dataclasses
import json
import math
import os

from nanogeo.run.config import ConfigError, parse_value

RECOMMENDED = os.path.join(os.path.dirname(__file__), "recommended.json")


def wire(cfg):
    """The table's wire format of a run's flags, as nanogeo.lab.study.arms.wire_format names an
    arm's: "FP8" (the default), "4-bit", or stage 1's + stage 2's where they differ ("4-bit +
    FP8"; "FP8 + 4-bit", which no row picks for)."""
    kind = lambda fmt: "4-bit" if fmt == "nvfp4" else "FP8"
    first, second = kind(cfg.fmt), kind(cfg.stage2_fmt or cfg.fmt)
    return first if second == first else f"{first} + {second}"


def load(path=RECOMMENDED):
    """recommended.json's rows: [{"optimizer", "workers", "wire", "arm", "flags"}]."""
    with open(path) as f:
        return json.load(f)["picks"]


def nearest(rows, ranks):
    """The row whose W is nearest `ranks` in ratio (ties: the smaller W)."""
    return min(rows, key=lambda r: (abs(math.log(r["workers"] / ranks)), r["workers"]))


def flag_values(flags, fields):
    """["--comm=subspace", "--error_feedback", ...] -> {field: typed value}."""
    values = {}
    for flag in flags:
        key, has_value, text = flag[2:].partition("=")
        values[key] = parse_value(fields[key], text if has_value else "true")
    return values


def resolve(cfg, ranks, defaults, path=RECOMMENDED):
    """(cfg with `comm` resolved, the line that says what runs and why); cfg as it is (and None)
    unless cfg.comm == "auto". `defaults`: the config the run would have with no flags (its
    preset's), to tell the flags the run set from the ones it left: a field that differs from
    its default was set, and wins over the pick."""
    if cfg.comm != "auto":
        return cfg, None
    if ranks == 1:
        return (dataclasses.replace(cfg, comm="fp32"),
                "comm=auto: fp32 - one data-parallel rank, nothing to communicate")
    on = wire(cfg)
    rows = [r for r in load(path) if r["optimizer"] == cfg.optimizer and r["wire"] == on]
    if not rows:
        raise ConfigError(f"--comm=auto: {path} recommends nothing for --optimizer="
                          f"{cfg.optimizer} on the {on} wire; pass --comm explicitly")
    row = nearest(rows, ranks)
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    picked = flag_values(row["flags"], fields)
    kept = [k for k in picked if k != "comm" and getattr(cfg, k) != getattr(defaults, k)]
    cfg = dataclasses.replace(cfg, **{k: v for k, v in picked.items() if k not in kept})
    why = (f"comm=auto: {row['arm']} ({' '.join(row['flags'])}) - the study's pick for "
           f"{cfg.optimizer} on the {on} wire at W = {row['workers']} (this run: {ranks} "
           "ranks; README.md, What to run)")
    return cfg, why + (f"; your {', '.join('--' + k for k in kept)} kept" if kept else "")
