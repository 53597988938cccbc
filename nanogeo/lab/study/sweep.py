"""
The short fp32 learning-rate sweep that tunes each optimizer before a study (--sweep), its
summary (sweep.json, sweep.md) and --lr_from, which passes each swept flag's best value on.
"""

import json
import math

from nanogeo.lab.study.stats import estimate, mean_ci

SWEEPABLE = {"learning_rate": ("adamw", "muon"), "muon_lr": ("muon",)}  # flag: its optimizers


def parse_sweep(text, optimizers):
    """--sweep FLAG=V1,V2,... -> (flag, [value texts]); a message naming the fix otherwise."""
    flag, _, values = text.partition("=")
    if flag not in SWEEPABLE:
        raise ValueError(f"--sweep {text}: sweep one of {', '.join(SWEEPABLE)}, e.g. "
                         "--sweep muon_lr=1e-3,3e-3,1e-2")
    values = [v for v in values.split(",") if v]
    try:
        bad = [v for v in values if not float(v) > 0]
    except ValueError:
        bad = values
    if len(values) < 2 or bad:
        raise ValueError(f"--sweep {text}: give two or more positive numbers, e.g. "
                         f"--sweep {flag}=1e-3,3e-3,1e-2")
    wrong = [o for o in optimizers if o not in SWEEPABLE[flag]]
    if wrong:
        raise ValueError(f"--sweep {flag} applies to --optimizers "
                         f"{','.join(SWEEPABLE[flag])}, not {wrong[0]}")
    return flag, values


def sweep_groups(results):
    """{(optimizer, W, simulated, flag, the other train flags): {value: {seed: record}}}."""
    groups = {}
    for r in results:
        if r.get("sweep"):
            flag, value = r["sweep"]
            others = tuple(f for f in r["flags"] if f != f"--{flag}={value}")
            key = (r["optimizer"], r["workers"], r["simulated"], flag, others)
            groups.setdefault(key, {}).setdefault(value, {})[r["seed"]] = r
    return groups


def sweep_summary(results):
    """sweep.json's content: per sweep group every value's final val losses over the seeds
    all its values share, and the best value (the lowest mean; nan counts as worst)."""
    entries = []
    for (optimizer, workers, simulated, flag, others), by_value in sweep_groups(results).items():
        seeds = sorted(set.intersection(*(set(runs) for runs in by_value.values())))
        values = sorted(by_value, key=float)
        losses = {v: [by_value[v][s]["final_val_loss"] for s in seeds] for v in values}
        means = {v: mean_ci(losses[v])[0] if seeds else float("nan") for v in values}
        best = min(values, key=lambda v: (math.isnan(means[v]), means[v]))
        entries.append({"optimizer": optimizer, "workers": workers, "simulated": simulated,
                        "flag": flag, "train_flags": list(others), "seeds": seeds,
                        "values": [{"value": v, "final_val_loss": losses[v], "mean": means[v]}
                                   for v in values],
                        "best": best, "best_at_edge": best in (values[0], values[-1])})
    return entries


def sweep_table(entries):
    lines = []
    for e in entries:
        ranks = "simulated" if e["simulated"] else "real"
        lines += [f"\n### {e['optimizer']}, W = {e['workers']} ({ranks} ranks): {e['flag']}\n",
                  "train flags: " + (" ".join(f"`{f}`" for f in e["train_flags"]) or "none")
                  + f"; seeds {', '.join(map(str, e['seeds']))}\n",
                  f"| {e['flag']} | final val loss (95 % t) | gap to the best (paired, 95 % t) |",
                  "| --- | --- | --- |"]
        best = next(v["final_val_loss"] for v in e["values"] if v["value"] == e["best"])
        for v in e["values"]:
            gaps = [a - b for a, b in zip(v["final_val_loss"], best)]
            mark = " (best)" if v["value"] == e["best"] else ""
            lines.append(f"| {v['value']}{mark} | {estimate(v['final_val_loss'])} | "
                         f"{'—' if mark or not gaps else estimate(gaps, sign='+')} |")
        if e["best_at_edge"]:
            lines.append(f"\nThe best value is at an end of the grid: extend it past {e['best']}.")
    return "\n".join(lines) + "\n"


def lr_flags(path, optimizer, workers):
    """The best value of every flag swept for this optimizer and W in sweep.json at `path`, as
    train flags; a ValueError naming the fix when there is none or more than one. Simulated
    and real ranks count alike (the same numerics: train.py --simulate_workers)."""
    try:
        entries = json.load(open(path))["sweeps"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"--lr_from {path}: not a sweep.json written by "
                         "`python -m nanogeo.lab.study --sweep ...`") from None
    ranks = f"W = {workers}"
    mine = [e for e in entries if (e["optimizer"], e["workers"]) == (optimizer, workers)]
    if not mine:
        raise ValueError(f"--lr_from {path} has no sweep for {optimizer} at {ranks}: run "
                         f"--sweep with --optimizers {optimizer} at this W first, or "
                         "leave --lr_from out")
    flags = [e["flag"] for e in mine]
    twice = [f for f in flags if flags.count(f) > 1]
    if twice:
        raise ValueError(f"--lr_from {path} holds {flags.count(twice[0])} sweeps of {twice[0]} "
                         f"for {optimizer} at {ranks} (other train flags): keep one sweep of a "
                         "flag per out_dir")
    return [f"--{e['flag']}={e['best']}" for e in mine]
