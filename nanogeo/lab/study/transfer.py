"""
Does the answer hold on a wider model? The char-wide replication (docs/study/plan.md, family
"char-wide") beside char-study's records, from the records alone:

    python -m nanogeo.lab.study --answer STUDY_RESULTS --transfer docs/study/wide/results.json \
        --readme README.md --readme docs/study/README.md

writes the block `transfer` (docs/study/README.md: each hypothesis on both models, and one line
per pick of the what-to-run table) and `transfer line` (README.md: one line) wherever a file has
its markers. Each hypothesis is the plan's row on char-wide (its Holm-adjusted p in its family,
final and tail endpoints); char-study's estimate is the same paired difference at the same
optimizer and W from the char-study records, with the p and family its own plan gives it (or the
unadjusted p, said so, where its plan names no such test). A row on fewer seeds than its plan
fixes is an interim look, said in the row.
"""

from nanogeo.lab.study import plan
from nanogeo.lab.study.page import marker, write_block
from nanogeo.lab.study.arms import BUDGETS
from nanogeo.lab.study import report
from nanogeo.lab.study.findings import name
from nanogeo.lab.study.report import arms_of, settings
from nanogeo.lab.study.rule import ALPHA, Multiplicity, recommend
from nanogeo.lab.study.stats import MARGIN, estimate, mean_ci, p_value, paired, tost, tost_p

WIDE = "char-wide"


def hypotheses(rows):
    """The plan's rows for char-wide, in the plan's order."""
    return [r for r in rows if r.preset == WIDE]


def group(results, optimizer, workers):
    """{comm: {block: record}} of the study's runs of this optimizer at W, or {}."""
    return next((by for o, w, by in settings(results, (workers,)) if o == optimizer), {})


def any_group(results, optimizer, workers, a, b):
    """(by_comm, whether it is the study's main group) of the group holding the most seeds of
    both a and b: the main group (settings) when it has them, else another (e.g. the first
    study's, whose machines were not recorded and which is never pooled)."""
    main = group(results, optimizer, workers)
    if a in main and b in main:
        return main, True
    rows = [r for r in results if not r.get("sweep") and r["optimizer"] == optimizer
            and r["workers"] == workers]
    groups = [arms_of([r for r in rows if report.group(r) == k])
              for k in {report.group(r) for r in rows}]
    shared = [(len(paired(by[a], by[b])[1]), i) for i, by in enumerate(groups)
              if a in by and b in by]
    return (groups[max(shared)[1]], False) if shared else ({}, True)


def outcome(row, diffs, p):
    """The hypothesis's outcome in words from the paired differences and its (adjusted) p."""
    if len(diffs) < 2:
        return "not run"
    mean, half = mean_ci(diffs)
    if row.test == "report":
        return "reported (no test)"
    if row.test == "equivalent":
        low, high, inside = tost(diffs, row.margin)
        if p < ALPHA and inside:
            return f"equivalent within ±{row.margin:g}"
        outside = low > row.margin or high < -row.margin
        return f"not equivalent (outside ±{row.margin:g})" if outside else "not shown"
    sign = 1 if row.test == "greater" else -1
    if p < ALPHA and sign * mean > 0:
        return "shown"
    return "reversed" if sign * mean < 0 and abs(mean) > half else "not shown"


def p_cell(tests, row, diffs, endpoint="final"):
    """(p, 'Holm p = x in "family"' or 'p = x, unadjusted') of row's test on one model."""
    found = tests.adjusted(row.optimizer, row.workers, row.a, row.b, endpoint)
    if found is not None:
        return found[1], f'Holm p = {found[1]:.3f} ("{found[2]}")'
    if row.test == "report" or len(diffs) < 2:
        return float("nan"), "—"
    p = tost_p(diffs, row.margin) if row.test == "equivalent" else p_value(diffs)
    return p, f"p = {p:.3f}, unadjusted (no such test in its plan)"


def side(results, tests, row, endpoint="final"):
    """One model's cell of one hypothesis: estimate (seeds), p, outcome."""
    by_comm, main = any_group(results, row.optimizer, row.workers, row.a, row.b)
    if row.a not in by_comm or row.b not in by_comm:
        return "not run", "", "not run", 0
    diffs = paired(by_comm[row.a], by_comm[row.b], endpoint)[1]
    if len(diffs) < 2:
        return "—", "", "not run", len(diffs)
    p, text = p_cell(tests, row, diffs, endpoint) if main else (
        p_value(diffs) if row.test != "equivalent" else tost_p(diffs, row.margin), "")
    if not main:    # not the study's group: its own seeds, its p unadjusted
        text = (f"p = {p:.3f}, unadjusted (records of another group, never pooled with the "
                "study's)" if row.test != "report" else "—")
    seeds = f"{len(diffs)} seeds"
    return f"{estimate(diffs, sign='+')} ({seeds})", text, outcome(row, diffs, p), len(diffs)


def hypothesis_table(study, wide, rows):
    """The markdown table: each hypothesis on char-study and on char-wide (final endpoint), and
    char-wide's tail endpoint (rows: the whole plan)."""
    study_tests, wide_tests = Multiplicity(study, (32, 64), rows), Multiplicity(wide, (32,), rows)
    lines = ["| hypothesis | test | char-study: estimate | p | outcome | char-wide: estimate | "
             "p | outcome | char-wide, tail mean: estimate | p | outcome |",
             "| --- " * 11 + "|"]
    for row in hypotheses(rows):
        test = (f"TOST ±{row.margin:g}" if row.test == "equivalent" else
                "report" if row.test == "report" else f"{row.test} than 0")
        a = side(study, study_tests, row)
        b = side(wide, wide_tests, row)
        c = side(wide, wide_tests, row, "tail")
        look = f" — {plan.label(row, b[3])}" if 0 < b[3] < row.seeds else ""
        lines.append(f"| {row.id}: {row.a} − {row.b} (Muon, W = {row.workers}){look} | {test} | "
                     + " | ".join(" | ".join(cell[:3]) for cell in (a, b, c)) + " |")
    return "\n".join(lines) + "\n"


def margin_line(study, wide):
    """The margin as a fraction of fp32's loss on each model (the plan's second statement)."""
    parts = []
    for label, results in (("char-study", study), (WIDE, wide)):
        fp32 = group(results, "muon", 32).get("fp32", {})
        losses = [r["final_val_loss"] for r in fp32.values()]
        if losses:
            mean = sum(losses) / len(losses)
            parts.append(f"{label} {100 * MARGIN / mean:.2f} % of fp32's {mean:.4f}")
    return f"The margin {MARGIN:g} as a fraction of fp32's final val loss (Muon, W = 32): " + \
        "; ".join(parts) + ".\n"


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
    if theirs is None:
        return mine.comm, "not shown (too few char-wide seeds)"
    interim = f", interim: {theirs.seeds} seeds" if theirs.seeds < 12 else ""
    others = [c for c in theirs.fits if c != mine.comm]
    if theirs.comm == mine.comm and not others:
        return mine.comm, f"held by default (the only {fmt} arm run on char-wide{interim})"
    if theirs.comm == mine.comm:
        return mine.comm, f"held (the rule picks it among {', '.join(theirs.fits)}{interim})"
    if wide_tests.beats(optimizer, workers, theirs.comm, mine.comm):
        return mine.comm, f"reversed ({theirs.comm} beats it{interim})"
    return mine.comm, (f"not shown (it did not beat {theirs.comm}, the rule's pick on "
                       f"char-wide{interim})")


def pick_lines(study, wide, rows, workers=(32, 64)):
    """One line per pick of the what-to-run table: held / not shown / reversed on char-wide."""
    tests = Multiplicity(study, workers, rows), Multiplicity(wide, (32,), rows)
    lines = []
    for optimizer, w, _ in settings(study, workers):
        for fmt, _ in BUDGETS:
            pick, words = pick_verdict(study, wide, tests, optimizer, w, fmt)
            if pick is None:
                continue
            if (optimizer, w) != ("muon", 32):
                words = "not shown (char-wide ran Muon at W = 32 only)"
            lines.append(f"- {name(optimizer)}, W = {w}, {fmt}: `{pick}` — {words}")
    return "\n".join(lines) + "\n"


def transfer(study, wide, workers=(32, 64), rows=None):
    """The `transfer` block of docs/study/README.md (rows: the plan's, default plan.md's)."""
    rows = plan.read() if rows is None else rows
    return (hypothesis_table(study, wide, rows) + "\n" + margin_line(study, wide) + "\n"
            + "Each pick of the what-to-run table on char-wide:\n\n"
            + pick_lines(study, wide, rows, workers))


def transfer_line(study, wide, rows=None):
    """The README's one line: each hypothesis's outcome on char-wide."""
    rows = plan.read() if rows is None else rows
    wide_tests = Multiplicity(wide, (32,), rows)
    words, seeds = [], 0
    for row in hypotheses(rows):
        _, _, out, n = side(wide, wide_tests, row)
        words.append(f"{row.id} {out}")
        seeds = max(seeds, n)
    planned = max(r.seeds for r in hypotheses(rows))
    state = f"{seeds} seeds, as planned" if seeds >= planned else \
        f"interim: {seeds} of {planned} seeds"
    return (f"On the wider char-wide (0.82M, width 128; {state}): " + "; ".join(words)
            + " (docs/study/README.md, \"char-wide\").\n")


BLOCKS = ("transfer", "transfer line")


def write_blocks(readme, study, wide, workers=(32, 64)):
    """Rewrite the transfer blocks `readme` holds; returns their names (none: [])."""
    content = open(readme).read()
    names = [n for n in BLOCKS if marker(n)[0] in content]
    for n in names:
        text = transfer(study, wide, workers) if n == "transfer" else transfer_line(study, wide)
        write_block(readme, *marker(n), text)
    return names
