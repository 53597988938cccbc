"""
Pairwise comparisons of a study's arms, in the study's words, and the table the README quotes
(--comparisons): per optimizer, W and wire format, each geometry-aware arm against its Euclidean
twin (and stage-2 error feedback against the rotation), and each arm against bf16 and fp32 -
on the seeds both share, with the paired mean +- 95 % t, the 90 % interval the TOST reads, the
verdict at the margin, and each machine's mean.
"""

from nanogeo.lab.study.arms import COMMS, collective, cost, is_control, wire_format
from nanogeo.lab.study.report import machine_cell, machine_labels, study_groups
from nanogeo.lab.study.rule import Multiplicity
from nanogeo.lab.study.stats import (MARGIN, EDGE, benjamini_hochberg, edge_text, estimate,
                                       interval90, mean_ci, p_value, paired, standing, tost,
                                       verdict, wrap)
from nanogeo.lab.study import plan

# comparisons beside each arm's against its Euclidean twin: the two levers of each 4-bit wire
# head to head, an e4m3 stage 2 against NVFP4's (another wire, so not its twin), and bf16's own
# gap to fp32 (the yardstick every FP8 and 4-bit gap is read against)
EXTRA_PAIRS = (("subspace-nvfp4", "nvfp4-ef2"), ("subspace-nvfp4-e4m3s2", "nvfp4-e4m3s2-ef1"),
               ("nvfp4-e4m3s2", "nvfp4"), ("bf16", "fp32"))
BASELINES = ("fp32", "bf16")


def words(a, b, diffs, margin=MARGIN):
    """One sentence on the paired differences a - b (stats.standing()): "a: equivalent to b
    within +-margin (TOST; ...)" ("TOST at the edge, 90 % bound ..." where it passes at the
    edge), "a: lower / higher than b at 95 % (...)", "a: likely lower / higher than b (90 %
    interval ...; ...)" or "a: no difference detected from b (+- 95 % half-width; ...)", each
    with the mean and the seeds."""
    if len(diffs) < 2:
        return f"{a}: {len(diffs)} seed{'' if len(diffs) == 1 else 's'} shared with {b}, no test"
    mean, half = mean_ci(diffs)
    facts = f"{a} − {b} = {estimate(diffs, sign='+')}, {len(diffs)} seeds"
    side = "lower than" if mean < 0 else "higher than"
    said = standing(diffs, margin)
    if said == "equivalent":
        also = f", and {side} it at 95 %" if abs(mean) > half else ""
        return (f"{a}: equivalent to {b} within ±{margin:g} "
                f"(TOST{edge_text(diffs, margin)}; {facts}){also}")
    if said.startswith("likely"):
        return f"{a}: likely {side} {b} (90 % interval {interval90(diffs)}; {facts})"
    if said != "no difference detected":
        return f"{a}: {side} {b} at 95 % ({facts})"
    return f"{a}: no difference detected from {b} (± {half:.4f}; {facts})"


def twin(comm, present):
    """The Euclidean arm on the same collective (same format, block and collective flags) that
    `comm` is compared with: the plain one (cost 0), if present; None for fp32 and bf16."""
    if comm in BASELINES:
        return None
    for other in present:
        if (other != comm and other not in BASELINES and cost(other) == 0
                and collective(other) == collective(comm)):
            return other
    return None


def pairs(present):
    """The comparisons of a group with these arms, in order: each arm against its Euclidean twin,
    the extra pairs, then every arm that is not a control against bf16 and fp32."""
    present = [c for c in COMMS if c in present]            # COMMS's order
    out = [(c, twin(c, present)) for c in present if twin(c, present)]
    out += [(a, b) for a, b in EXTRA_PAIRS if a in present and b in present]
    out += [(c, base) for c in present if c not in BASELINES and not is_control(c)
            for base in BASELINES if base in present]
    return out


def holm_cell(tests, optimizer, w, a, b):
    """'0.025 (FP8 geometry, Muon W = 32)': the Holm-adjusted p of a - b in its family (a TOST's
    for an equivalence test), or '—' for a comparison in no family."""
    k = tests.find(optimizer, w, a, b)
    if k is None or k not in tests.final:
        return "—"
    tost_mark = " TOST" if k[3] == "equivalent" else ""
    return f"{tests.final[k][1]:.3f}{tost_mark} ({tests.tests[k].family})"


def comparison_rows(results, workers, margin, tests):
    """[(cells before the q, p, cells after it)] of every comparison, in the table's order."""
    labels = machine_labels([r for r in results if not r.get("sweep")])
    rows = []
    for w in workers:
        for optimizer, by in study_groups(results, w).items():
            recorded = all(b[0] for runs in by.values() for b in runs)
            where = "" if recorded else " (machine not recorded)"
            for a, b in pairs(by):
                blocks, diffs = paired(by[a], by[b])
                if not blocks:
                    continue
                interval = tost(diffs, margin)
                head = (f"| {optimizer}{where} | {w} | {wire_format(a) or 'none'} | {a} − {b} | "
                        f"{len(blocks)} | {estimate(diffs, sign='+')} | "
                        + (f"{interval[0]:+.4f} to {interval[1]:+.4f}" if interval else "—")
                        + f" | {p_value(diffs):.3f} | {holm_cell(tests, optimizer, w, a, b)} | ")
                tail = (f" | {plan.label(tests.plan_row(optimizer, w, a, b), len(blocks))} | "
                        f"{verdict(diffs, margin)} | {machine_cell(by[a], by[b], labels)} |")
                rows.append((head, p_value(diffs), tail))
    return rows


def comparisons(results, workers=(32,), margin=MARGIN, tests=None):
    """The markdown table of every comparison (pairs()) at each W, of the groups the answer
    reads (study_groups: per optimizer the largest group of recorded machines): the paired
    t interval and p, the Holm-adjusted p in the comparison's family, the Benjamini-Hochberg q
    over every row, the plan's label (plan.label) and the verdict."""
    tests = tests or Multiplicity(results, workers)
    labels = machine_labels([r for r in results if not r.get("sweep")])
    rows = comparison_rows(results, workers, margin, tests)
    q = benjamini_hochberg([p for _, p, _ in rows])
    lines = ["| optimizer | W | wire format | comparison | shared seeds | paired mean (95 % t) | "
             "90 % interval | p (paired t) | Holm p (family) | BH q (all rows) | plan | "
             f"verdict (margin ±{margin:g}) | by machine (seeds) |", "| --- " * 13 + "|"]
    lines += [f"{head}{qk:.3f}{tail}" for (head, _, tail), qk in zip(rows, q)]
    legend = [wrap("Machines: " + "; ".join(f"{k} = {m}" for m, k in labels.items()) + ".")
              if labels else "",
              wrap("A − B: per seed (a seed on one machine, every arm of it run there) A's final "
                   "val loss minus B's, on the seeds both have, pooled over machines; 95 % "
                   f"paired Student t. Equivalent within ±{margin:g} (TOST): the 90 % paired t "
                   "interval lies inside the margin (two one-sided t tests at 5 %; \"at the "
                   f"edge\": its outer bound within {EDGE * 100:.0f} % of the margin); lower / "
                   "higher at 95 %: the 95 % interval excludes 0; likely lower / higher: only the "
                   "90 % interval excludes 0; else no difference detected (± the 95 % "
                   "half-width). p: the paired t test's two-sided p, unadjusted. Holm p: adjusted "
                   "within the comparison's family (docs/study/plan.md's, or the exploratory "
                   "family of the rule's comparisons in that setting; \"TOST\": the p of a "
                   "planned equivalence test), \"—\" in no family; a verdict stands at 5 % only "
                   "on it. BH q: Benjamini-Hochberg over every row of this table (the expected "
                   "share of false discoveries among rows with q < 0.05 is at most 5 %). Plan: the "
                   "plan row naming the comparison, written before the runs (planned) or after "
                   "them (retrospective), else exploratory. By machine: each machine's mean and "
                   "seeds; \"differs\": a Welch t test (5 %) of its differences against the "
                   "other machines' rejects equal means (expect one false flag in twenty).")]
    return "\n".join(lines + ["\n" + x for x in legend if x]) + "\n"
