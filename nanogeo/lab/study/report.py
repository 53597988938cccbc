"""
The study's tables (study.md): per optimizer, W and set of train flags, one row per method, every
gap paired by block (a seed on one machine) and pooled over the machines the seeds ran on.

A group holds the runs compared with one another: one optimizer, W, kind of ranks and set of train
flags. Runs whose machine was recorded are pooled across machines (each seed's arms ran back to
back on one CPU, so a pair never spans two CPUs); runs of an older driver, whose machine was not
recorded, form a group of their own and are never pooled with them. Several results files (of
studies run on different machines) are read as one (load_results).
"""

import json

from nanogeo.lab.study.stats import (MIN_BOOTSTRAP_SEEDS, estimate, mean_sd, paired,
                                       recovered, reference_problem, welch_differs)


def load_results(paths):
    """The records of one or more results.json files (a list of paths, or one comma-separated
    text), in order; a run found in several files (the same command on the same machine) counts
    once, from the first file that has it."""
    if isinstance(paths, str):
        paths = [p for p in paths.split(",") if p]
    results, seen = [], set()
    for path in paths:
        for r in json.load(open(path)):
            key = ((tuple(r["command"]), r.get("machine")) if r.get("command")
                   else json.dumps(r, sort_keys=True))      # an older driver's: the whole record
            if key not in seen:
                seen.add(key)
                results.append(r)
    return results


def group(r):
    """Runs compared with one another: same optimizer, W, kind of ranks, train flags (None: a
    record from before the flags were stored), and whether the machine was recorded (runs of
    recorded machines are pooled, blocks of one machine paired; unrecorded ones stay apart)."""
    flags = r.get("flags")
    return (r["optimizer"], r["workers"], r.get("simulated", False),
            None if flags is None else tuple(flags), r.get("machine") is not None)


def group_order(key):
    optimizer, workers, simulated, flags, recorded = key
    return optimizer, workers, simulated, flags is not None, flags or (), not recorded


def block(r):
    """The unit of pairing: (machine, seed). Two arms are paired only on the same seed of the
    same machine; '' stands for an unrecorded machine (its group is never pooled)."""
    return r.get("machine") or "", r["seed"]


def arms_of(rows):
    """{comm: {block: record}} of a group's records (the first record of a block, as
    load_results orders them)."""
    by = {}
    for r in rows:
        by.setdefault(r["comm"], {}).setdefault(block(r), r)
    return by


def study_groups(results, workers):
    """{optimizer: {comm: {block: record}}} of the study's runs at W = workers; per optimizer
    one group (group(): one set of train flags, machines pooled): the one with the most
    runs among those whose machines were recorded (unrecorded ones may mix machines within a
    pair), or among all when none was; a tie goes to the first in group_order."""
    out = {}
    for optimizer in sorted({r["optimizer"] for r in results}):
        rows = [r for r in results if not r.get("sweep") and r["optimizer"] == optimizer
                and r["workers"] == workers]
        if not rows:
            continue
        keys = [group(r) for r in rows]
        main = min(set(keys), key=lambda k: (not k[-1], -keys.count(k), group_order(k)))
        out[optimizer] = arms_of([r for r in rows if group(r) == main])
    return out


OPTIMIZER_NAMES = {"muon": "Muon", "adamw": "AdamW"}     # in the order shown: the paper's first


def settings(results, workers):
    """[(optimizer, W, {comm: {block: record}})] of study_groups at each W, optimizer by
    optimizer (OPTIMIZER_NAMES's order, then others by name), each at every W it ran: the order
    of the README's table, the findings and the figure's panels."""
    groups = {w: study_groups(results, w) for w in workers}
    present = {o for g in groups.values() for o in g}
    order = [o for o in OPTIMIZER_NAMES if o in present] + sorted(present - set(OPTIMIZER_NAMES))
    return [(o, w, groups[w][o]) for o in order for w in workers if o in groups[w]]


def machine_labels(results):
    """{machine: "M1", ...}: short names for the recorded machines, in sorted order."""
    names = sorted({r["machine"] for r in results if r.get("machine")})
    return {m: f"M{k}" for k, m in enumerate(names, 1)}


def seed_list(seeds):
    """[0, 1, 2, 5] -> '0-2, 5'."""
    seeds, parts = sorted(seeds), []
    for s in seeds:
        if parts and s == parts[-1][1] + 1:
            parts[-1][1] = s
        else:
            parts.append([s, s])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def machines_text(rows, labels):
    """'M1 = CPU ... (seeds 0-11); M2 = ...' for a group's records."""
    seeds = {}
    for r in rows:
        seeds.setdefault(r["machine"], set()).add(r["seed"])
    return "; ".join(f"{labels[m]} = {m} (seeds {seed_list(s)})" for m, s in sorted(seeds.items()))


def per_machine(runs, other):
    """{machine: the differences runs - other on that machine's shared seeds}."""
    blocks, diffs = paired(runs, other)
    out = {}
    for (m, _), d in zip(blocks, diffs):
        out.setdefault(m, []).append(d)
    return out


def machine_cell(runs, other, labels):
    """Each machine's mean of the paired differences and its seeds; "differs" where a Welch t
    test of that machine's differences against all other machines' rejects equal means at 5 %
    (both sides need >= 2 seeds). "—" unless the pairs span two machines or more."""
    by = per_machine(runs, other)
    if len(by) < 2:
        return "—"
    cells = []
    for m in sorted(by):
        rest = [d for n, ds in by.items() if n != m for d in ds]
        flag = ", differs" if welch_differs(by[m], rest) else ""
        cells.append(f"{labels.get(m, '?')} {mean_sd(by[m])[0]:+.4f} ({len(by[m])}{flag})")
    return "; ".join(cells)


def gap_cell(runs, other, row_seeds):
    seeds, gaps = paired(runs, other)
    if not seeds:
        return "—"
    return estimate(gaps, sign="+") + (f" ({len(seeds)} paired)" if len(seeds) < row_seeds else "")


def fraction_cell(runs, fp32, ref):
    seeds = [s for s in sorted(runs) if s in fp32 and s in ref]
    if not seeds:
        return "—"
    _, gaps = paired({s: runs[s] for s in seeds}, fp32)
    _, ref_gaps = paired({s: ref[s] for s in seeds}, fp32)
    problem = reference_problem(ref_gaps)
    if problem:
        return problem
    mean, lo, hi, interval = recovered(gaps, ref_gaps)
    return f"{100 * mean:.0f} % ({100 * lo:.0f} to {100 * hi:.0f} %, {interval})"


def heading(key, rows, labels):
    optimizer, workers, simulated, flags, recorded = key
    commits = sorted({(r.get("commit") or "?")[:10] + ("+dirty" if r.get("dirty") else "")
                      for r in rows})
    ranks = "simulated" if simulated else "real"
    flag_text = ("train flags not recorded (records from an older driver)" if flags is None
                 else "train flags: " + (" ".join(f"`{f}`" for f in flags) or "none"))
    mixed = (f" (**{len(commits)} commits**: pairs across them assume the code did not change "
             "their numbers)" if len(commits) > 1 else "")
    where = (("machine " if len({r["machine"] for r in rows}) == 1 else "machines ")
             + machines_text(rows, labels) if recorded
             else "machine not recorded (pairs may mix machines)")
    return [f"\n### {optimizer}, W = {workers} ({ranks} ranks)\n",
            f"{flag_text}; commit {', '.join(commits)}{mixed}; {where}\n"]


def wire_cell(rows):
    """Bytes per rank per step against a bf16 ring all-reduce, averaged over all steps (older
    records: the last step's)."""
    means = [r["mean_wire_vs_bf16"] for r in rows if r.get("mean_wire_vs_bf16") is not None]
    if means:
        return f"{sum(means) / len(means):.3f}"
    last = rows[0].get("wire_vs_bf16")
    return "-" if last is None else f"{last:.3f} (last step)"


def row(comm, runs, fp32, ref, baseline, labels=None):
    """One method's row; runs, fp32, ref: {block: record}. baseline: fp32 or the reference.
    labels (several machines): a last cell with each machine's mean gap to fp32."""
    blocks = sorted(runs)
    cells = [comm, str(len(blocks)), estimate([runs[b]["final_val_loss"] for b in blocks]),
             "—" if comm == "fp32" else gap_cell(runs, fp32, len(blocks)),
             "—" if baseline else gap_cell(runs, ref, len(blocks)),
             "—" if baseline else fraction_cell(runs, fp32, ref),
             wire_cell([runs[b] for b in blocks]),
             f"{sum(runs[b]['ms_per_step'] for b in blocks) / len(blocks):.0f}"]
    if labels is not None:
        cells.append("—" if comm == "fp32" else machine_cell(runs, fp32, labels))
    return "| " + " | ".join(cells) + " |"


def table(results, reference):
    """The markdown tables of a study: per optimizer, W and train flags, one row per method."""
    lines = []
    study = [r for r in results if not r.get("sweep")]
    labels = machine_labels(study)
    for key in sorted({group(r) for r in study}, key=group_order):
        rows = [r for r in study if group(r) == key]
        by = arms_of(rows)
        fp32, ref = by.get("fp32", {}), by.get(reference, {})
        several = len({r.get("machine") for r in rows}) > 1
        lines += heading(key, rows, labels)
        columns = ["method", "seeds", "final val loss (95 % t)", "gap to fp32 (paired, 95 % t)",
                   f"gap to {reference} (paired, 95 % t)", f"recovers of {reference}'s gap (95 %)",
                   "wire vs bf16", "ms/step"] + (["gap to fp32 by machine (seeds)"] if several
                                                 else [])
        lines += ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
        lines += [row(comm, runs, fp32, ref, comm in ("fp32", reference),
                      labels if several else None) for comm, runs in by.items()]
        _, ref_gaps = paired(ref, fp32)
        problem = reference_problem(ref_gaps)
        if problem not in (None, "one seed"):
            lines.append(f"\n{reference}'s gap to fp32 is {estimate(ref_gaps, sign='+')}: "
                         f"{problem}, so no fraction of it is given.")
    legend = ("\nFinal val loss: train.py's, the mean of its last --final_evals evaluations. "
              "Intervals: 95 % Student t over seeds; gaps are paired by seed on one machine "
              "and pooled over machines (a seed on a machine is one block); the recovered "
              "fraction is the mean over seeds of 1 - gap / reference gap (a percentile "
              f"bootstrap, so labelled, from {MIN_BOOTSTRAP_SEEDS} seeds). By machine: each "
              "machine's mean gap and seeds; \"differs\" where a Welch t test (5 %) of its "
              "gaps against the other machines' rejects equal means. Wire: the bytes a rank "
              "sends per step, averaged over all steps, in every collective of the gradient "
              "communication (with the scales' MAX and the K-FAC statistics' all-reduces), "
              "against a bf16 ring all-reduce.")
    return "\n".join(lines + ([legend] if lines else [])) + "\n"
