"""
What the study's data show, in words written from the numbers (the findings block of
docs/study/README.md; page.py writes it): nothing here is typed by hand but the sentences'
frame.

  * per optimizer and W, per wire format: the Euclidean arm against fp32 and bf16; every other
    candidate against its Euclidean twin (with the paired t test's p), and where it is lower at
    95 % the fraction of the twin's gap to fp32 it recovers - a ratio of two paired means with
    Fieller's interval, said in words ("about the size of that gap, the fraction uncertain" when
    the interval holds 100 % and is wider than the gap itself), and whether the equivalence
    margin can tell full recovery from none;
  * multiple tests: Holm over each family fixed before the runs (docs/study/plan.md);
  * power: the seeds a paired t test needs to detect the planned group's Euclidean FP8 gap at
    the paired sd each comparison showed.
"""

from nanogeo.lab.study.arms import BUDGETS, cost, wire_format
from nanogeo.lab.study.compare import EXTRA_PAIRS, twin, words
from nanogeo.lab.study.report import OPTIMIZER_NAMES, settings, study_groups
from nanogeo.lab.study.rule import ALPHA, Multiplicity, candidates, wire_of
from nanogeo.lab.study.stats import (MARGIN, edge, estimate, fieller, interval90, mean_ci,
                                       mean_sd, p_value, paired, seeds_for_power, standing, tost,
                                       wrap)

# the setting of the one family fixed before its runs (docs/study/plan.md, rows N1a and N1b: each
# FP8 geometry against Euclidean FP8 under Muon at W = 32), whose Euclidean gap the power reads
PLANNED = ("muon", 32, "FP8")


def name(optimizer):
    return OPTIMIZER_NAMES.get(optimizer, optimizer)


def p_text(diffs, adjusted=""):
    """'p = 0.013' (the paired t test's, unadjusted), with the Holm-adjusted p of its family
    beside it where it has one: 'p = 0.013 (adjusted: p = 0.025, Holm in "...")'."""
    p = p_value(diffs)
    raw = "p < 0.001" if p < 0.001 else f"p = {p:.3f}"
    return f"{raw} (adjusted: {adjusted})" if adjusted else raw


def state(diffs, margin):
    """Where a method stands against a baseline, as a phrase around "{}" (the baseline):
    "within M of {}" (TOST, "at the edge" where it is), "above {}" / "below {} at 95 %" (the
    95 % interval excludes 0), "likely above {} (90 %: lo to hi)" (only the 90 % interval
    excludes 0) or "no difference detected from {}" (the 90 % interval holds 0)."""
    said = standing(diffs, margin)
    if said == "equivalent":
        return f"within {margin:g} of {{}}" + (" (at the edge)" if edge(diffs, margin) else "")
    where = "above" if said.endswith("higher") else "below"
    if said.startswith("likely"):
        return f"likely {where} {{}} (90 %: {interval90(diffs)})"
    return "no difference detected from {}" if said.startswith("no") else where + " {} at 95 %"


def against_baselines(by_comm, comm, margin=MARGIN):
    """'above fp32 and bf16 at 95 %', 'within 0.002 of fp32; no difference detected from
    bf16', ...: the method against each baseline the group ran, in a few words."""
    said = [(state(diffs, margin), b) for b in ("fp32", "bf16") if b in by_comm
            for diffs in [paired(by_comm[comm], by_comm[b])[1]] if len(diffs) > 1]
    if not said:
        return "no baseline measured"
    if len({s for s, _ in said}) == 1:
        return said[0][0].format(" and ".join(b for _, b in said))
    return "; ".join(s.format(b) for s, b in said)


def percent(x):
    return f"{100 * x:.0f} %"


def recovered_words(by_comm, comm, plain, margin):
    """The fraction of `plain`'s gap to fp32 that `comm` recovers, on the seeds all three share:
    mean(plain - comm) / mean(plain - fp32) with Fieller's 95 % interval, in words."""
    fp32 = by_comm["fp32"]
    blocks = [b for b in sorted(by_comm[comm]) if b in by_comm[plain] and b in fp32]
    if len(blocks) < 2:
        return ""
    loss = lambda c, b: by_comm[c][b]["final_val_loss"]
    gain = [loss(plain, b) - loss(comm, b) for b in blocks]
    gap = [loss(plain, b) - fp32[b]["final_val_loss"] for b in blocks]
    ratio, low, high = fieller(gain, gap)
    if low is None:
        return (f"The fraction of `{plain}`'s gap to fp32 it recovers has no bounded 95 % "
                "interval (Fieller): that gap is not established on these seeds.")
    text = (f"It recovers {percent(ratio)} of `{plain}`'s gap to fp32 ({len(blocks)} seeds; "
            f"95 % Fieller interval {percent(low)} to {percent(high)}"
            + ("; the mean gain over the mean gap: the tables' per-seed fraction is undefined, "
               "some seed's own gap being <= 0" if min(gap) <= 0 else "") + ")")
    if low <= 1 <= high:
        text += (": about the size of that gap, the fraction uncertain" if high - low > 1
                 else ": about that gap")
    else:
        text += ": part of that gap" if high < 1 else ": more than that gap"
    gap_mean = mean_sd(gap)[0]
    if 0 < gap_mean < margin:
        text += (f". An equivalence test at ±{margin:g} cannot tell full recovery from none: "
                 f"the margin is wider than `{plain}`'s whole gap ({gap_mean:+.4f})")
    return text + "."


def method_findings(by_comm, comm, fits, margin, held=lambda a, b: ""):
    """One bullet: a method against its Euclidean twin (if it has one among the candidates:
    the paired difference, p and, where it is lower at 95 %, the fraction of the twin's gap it
    recovers), then against fp32 and bf16. held(a, b): the Holm-adjusted p of a - b in words."""
    said = [f"- `{comm}` ({wire_format(comm)}, {wire_text(by_comm[comm])}):"]
    base = twin(comm, list(by_comm))
    diffs = paired(by_comm[comm], by_comm[base])[1] if base in fits and base != comm else []
    if len(diffs) > 1:
        mean, half = mean_ci(diffs)
        said.append(f"{words(comm, base, diffs, margin).partition(': ')[2]}, "
                    f"{p_text(diffs, held(comm, base))}.")
        if mean + half < 0:
            said.append(recovered_words(by_comm, comm, base, margin))
    for a, b in EXTRA_PAIRS:            # the comparisons beside the twins': compare.EXTRA_PAIRS
        extra = paired(by_comm[a], by_comm[b])[1] if a == comm and b in by_comm else []
        if len(extra) > 1:
            sentence = words(a, b, extra, margin).partition(": ")[2]
            if len(said) > 1:           # a sentence of its own (else it follows the colon)
                sentence = sentence[0].upper() + sentence[1:]
            said.append(f"{sentence}, {p_text(extra, held(a, b))}.")
    against = [words(comm, b, d, margin).partition(": ")[2] for b in ("fp32", "bf16")
               if b in by_comm for d in [paired(by_comm[comm], by_comm[b])[1]] if len(d) > 1]
    if against:
        said.append(("Against the baselines: " if len(said) > 1 else "") + "; ".join(against)
                    + ".")
    return " ".join(s for s in said if s)


def wire_text(runs):
    wire = wire_of(runs)
    return "bytes not recorded" if wire is None else f"{wire:.3f}× bf16's bytes"


def group_findings(optimizer, w, by_comm, margin, tests):
    """Bullets for one optimizer and W: bf16 against fp32, then each wire format's candidates
    (a format with none says so; a mixed wire only where one ran)."""
    out = [f"**{name(optimizer)}, W = {w}.**", ""]
    if "bf16" in by_comm and "fp32" in by_comm:
        diffs = paired(by_comm["bf16"], by_comm["fp32"])[1]
        out.append(wrap(f"- bf16: {words('bf16', 'fp32', diffs, margin).partition(': ')[2]}."))
    for fmt, _ in BUDGETS:
        fits = candidates(by_comm, fmt)
        if not fits and fmt != "4-bit + FP8":
            out.append(wrap(f"- {fmt}: not measured in these results (no method with >= 2 "
                            "seeds paired with fp32)."))
        held = lambda a, b: tests.p_text(optimizer, w, a, b)
        out += [wrap(method_findings(by_comm, c, fits, margin, held)) for c in fits]
    return out


def holm_findings(results, workers):
    """Per family fixed before the runs (plan.md rows not marked retrospective): its tests and
    the smallest Holm-adjusted p, significant or not - the one family of these studies whose
    tests were chosen before the data were seen."""
    tests = Multiplicity(results, workers)
    families = {}
    for k, t in tests.tests.items():
        if t.row is not None and not t.row.retrospective and k in tests.final:
            families.setdefault(t.family, []).append(k)
    out = []
    for family, keys in families.items():
        best = min(keys, key=lambda k: tests.final[k][1])
        t, q = tests.tests[best], tests.final[best][1]
        listed = ", ".join(f"`{tests.tests[k].a}` − `{tests.tests[k].b}`" for k in keys)
        out.append(f"Holm over the family \"{family}\", fixed before the runs ({listed}): the "
                   f"smallest adjusted p is {q:.3f} (`{t.a}` − `{t.b}`, {name(t.optimizer)}, "
                   f"W = {t.workers}), " + ("significant at 5 %." if q < ALPHA else
                                            "not significant at 5 % in this family."))
    if not out:
        return []
    return ["**Multiple tests.** " + " ".join(out) + " Every family, planned, retrospective or "
            "exploratory, with its adjusted p's at both endpoints: [Families](#families)."]


def power_findings(results, workers):
    """The seeds 80 % power needs to detect the planned group's Euclidean FP8 gap to fp32, at
    the paired sd of each FP8 geometry test and each Euclidean FP8 gap at the first W."""
    groups = study_groups(results, PLANNED[1])
    planned = groups.get(PLANNED[0], {})
    plain = next((c for c in candidates(planned, "FP8") if cost(c) == 0), None)
    if plain is None or "fp32" not in planned:
        return []
    # the gap as the tables print it (4 decimals), so that the seeds below are for that number
    effect = round(mean_sd(paired(planned[plain], planned["fp32"])[1])[0], 4)
    if not effect > 0:
        return []
    said = []
    for optimizer, _, by_comm in settings(results, [PLANNED[1]]):
        tests = [(c, twin(c, list(by_comm))) for c in candidates(by_comm, "FP8") if cost(c) == 3]
        tests = [t for t in tests if t[1]] + ([(plain, "fp32")] if plain in by_comm else [])
        for a, b in tests:
            diffs = paired(by_comm[a], by_comm[b])[1]
            if len(diffs) > 2:
                sd = mean_sd(diffs)[1]
                said.append(f"`{a}` − `{b}` under {name(optimizer)}: sd {sd:.4f}, "
                            f"{seeds_for_power(sd, effect)} seeds ({len(diffs)} ran)")
    return [f"**Power.** To detect {effect:.4f} (`{plain}`'s gap to fp32 under "
            f"{name(PLANNED[0])} at W = {PLANNED[1]}) with 80 % power, a paired t test at 5 % "
            "(two-sided) needs, at the paired sd each comparison showed at that W: "
            + "; ".join(said) + "."] if said else []


# the frontier the studies aim at: a wire of at most this many bf16 bytes (at GOAL_WORKERS
# ranks: the same wire sends a little more at larger W, its scales a larger share - the mixed
# 4-bit + FP8 wire 0.411x at W = 32, 0.422x at 64) with bf16's quality
GOAL_BYTES, GOAL_WORKERS = 0.42, 32
GOAL_SHOWN = 3          # the methods named with their gaps, the closest first


def goal_methods(results, optimizer):
    """The methods whose wire is at most GOAL_BYTES x bf16's at GOAL_WORKERS ranks under
    `optimizer`: the goal's candidates at every W."""
    return {c for o, _, by_comm in settings(results, (GOAL_WORKERS,)) if o == optimizer
            for c, runs in by_comm.items() if (wire_of(runs) or 1) <= GOAL_BYTES}


def goal_rows(results, workers, margin=MARGIN):
    """[(optimizer, W, by_comm, rows)], rows: [(method, its paired gaps to bf16, tost())] of every
    goal candidate (goal_methods) with >= 2 seeds paired with bf16, the closest first (the
    smallest upper 90 % bound)."""
    out = []
    for optimizer, w, by_comm in settings(results, workers):
        goal = goal_methods(results, optimizer)
        fits = [c for fmt, _ in BUDGETS for c in candidates(by_comm, fmt)
                if c in goal and "bf16" in by_comm]
        rows = [(c, paired(by_comm[c], by_comm["bf16"])[1]) for c in fits]
        rows = sorted([(c, d, tost(d, margin)) for c, d in rows if len(d) > 1],
                      key=lambda r: r[2][1])
        if rows:
            out.append((optimizer, w, by_comm, rows))
    return out


def goal_verdict(rows, margin, short=False):
    """"reached by `m`", or how far the closest candidate's upper 90 % bound ends past the margin
    (short: the README's wording)."""
    reached = [f"`{c}`" for c, _, t in rows if t[2]]
    if reached:
        return f"reached by {', '.join(reached)}"
    closest, _, t = rows[0]
    past = f"{t[1] - margin:+.4f}"
    if short:
        return f"not reached (closest `{closest}`: 90 % bound {past} past)"
    return (f"not reached: the closest, `{closest}`, ends {past} past the margin at its upper "
            "90 % bound")


def goal_findings(results, workers, margin=MARGIN):
    """Does any non-control method of <= GOAL_BYTES x bf16's bytes train as bf16 does (a TOST
    within +-margin), per optimizer and W? The closest methods' gaps to bf16 with the 90 %
    intervals the TOST reads; where none is equivalent, how far the closest ends past it."""
    out = []
    for optimizer, w, by_comm, rows in goal_rows(results, workers, margin):
        said = [f"`{c}` ({wire_of(by_comm[c]):.3f}×) {estimate(d, sign='+')}, "
                f"90 % {t[0]:+.4f} to {t[1]:+.4f}, {len(d)} seeds" for c, d, t in rows[:GOAL_SHOWN]]
        out.append(f"{name(optimizer)}, W = {w}: {goal_verdict(rows, margin)} (gaps to bf16"
                   + (f", the {GOAL_SHOWN} closest of {len(rows)}" if len(rows) > GOAL_SHOWN else "")
                   + ": " + "; ".join(said) + ").")
    return [f"**bf16's quality at <= {GOAL_BYTES:g}× its bytes** (a wire of at most that at W = "
            f"{GOAL_WORKERS}, within ±{margin:g} of bf16 by a TOST). " + " ".join(out)] if out else []


def goal_note(results, workers, margin=MARGIN):
    """The README's line on the goal: per optimizer and W, reached or how far the closest is."""
    said = [f"{name(optimizer)}, W = {w}: {goal_verdict(rows, margin, short=True)}"
            for optimizer, w, _, rows in goal_rows(results, workers, margin)]
    return (f"- bf16's quality at <= {GOAL_BYTES:g}× its bytes (TOST at {margin:g}): "
            + "; ".join(said) + ".") if said else ""


def findings(results, workers=(32,), margin=MARGIN):
    """The findings block: markdown paragraphs in lines of at most 100 characters."""
    tests = Multiplicity(results, workers)
    paragraphs = ["\n".join(group_findings(optimizer, w, by_comm, margin, tests))
                  for optimizer, w, by_comm in settings(results, workers)]
    for part in (goal_findings(results, workers, margin), holm_findings(results, workers),
                 power_findings(results, workers)):
        paragraphs += [wrap(p) for p in part]
    return "\n\n".join(paragraphs) + "\n"
