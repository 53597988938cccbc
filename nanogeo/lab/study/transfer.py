"""
Does the answer hold on a wider model? The char-wide replication (docs/study/plan.md, family
"char-wide") beside char-study's records, from the records alone:

    python -m nanogeo.lab.study --answer STUDY_RESULTS --transfer docs/study/wide/results.json \
        --readme README.md --readme docs/study/README.md

writes the block `transfer` (docs/study/README.md: each hypothesis on both models, and one line
per pick of the what-to-run table) and `transfer line` (README.md: one line) wherever a file has
its markers.

Words. A hypothesis's outcome is "shown", "reversed" (the other direction) or "equivalent within
±margin" only with a Holm-adjusted p below ALPHA in a family the plan fixed; with fewer seeds
than the plan fixes it is marked "(interim)". char-study's estimate is the same paired
difference at the same optimizer and W: the p its own plan gives that test where it has one,
else an unadjusted p (or an exploratory family's), in words that say "exploratory". Where
char-study's main group lacks an arm, the records of another group are read (the first study's:
machines unrecorded, never pooled with the study's), said so. The tail mean is the secondary
endpoint, adjusted in the same family.
"""

from collections import namedtuple

from nanogeo.lab.study import plan, report
from nanogeo.lab.study.arms import BUDGETS
from nanogeo.lab.study.findings import name
from nanogeo.lab.study.page import marker, write_block
from nanogeo.lab.study.report import arms_of, settings
from nanogeo.lab.study.rule import ALPHA, Multiplicity, recommend, test_key
from nanogeo.lab.study.stats import estimate, mean_ci, p_value, paired, tost_p, wrap

WIDE = "char-wide"
BLOCKS = ("transfer", "transfer line")

# one model's cell of one hypothesis: "mean ± 95 % t half-width (n seeds)", the p in words, the
# outcome in words, the number of seeds
Cell = namedtuple("Cell", "estimate p words seeds")
NOT_RUN = Cell("not run", "", "not run", 0)


def hypotheses(rows):
    """The plan's rows for char-wide, in the plan's order."""
    return [r for r in rows if r.preset == WIDE]


def group(results, optimizer, workers):
    """{comm: {block: record}} of the study's runs of this optimizer at W, or {}."""
    return next((by for o, w, by in settings(results, (workers,)) if o == optimizer), {})


def any_group(results, optimizer, workers, a, b):
    """(by_comm, whether it is the study's main group) of the group holding the most seeds of
    both a and b: the main group (settings) when it has them, else another (ties: the first in
    report.group_order); (None, False) when no group has both."""
    main = group(results, optimizer, workers)
    if a in main and b in main:
        return main, True
    rows = [r for r in results if not r.get("sweep") and r["optimizer"] == optimizer
            and r["workers"] == workers]
    keys = sorted({report.group(r) for r in rows}, key=report.group_order)
    groups = [arms_of([r for r in rows if report.group(r) == k]) for k in keys]
    held = [by for by in groups if a in by and b in by]
    if not held:
        return None, False
    return max(held, key=lambda by: len(paired(by[a], by[b])[1])), False


def p_text(p):
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def planned_p(tests, row, endpoint):
    """(Holm-adjusted p, family) of row's own test in these results' families, or None."""
    k = test_key(row.optimizer, row.workers, row.a, row.b,
                 "equivalent" if row.test == "equivalent" else "difference")
    found = (tests.final if endpoint == "final" else tests.tail).get(k)
    return None if found is None else (found[1], tests.tests[k].family)


def outcome(row, diffs, p, planned):
    """The outcome in words: from a p that a family the plan fixed adjusts (planned), "shown",
    "reversed", "equivalent within ±margin" or "not shown"; from any other p, "exploratory:"
    and what the interval shows (above or below 0, equivalent, no difference detected)."""
    if row.test == "report":
        return "reported (no test)"
    tag = "" if planned else "exploratory: "
    if row.test == "equivalent":
        return f"{tag}equivalent within ±{row.margin:g}" if p < ALPHA else f"{tag}not shown"
    if not p < ALPHA:
        return "not shown" if planned else "exploratory: no difference detected"
    above = mean_ci(diffs)[0] > 0
    if planned:
        return "shown" if above == (row.test == "greater") else "reversed"
    return f"exploratory: {'above' if above else 'below'} 0"


def side(results, tests, row, endpoint="final", interim=False):
    """One model's Cell of one hypothesis (interim: mark an outcome on fewer seeds than the
    plan fixes)."""
    by_comm, main = any_group(results, row.optimizer, row.workers, row.a, row.b)
    if by_comm is None:
        return NOT_RUN
    diffs = paired(by_comm[row.a], by_comm[row.b], endpoint)[1]
    if len(diffs) < 2:
        return Cell("—", "", "not run", len(diffs))
    found = planned_p(tests, row, endpoint) if main else None
    if found:
        p, text = found[0], f'Holm {p_text(found[0])} ("{found[1]}")'
        planned = not found[1].startswith("exploratory")
    else:
        p = tost_p(diffs, row.margin) if row.test == "equivalent" else p_value(diffs)
        where = "no such test in its plan" if main else \
            "records of another group, never pooled with the study's"
        text = "—" if row.test == "report" else f"{p_text(p)}, unadjusted ({where})"
        planned = False
    words = outcome(row, diffs, p, planned)
    if interim and len(diffs) < row.seeds and row.test != "report":
        words += " (interim)"
    return Cell(f"{estimate(diffs, sign='+')} ({len(diffs)} seeds)", text, words, len(diffs))


def test_words(row):
    if row.test == "equivalent":
        return f"TOST ±{row.margin:g}"
    return "report" if row.test == "report" else f"{row.test} than 0"


def hypothesis_table(study, wide, rows):
    """The markdown table: each hypothesis on char-study and on char-wide (final endpoint), and
    char-wide's tail mean (rows: the whole plan)."""
    study_tests, wide_tests = Multiplicity(study, (32, 64), rows), Multiplicity(wide, (32,), rows)
    lines = ["Each estimate: the mean paired difference in val loss ± its 95 % t half-width.\n",
             "| hypothesis | test | char-study: estimate | p | outcome | char-wide: estimate | "
             "p | outcome | char-wide, tail mean (secondary): estimate | p | outcome |",
             "| --- " * 11 + "|"]
    for row in hypotheses(rows):
        cells = (side(study, study_tests, row), side(wide, wide_tests, row, interim=True),
                 side(wide, wide_tests, row, "tail", interim=True))
        look = cells[1].seeds
        label = f" — {plan.label(row, look)}" if 0 < look != row.seeds else ""
        lines.append(f"| {row.id}: {row.a} − {row.b} ({name(row.optimizer)}, W = {row.workers})"
                     f"{label} | {test_words(row)} | "
                     + " | ".join(f"{c.estimate} | {c.p} | {c.words}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def margin_line(study, wide, rows):
    """The margin as a fraction of fp32's loss on each model (the plan's second statement)."""
    margins = [r for r in hypotheses(rows) if r.margin]
    if not margins:
        return ""
    row, parts = margins[0], []
    for label, results in (("char-study", study), (WIDE, wide)):
        fp32 = group(results, row.optimizer, row.workers).get("fp32", {})
        losses = [r["final_val_loss"] for r in fp32.values()]
        if losses:
            mean = sum(losses) / len(losses)
            parts.append(f"{label} {100 * row.margin / mean:.2f} % of fp32's {mean:.4f}")
    return (f"The margin {row.margin:g} as a fraction of fp32's final val loss "
            f"({name(row.optimizer)}, W = {row.workers}): " + "; ".join(parts) + ".\n")


def pick_verdict(study, wide, tests, optimizer, workers, fmt):
    """(char-study's pick, the words for char-wide) for one row of the what-to-run table;
    tests: (char-study's, char-wide's) Multiplicity."""
    study_tests, wide_tests = tests
    mine = recommend(group(study, optimizer, workers), fmt, study_tests, optimizer, workers)
    if mine is None:
        return None, ""
    by_comm = group(wide, optimizer, workers)
    if mine.comm not in by_comm:
        return mine.comm, "not shown (not run on char-wide)"
    theirs = recommend(by_comm, fmt, wide_tests, optimizer, workers)
    if theirs is None or mine.comm not in theirs.fits:
        return mine.comm, "not shown (too few char-wide seeds)"
    interim = f", interim: {theirs.seeds} seeds" if theirs.seeds < 12 else ""
    beaten_by = theirs.beaten_by[mine.comm]
    if beaten_by:
        return mine.comm, f"reversed ({', '.join(beaten_by)} lower, Holm p < {ALPHA}{interim})"
    if theirs.comm == mine.comm and len(theirs.fits) == 1:
        return mine.comm, f"held by default (the only {fmt} arm run on char-wide{interim})"
    if theirs.comm == mine.comm:
        return mine.comm, f"held (the rule picks it among {', '.join(theirs.fits)}{interim})"
    return mine.comm, (f"not shown (it is not lower than {theirs.comm}, the rule's pick on "
                       f"char-wide{interim})")


def pick_lines(study, wide, rows, workers=(32, 64)):
    """One line per pick of the what-to-run table: held / not shown / reversed on char-wide."""
    ran = {(r.optimizer, r.workers) for r in hypotheses(rows)}
    tests = Multiplicity(study, workers, rows), Multiplicity(wide, (32,), rows)
    lines = []
    for optimizer, w, _ in settings(study, workers):
        for fmt, _ in BUDGETS:
            pick, words = pick_verdict(study, wide, tests, optimizer, w, fmt)
            if pick is None:
                continue
            if (optimizer, w) not in ran:
                words = "not shown (the char-wide study did not run this optimizer and W)"
            lines.append(f"- {name(optimizer)}, W = {w}, {fmt}: `{pick}` — {words}")
    return "\n".join(lines) + "\n"


def transfer(study, wide, workers=(32, 64), rows=None):
    """The `transfer` block of docs/study/README.md (rows: the plan's, default plan.md's)."""
    rows = plan.read() if rows is None else rows
    return (hypothesis_table(study, wide, rows) + "\n" + margin_line(study, wide, rows) + "\n"
            + "Each pick of the what-to-run table on char-wide:\n\n"
            + pick_lines(study, wide, rows, workers))


def transfer_line(study, wide, rows=None):
    """The README's one line: each hypothesis's outcome on char-wide."""
    rows = plan.read() if rows is None else rows
    tests = Multiplicity(wide, (32,), rows)
    cells = [(row, side(wide, tests, row, interim=True)) for row in hypotheses(rows)]
    planned = max(row.seeds for row, _ in cells)
    seeds = min((c.seeds for _, c in cells if c.seeds), default=0)
    state = (f"{seeds} seeds, as planned" if seeds == planned else
             f"interim: {seeds} of {planned} seeds" if seeds < planned else
             f"{seeds} seeds, {planned} planned")
    # short enough for two lines: "interim" said once, no "±" outside the README's table
    words = [c.words.replace(" (interim)", "").replace("±", "").replace(" (no test)", "")
             for _, c in cells]
    return wrap(f"On the wider char-wide (0.82M, width 128; {state}): "
                + "; ".join(f"{row.id} {w}" for (row, _), w in zip(cells, words))
                + " (docs/study/README.md).") + "\n"


def write_blocks(readme, study, wide, workers=(32, 64)):
    """Rewrite the transfer blocks `readme` holds; returns their names (none: [])."""
    content = open(readme).read()
    names = [n for n in BLOCKS if marker(n)[0] in content]
    for n in names:
        text = transfer(study, wide, workers) if n == "transfer" else transfer_line(study, wide)
        write_block(readme, *marker(n), text)
    return names
