"""
The answer: which method to run, per optimizer and wire format - the tables of
docs/study/README.md (and, in short, the README's: page.summary), written by
`python -m nanogeo.lab.study --answer RESULTS[,RESULTS...] --readme FILE`.

The rule (RULE, printed under each table):
  * candidates: the methods measured with that wire format that are not controls (is_control:
    hadamard*, the forced *-all arms), with >= 2 finite seeds paired with fp32 and their bytes
    recorded;
  * two methods are compared only on the seeds they share (a seed on one machine; seeds of
    several machines pooled);
  * the pick starts at the cheapest candidate (cost(): Euclidean, then error feedback or
    stochastic rounding, then the Hadamard rotation, then a geometry; more seeds first, then by
    name); each costlier candidate replaces the pick only when it is lower than the pick at
    95 % on the seeds they share. Extra machinery must show that it helps;
  * a mixed wire (NVFP4 all-to-all, FP8 all-gather: "4-bit + FP8") is a row of its own, only
    where one was measured, with its bytes and no byte goal (it is neither budget's wire);
  * several W: one recommendation per wire format, the rule run on all W's seeds pooled (each
    (W, machine, seed) a block), unless at some W that W's own pick is lower than the pooled
    one at 95 % - then the data separate the W's and each keeps its own;
  * the words: every other candidate, and fp32 and bf16, against the pick, by compare.words():
    "equivalent ... within +-margin (TOST)" only when the 90 % paired interval lies inside the
    margin, "no difference detected (+- x)" when the 95 % interval includes 0; every recovered
    fraction with its interval.
"""

import math
from collections import namedtuple

from nanogeo.lab.study.arms import BUDGETS, cost, is_control, wire_format
from nanogeo.lab.study.compare import twin, words
from nanogeo.lab.study.report import (fraction_cell, gap_cell, load_results, machine_labels,
                                        machines_text, per_machine, study_groups)
from nanogeo.lab.study.stats import MARGIN, estimate, mean_ci, paired, welch_differs, wrap


def mean_ms(runs):
    return sum(r["ms_per_step"] for r in runs.values()) / len(runs)


def wire_of(runs):
    """A method's bytes vs bf16, averaged over its runs; None for records without them."""
    means = [r.get("mean_wire_vs_bf16") for r in runs.values()]
    return None if None in means else sum(means) / len(means)


def candidates(by_comm, name):
    """The methods that may be recommended for wire format `name`, cheapest first (cost, then
    more seeds, then name): not controls, >= 2 finite seeds paired with fp32, bytes recorded."""
    fp32 = by_comm.get("fp32", {})
    fits = []
    for c, runs in by_comm.items():
        if c == "fp32" or wire_format(c) != name or is_control(c):
            continue
        gaps = paired(runs, fp32)[1]
        if len(gaps) >= 2 and all(map(math.isfinite, gaps)) and wire_of(runs) is not None:
            fits.append(c)
    return sorted(fits, key=lambda c: (cost(c), -len(by_comm[c]), c))


def lower(by_comm, a, b):
    """Whether a is lower than b at 95 % on the seeds they share (paired t interval below 0)."""
    diffs = paired(by_comm[a], by_comm[b])[1]
    if len(diffs) < 2:
        return False
    mean, half = mean_ci(diffs)
    return mean + half < 0


def recommend(by_comm, name):
    """The method to run with wire format `name` ("FP8" or "4-bit"): the cheapest candidate,
    replaced by each costlier one in turn only where it is lower than the pick at 95 % on the
    seeds the two share. Returns (pick, [candidates]) or None."""
    fits = candidates(by_comm, name)
    if not fits:
        return None
    pick = fits[0]
    for c in fits[1:]:
        if lower(by_comm, c, pick):
            pick = c
    return pick, fits


def pooled_over_w(results, workers):
    """{optimizer: {comm: {(W, machine, seed): record}}}: study_groups at every W, pooled."""
    out = {}
    for w in workers:
        for optimizer, by_comm in study_groups(results, w).items():
            for comm, runs in by_comm.items():
                mine = out.setdefault(optimizer, {}).setdefault(comm, {})
                mine.update({(w, *b): r for b, r in runs.items()})
    return out


def answer_row(optimizer, name, budget, by_comm, margin=MARGIN, pick=None):
    """One row of the answer table (a wire format's recommendation) and its notes; `pick`
    overrides the rule's pick at this W (answers(): one recommendation across W)."""
    label = f"| {optimizer} | {name} |"
    picked = recommend(by_comm, name)
    if picked is None:
        return label + " nothing measured yet (>= 2 finite seeds paired with fp32) |" + \
            " |" * 7, []
    comm, fits = picked
    comm = pick or comm
    fp32, bf16, runs = by_comm.get("fp32", {}), by_comm.get("bf16", {}), by_comm[comm]
    seeds, gaps = paired(runs, fp32)
    plain = twin(comm, list(by_comm))
    speed = f"{mean_ms(runs) / mean_ms(by_comm[plain]):.2f}×" if plain else "1.00×"
    fraction = "—"
    if plain and plain != comm:
        cell = fraction_cell(runs, fp32, by_comm[plain])
        fraction = f"{cell} of {plain}'s" if "%" in cell else f"— ({plain}: {cell})"
    others = [c for c in fits if c != comm]
    against = "; ".join(f"{c} {estimate(d, sign='+')} ({len(d)})" for c in others
                        for d in [paired(by_comm[c], runs)[1]] if d) or "—"
    row = (f"{label} {comm} | {len(seeds)} | {estimate(gaps, sign='+')} | "
           f"{gap_cell(runs, bf16, len(seeds)) if bf16 else '—'} | {fraction} | "
           f"{wire_of(runs):.3f} | {speed} | {against} |")
    said = [words(comm, base, paired(runs, by_comm[base])[1], margin)
            for base in ("fp32", "bf16") if base in by_comm]
    said += [words(c, comm, paired(by_comm[c], runs)[1], margin) for c in others]
    notes = [f"{optimizer}, {name}: run {comm}. " + "; ".join(said) + "."]
    pairs = [(comm, base) for base in ("fp32", "bf16") if base in by_comm]
    flagged = [f"{a} − {b}" for a, b in pairs + [(c, comm) for c in others]
               for by in [per_machine(by_comm[a], by_comm[b])] if len(by) > 1
               and any(welch_differs(d, [x for n, ds in by.items() if n != m for x in ds])
                       for m, d in by.items())]
    if flagged:
        notes.append(f"{optimizer}, {name}: a machine's mean differs from the others' (Welch "
                     f"t, 5 %) in {', '.join(flagged)}: see the comparisons' by-machine column.")
    if budget is None:
        notes.append(f"{optimizer}, {name}: a mixed wire, {wire_of(runs):.3f}× bf16's bytes, "
                     "reported with no byte goal of its own.")
    elif wire_of(runs) > budget:
        notes.append(f"{optimizer}, {name}: {comm} sends {wire_of(runs):.3f}× bf16's bytes here, "
                     f"above the {budget:.2f}× the goal allows.")
    return row, notes


def rule_text(workers, margin):
    return ("Run this: among the methods measured with that wire format that are not controls "
            "(hadamard*, the forced *-all arms; >= 2 seeds paired with fp32), the cheapest "
            "(Euclidean, then error feedback or stochastic rounding, then the Hadamard rotation, "
            "then a geometry), replaced by a costlier one only where that one is lower at 95 % "
            "on the seeds the two share. A seed is a block: every arm of a seed ran on one "
            "machine; seeds of several machines are pooled. Equivalent: a TOST at "
            f"±{margin:g} in final val loss (about 0.12 % of it): the 90 % paired t interval "
            "inside the margin; otherwise \"no difference detected (± the 95 % half-width)\" "
            "where the 95 % interval includes 0. The other candidates' column: their paired "
            f"difference to the pick (95 % t, shared seeds). W = {workers} ranks; "
            "ms/step: the study's simulated step against Euclidean on the same collective (the "
            "whole step, on a shared CPU: a rough guide, not a GPU timing).")


def answer(results, workers=32, margin=MARGIN, picks=None, pick_notes=()):
    """The README's answer table (markdown) from a study's records at W = workers; a
    ValueError when the records hold no study run at that W. picks: {(optimizer, format):
    method} that override the rule's pick (answers(): one recommendation across W)."""
    groups = study_groups(results, workers)
    if not groups:
        raise ValueError(f"no study run at W = {workers} in these results: pass the W the "
                         "study ran at (--answer_workers)")
    lines = ["| optimizer | wire format | run this | seeds | gap to fp32 (paired, 95 % t) | "
             "gap to bf16 (paired, 95 % t) | recovers of Euclidean's gap (95 %) | wire vs bf16 "
             "| ms/step vs Euclidean | the other candidates against it (paired, 95 % t, seeds) |",
             "| --- " * 10 + "|"]
    notes = []
    for optimizer, by_comm in groups.items():
        for name, budget in BUDGETS:
            if budget is None and not candidates(by_comm, name):
                continue                # a mixed wire: a row only where one was measured
            row, row_notes = answer_row(optimizer, name, budget, by_comm, margin,
                                        (picks or {}).get((optimizer, name)))
            lines.append(row)
            notes += row_notes
    notes += list(pick_notes)
    labels = machine_labels(results)
    for optimizer, by_comm in groups.items():
        rows = [r for runs in by_comm.values() for r in runs.values()]
        machines = {r.get("machine") for r in rows}
        notes.append(f"{optimizer}: " + ("machine not recorded: pairs may mix machines."
                                         if None in machines else
                                         f"runs of one machine, {machines.pop()}."
                                         if len(machines) == 1 else
                                         f"seeds of {len(machines)} machines pooled, "
                                         f"{machines_text(rows, labels)}."))
    used = [r for runs in groups.values() for seed_runs in runs.values()
            for r in seed_runs.values()]
    unfinished = sorted({r["comm"] for r in used if not math.isfinite(r["final_val_loss"])})
    if unfinished:
        notes.append(f"Not finite in some run, so in no row: {', '.join(unfinished)}.")
    bullets = [wrap("- " + note) for note in notes]
    return "\n".join(lines + [""] + bullets + [""] + [wrap(rule_text(workers, margin))]) + "\n"


def one_pick_across_w(results, workers):
    """({(optimizer, format): the pooled pick} for the W's whose own pick differs but is not
    lower than the pooled pick at 95 % there, {W: [notes]}): one recommendation per format
    unless the data separate the W's."""
    overrides, notes = {w: {} for w in workers}, {w: [] for w in workers}
    for optimizer, pooled in pooled_over_w(results, workers).items():
        for name, _ in BUDGETS:
            together = recommend(pooled, name)
            if together is None:
                continue
            for w in workers:
                by_comm = study_groups(results, w).get(optimizer, {})
                alone = recommend(by_comm, name)
                if alone is None or alone[0] == together[0] or together[0] not in alone[1]:
                    continue
                if lower(by_comm, alone[0], together[0]):
                    notes[w].append(f"{optimizer}, {name}: the data separate the W's: at W = {w}"
                                    f" {alone[0]} is lower than {together[0]} (the pick on all "
                                    "W's seeds pooled) at 95 %.")
                    continue
                overrides[w][(optimizer, name)] = together[0]
                notes[w].append(f"{optimizer}, {name}: one recommendation across W = "
                                f"{', '.join(map(str, workers))}: {together[0]}, the rule on "
                                f"every W's seeds pooled; at W = {w} alone the rule picks "
                                f"{alone[0]}, not lower than {together[0]} at 95 % there.")
    return overrides, notes


# what a table recommends for one optimizer and wire format at one W: the method, the candidates
# it was chosen among, the rule's pick on that W's seeds alone, and whether the two differ (the
# recommendation is the pick on every W's seeds pooled)
Choice = namedtuple("Choice", "comm fits alone pooled")


def choices(results, workers=(32,)):
    """{W: {(optimizer, format): Choice}} for the formats with a candidate at that W: what
    answers() recommends, one method across the W's unless the data separate them."""
    overrides = (one_pick_across_w(results, workers)[0] if len(workers) > 1
                 else {w: {} for w in workers})
    out = {}
    for w in workers:
        for optimizer, by_comm in study_groups(results, w).items():
            for name, _ in BUDGETS:
                picked = recommend(by_comm, name)
                if picked is not None:
                    alone, fits = picked
                    comm = overrides[w].get((optimizer, name), alone)
                    out.setdefault(w, {})[(optimizer, name)] = Choice(comm, fits, alone,
                                                                      comm != alone)
    return out


def answers(results, workers=(32,), margin=MARGIN):
    """answer() at each W in `workers`, one table after another, each under a "W = ..." line
    when there are several, with one recommendation per wire format across them unless the data
    separate the W's: the README's block."""
    if len(workers) == 1:
        return answer(results, workers[0], margin)
    overrides, notes = one_pick_across_w(results, workers)
    return "\n".join(f"**W = {w} ranks**\n\n{answer(results, w, margin, overrides[w], notes[w])}"
                     for w in workers)
