"""
The answer: which method to run, per optimizer and wire format - the tables of
docs/study/README.md (and, in short, the README's: page.summary), written by
`python -m nanogeo.lab.study --answer RESULTS[,RESULTS...] --readme FILE`.

The rule (rule.py, printed under each table): per optimizer, W and wire format, every pair of
candidates is tested on the seeds the two share, each test Holm-adjusted in its family (the
plan's, docs/study/plan.md, else the setting's exploratory one); the pick is the cheapest
candidate that no other candidate is lower than at an adjusted p below 0.05. Each W is answered on
its own seeds. A mixed wire (NVFP4 all-to-all, FP8 all-gather: "4-bit + FP8") is a row of its
own, only where one was measured, with its bytes and no byte goal. The words: every other
candidate, and fp32 and bf16, against the pick, by compare.words() (stats.standing()).
"""

import math

from nanogeo.lab.study.arms import BUDGETS
from nanogeo.lab.study.compare import twin, words
from nanogeo.lab.study.report import (fraction_cell, gap_cell, machine_labels, machines_text,
                                        per_machine, study_groups)
from nanogeo.lab.study.rule import (MIN_SEEDS, Multiplicity, candidates, choices,  # noqa: F401
                                      recommend, wire_of)
from nanogeo.lab.study.stats import MARGIN, estimate, paired, welch_differs, wrap


def mean_ms(runs):
    return sum(r["ms_per_step"] for r in runs.values()) / len(runs)


def against_text(by_comm, comm, others):
    """The other candidates against the pick: 'fp8 +0.0018 ± 0.0014 (24)', ... or '—'."""
    return "; ".join(f"{c} {estimate(d, sign='+')} ({len(d)})" for c in others
                     for d in [paired(by_comm[c], by_comm[comm])[1]] if d) or "—"


def fraction_text(by_comm, comm, fp32):
    """The recovered fraction of the pick's Euclidean twin's gap, or why there is none."""
    plain = twin(comm, list(by_comm))
    if not plain or plain == comm:
        return "—"
    cell = fraction_cell(by_comm[comm], fp32, by_comm[plain])
    return f"{cell} of {plain}'s" if "%" in cell else f"— ({plain}: {cell})"


def flagged_note(optimizer, name, by_comm, comm, others):
    """A note where a machine's mean differs from the others' in a comparison of the row."""
    pairs = [(comm, base) for base in ("fp32", "bf16") if base in by_comm]
    flagged = [f"{a} − {b}" for a, b in pairs + [(c, comm) for c in others]
               for by in [per_machine(by_comm[a], by_comm[b])] if len(by) > 1
               and any(welch_differs(d, [x for n, ds in by.items() if n != m for x in ds])
                       for m, d in by.items())]
    if not flagged:
        return []
    return [f"{optimizer}, {name}: a machine's mean differs from the others' (Welch t, 5 %) in "
            f"{', '.join(flagged)}: see the comparisons' by-machine column."]


def seeds_cell(n):
    return f"{n}" if n >= MIN_SEEDS else f"{n} (provisional)"


def answer_row(optimizer, name, budget, by_comm, choice, margin=MARGIN):
    """One row of the answer table (a wire format's recommendation: the rule's Choice, or None)
    and its notes."""
    label = f"| {optimizer} | {name} |"
    if choice is None:
        return label + " nothing measured yet (>= 2 finite seeds paired with fp32) |" + \
            " |" * 7, []
    comm = choice.comm
    fp32, bf16, runs = by_comm.get("fp32", {}), by_comm.get("bf16", {}), by_comm[comm]
    seeds, gaps = paired(runs, fp32)
    plain = twin(comm, list(by_comm))
    speed = f"{mean_ms(runs) / mean_ms(by_comm[plain]):.2f}×" if plain else "1.00×"
    others = [c for c in choice.fits if c != comm]
    row = (f"{label} {comm} | {seeds_cell(len(seeds))} | {estimate(gaps, sign='+')} | "
           f"{gap_cell(runs, bf16, len(seeds)) if bf16 else '—'} | "
           f"{fraction_text(by_comm, comm, fp32)} | {wire_of(runs):.3f} | {speed} | "
           f"{against_text(by_comm, comm, others)} |")
    said = [words(comm, base, paired(runs, by_comm[base])[1], margin)
            for base in ("fp32", "bf16") if base in by_comm]
    said += [words(c, comm, paired(by_comm[c], runs)[1], margin) for c in others]
    notes = [f"{optimizer}, {name}: run {comm}. " + "; ".join(said) + "."]
    notes += flagged_note(optimizer, name, by_comm, comm, others)
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
            "then a geometry; then fewer bytes) that no other candidate is lower than at 95 % "
            "after Holm's adjustment in its family (the plan's, else the setting's exploratory "
            "one; every pair of candidates tested on the seeds the two share). Each W on its own "
            f"seeds; fewer than {MIN_SEEDS} seeds: provisional. A seed is a block: every arm of "
            "a seed ran on one machine; seeds of several machines are pooled. Equivalent: a "
            f"TOST at ±{margin:g} in final val loss (about 0.12 % of it): the 90 % paired t "
            "interval inside the margin; \"likely higher / lower\": only the 90 % interval "
            "excludes 0; \"no difference detected (± the 95 % half-width)\": the 90 % interval "
            "holds 0. The other candidates' column: their paired difference to the pick (95 % "
            f"t, shared seeds). W = {workers} ranks; ms/step: the study's simulated step against "
            "Euclidean on the same collective (the whole step, on a shared CPU: a rough guide, "
            "not a GPU timing).")


def machine_notes(groups, labels):
    notes = []
    for optimizer, by_comm in groups.items():
        rows = [r for runs in by_comm.values() for r in runs.values()]
        machines = {r.get("machine") for r in rows}
        notes.append(f"{optimizer}: " + ("machine not recorded: pairs may mix machines."
                                         if None in machines else
                                         f"runs of one machine, {machines.pop()}."
                                         if len(machines) == 1 else
                                         f"seeds of {len(machines)} machines pooled, "
                                         f"{machines_text(rows, labels)}."))
    return notes


def answer(results, workers=32, margin=MARGIN, tests=None):
    """The README's answer table (markdown) from a study's records at W = workers; a
    ValueError when the records hold no study run at that W. tests: a rule.Multiplicity of the
    results (made here when not given)."""
    groups = study_groups(results, workers)
    if not groups:
        raise ValueError(f"no study run at W = {workers} in these results: pass the W the "
                         "study ran at (--answer_workers)")
    picks = choices(results, (workers,), tests or Multiplicity(results, (workers,)))[workers]
    lines = ["| optimizer | wire format | run this | seeds | gap to fp32 (paired, 95 % t) | "
             "gap to bf16 (paired, 95 % t) | recovers of Euclidean's gap (95 %) | wire vs bf16 "
             "| ms/step vs Euclidean | the other candidates against it (paired, 95 % t, seeds) |",
             "| --- " * 10 + "|"]
    notes = []
    for optimizer, by_comm in groups.items():
        for name, budget in BUDGETS:
            if budget is None and not candidates(by_comm, name):
                continue                # a mixed wire: a row only where one was measured
            row, row_notes = answer_row(optimizer, name, budget, by_comm,
                                        picks.get((optimizer, name)), margin)
            lines.append(row)
            notes += row_notes
    notes += machine_notes(groups, machine_labels(results))
    used = [r for runs in groups.values() for seed_runs in runs.values()
            for r in seed_runs.values()]
    unfinished = sorted({r["comm"] for r in used if not math.isfinite(r["final_val_loss"])})
    if unfinished:
        notes.append(f"Not finite in some run, so in no row: {', '.join(unfinished)}.")
    bullets = [wrap("- " + note) for note in notes]
    return "\n".join(lines + [""] + bullets + [""] + [wrap(rule_text(workers, margin))]) + "\n"


def answers(results, workers=(32,), margin=MARGIN):
    """answer() at each W in `workers`, one table after another, each under a "W = ..." line
    when there are several: the README's block."""
    if len(workers) == 1:
        return answer(results, workers[0], margin)
    tests = Multiplicity(results, workers)
    return "\n".join(f"**W = {w} ranks**\n\n{answer(results, w, margin, tests)}"
                     for w in workers)
