"""
The studies' plan (docs/study/plan.md), read: every comparison a study named before its runs (or,
marked "retrospective", after them), with its test, margin, seeds, endpoint and the family whose
tests Holm adjusts together. The study tool labels each comparison it prints by the plan row that
names it - "planned (H1a)", "retrospective (N2a)" - or "exploratory" where no row does.

plan.md is markdown: a `## ` heading opens a section (one study, or one part of it); a section
whose prose says "retrospective" was written after its runs; each table row of a section is one
comparison:

    | id | comparison | preset | optimizer | W | test | margin | seeds | endpoint | family |
    | H3 | subspace - fp8 | char-wide | muon | 32 | less | - | 12 | final | char-wide |

`test` is `greater` / `less` (a paired t test, two-sided p), `equivalent` (TOST at +-margin) or
`report` (an interval, no test, no family). A comparison (preset, optimizer, W, the pair) may be
named by several sections - a later study asking an earlier one's question again - only with the
same test and family; the row with a test is read first, then a planned one before a
retrospective one (lookup()).
"""

import os
from collections import namedtuple

from nanogeo.lab.study.runs import ROOT

PLAN = os.path.join(ROOT, "docs", "study", "plan.md")
COLUMNS = ("id", "comparison", "preset", "optimizer", "W", "test", "margin", "seeds", "endpoint",
           "family")
TESTS = ("greater", "less", "equivalent", "report")

PlanRow = namedtuple("PlanRow", "id a b preset optimizer workers test margin seeds endpoint "
                                "family section retrospective")


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_row(line, section, retrospective):
    """One table line as a PlanRow; a ValueError naming the line when a cell is not readable."""
    row = dict(zip(COLUMNS, cells(line)))
    a, dash, b = row.get("comparison", "").partition(" - ")
    if len(row) != len(COLUMNS) or not dash or row["test"] not in TESTS:
        raise ValueError(f"plan.md, section {section!r}: cannot read {line.strip()!r} (columns "
                         f"{', '.join(COLUMNS)}; comparison 'A - B'; test one of {TESTS})")
    tested = row["test"] != "report"
    if tested == (row["family"] in ("", "-")):
        raise ValueError(f"plan.md, row {row['id']}: a test needs a family, a report has none")
    margin = float(row["margin"]) if row["test"] == "equivalent" else None
    return PlanRow(row["id"], a.strip(), b.strip(), row["preset"], row["optimizer"],
                   int(row["W"]), row["test"], margin, int(row["seeds"]), row["endpoint"],
                   row["family"] if tested else None, section, retrospective)


def parse(text):
    """[PlanRow] of plan.md's text, in file order."""
    sections, rows = [], []
    for line in text.splitlines():
        if line.startswith("## "):
            sections.append([line[3:].strip(), []])
        elif sections:
            sections[-1][1].append(line)
    for title, lines in sections:
        table = [ln for ln in lines if ln.startswith("|")]
        prose = " ".join(ln for ln in lines if not ln.startswith("|"))
        retrospective = "retrospective" in (title + " " + prose).lower()
        rows += [parse_row(ln, title, retrospective) for ln in table[2:]]   # past the header
    check(rows)
    return rows


def key(row):
    return row.preset, row.optimizer, row.workers, row.a, row.b


def check(rows):
    """A ValueError where two rows name one comparison with another test or family."""
    seen = {}
    for row in rows:
        if row.test == "report":
            continue
        other = seen.setdefault(key(row), row)
        if (other.test, other.family) != (row.test, row.family):
            raise ValueError(f"plan.md: rows {other.id} and {row.id} name {row.a} - {row.b} "
                             f"({row.optimizer}, W = {row.workers}) with another test or family")


def read(path=PLAN):
    """The plan's rows ([] when there is no plan file)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return parse(f.read())


def lookup(rows, preset, optimizer, workers, a, b):
    """The plan row that names a - b (or b - a) in this setting, or None: a row with a test before
    a report, a planned row before a retrospective one, then the first in the file."""
    named = [r for r in rows if (r.preset, r.optimizer, r.workers) == (preset, optimizer, workers)
             and {r.a, r.b} == {a, b}]
    named.sort(key=lambda r: (r.test == "report", r.retrospective))
    return named[0] if named else None


def label(row, seeds=None):
    """'planned (H1a)', 'retrospective (N2a)' or 'exploratory' (no row). A planned row compared
    on other than its fixed number of seeds says so: an interim look ('interim: 8 of 12 seeds')
    or seeds beyond the plan ('16 seeds, 12 planned'), which the plan's family did not fix."""
    if row is None:
        return "exploratory"
    text = f"{'retrospective' if row.retrospective else 'planned'} ({row.id})"
    if row.retrospective or seeds is None or seeds == row.seeds:
        return text
    if seeds < row.seeds:
        return f"{text}, interim: {seeds} of {row.seeds} seeds"
    return f"{text}, {seeds} seeds, {row.seeds} planned"
