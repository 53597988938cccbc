"""
The rule that picks the method to run, and the families of tests it stands on.

Candidates (per optimizer, W and wire format): the methods measured with that wire format that
are not controls, with >= 2 finite seeds paired with fp32 and their bytes recorded.

Tests. Every pair of candidates is tested (paired t, two-sided, on the seeds the two share),
and so is every comparison the plan (docs/study/plan.md, plan.py) names. Each test belongs to
one family, whose p's Holm adjusts together: the plan row's `family`, or - for a pair of
candidates no plan row names - "exploratory: <optimizer>, W = <W>, <wire format>". A test of
equivalence (a plan row's `equivalent`) has the TOST's p. The same families are adjusted again
on the tail endpoint (each record's tail_val_loss), to show beside the final one.

The rule, the same at every W and wire format, each W on its own seeds (no pooling across W):
candidate A beats B when A - B is below 0 with a Holm-adjusted p below ALPHA in its family. The
pick is the cheapest candidate that no other candidate beats (cost(): Euclidean, then error
feedback / stochastic rounding, then the Hadamard rotation, then a geometry; then fewer bytes;
then the lower mean gap to fp32). The order in which candidates are listed changes nothing: every
pair is tested, and the pick is a minimum over all of them. (Should every candidate be beaten by
another - possible only across different shared seeds - the one beaten by the fewest is taken.)
A pick on fewer than MIN_SEEDS seeds paired with fp32 is provisional.
"""

import math
from collections import namedtuple

from nanogeo.lab.study import plan
from nanogeo.lab.study.arms import BUDGETS, cost, is_control, wire_format
from nanogeo.lab.study.report import OPTIMIZER_NAMES, settings
from nanogeo.lab.study.stats import holm, mean_sd, p_value, paired, tost_p

ALPHA = 0.05
MIN_SEEDS = 12          # a pick (or a figure row) on fewer seeds is provisional

# one test: a - b in a setting; kind "difference" (paired t) or "equivalent" (TOST at margin);
# row: the plan row that names it (None: exploratory)
Test = namedtuple("Test", "optimizer workers a b kind margin family row")


def wire_of(runs):
    """A method's bytes vs bf16, averaged over its runs; None for records without them."""
    means = [r.get("mean_wire_vs_bf16") for r in runs.values()]
    return None if None in means else sum(means) / len(means)


def candidates(by_comm, name):
    """The methods that may be recommended for wire format `name`, cheapest first (cost, then
    bytes, then name): not controls, >= 2 finite seeds paired with fp32, bytes recorded."""
    fp32 = by_comm.get("fp32", {})
    fits = []
    for c, runs in by_comm.items():
        if c == "fp32" or wire_format(c) != name or is_control(c):
            continue
        gaps = paired(runs, fp32)[1]
        if len(gaps) >= 2 and all(map(math.isfinite, gaps)) and wire_of(runs) is not None:
            fits.append(c)
    return sorted(fits, key=lambda c: (cost(c), round(wire_of(by_comm[c]), 3), c))


def preset_of(by_comm):
    return next(r.get("preset") for runs in by_comm.values() for r in runs.values())


def exploratory(optimizer, w, fmt):
    return f"exploratory: {OPTIMIZER_NAMES.get(optimizer, optimizer)}, W = {w}, {fmt}"


def test_key(optimizer, w, a, b, kind="difference"):
    return optimizer, w, frozenset((a, b)), kind


def setting_tests(optimizer, w, by_comm, rows):
    """The tests of one setting: the plan's rows with data here, then every pair of candidates
    of each wire format (costlier - cheaper) that no plan row tests for a difference."""
    preset, tests = preset_of(by_comm), {}
    shared = lambda a, b: a in by_comm and b in by_comm and len(
        paired(by_comm[a], by_comm[b])[1]) > 1
    for r in rows:
        if (r.preset, r.optimizer, r.workers) == (preset, optimizer, w) and r.test != "report" \
                and shared(r.a, r.b):
            kind = "equivalent" if r.test == "equivalent" else "difference"
            tests[test_key(optimizer, w, r.a, r.b, kind)] = Test(optimizer, w, r.a, r.b, kind,
                                                                  r.margin, r.family, r)
    for fmt, _ in BUDGETS:
        fits = candidates(by_comm, fmt)
        for i, b in enumerate(fits):
            for a in fits[i + 1:]:
                k = test_key(optimizer, w, a, b)
                if k not in tests and shared(a, b):
                    tests[k] = Test(optimizer, w, a, b, "difference", None,
                                    exploratory(optimizer, w, fmt), None)
    return tests


def all_tests(results, workers, rows):
    """{test_key: Test} over every setting (report.settings) at these W's."""
    out = {}
    for optimizer, w, by_comm in settings(results, workers):
        out.update(setting_tests(optimizer, w, by_comm, rows))
    return out


def raw_p(test, by_comm, endpoint="final"):
    diffs = paired(by_comm[test.a], by_comm[test.b], endpoint)[1]
    if len(diffs) < 2:
        return float("nan")
    return tost_p(diffs, test.margin) if test.kind == "equivalent" else p_value(diffs)


def adjust(tests, groups, endpoint="final"):
    """{test_key: (p, Holm-adjusted p in its family)} at `endpoint`; groups: {(optimizer, W):
    by_comm}. A test with no p at this endpoint (too few seeds) is left out of its family."""
    p = {k: raw_p(t, groups[(t.optimizer, t.workers)], endpoint) for k, t in tests.items()}
    families = {}
    for k, t in tests.items():
        if math.isfinite(p[k]):
            families.setdefault(t.family, []).append(k)
    out = {}
    for keys in families.values():
        out.update({k: (p[k], q) for k, q in zip(keys, holm([p[k] for k in keys]))})
    return out


class Multiplicity:
    """Every test of the results at these W's, with its family and its p and Holm-adjusted p
    at both endpoints: what the tables, the words and the rule read."""

    def __init__(self, results, workers, rows=None):
        self.rows = plan.read() if rows is None else rows
        self.groups = {(o, w): by for o, w, by in settings(results, workers)}
        self.tests = all_tests(results, workers, self.rows)
        self.final = adjust(self.tests, self.groups, "final")
        self.tail = adjust(self.tests, self.groups, "tail")

    def find(self, optimizer, w, a, b):
        """The difference test of a and b (else an equivalence test of them), or None."""
        for kind in ("difference", "equivalent"):
            k = test_key(optimizer, w, a, b, kind)
            if k in self.tests:
                return k
        return None

    def plan_row(self, optimizer, w, a, b):
        by_comm = self.groups.get((optimizer, w))
        preset = preset_of(by_comm) if by_comm else None
        return plan.lookup(self.rows, preset, optimizer, w, a, b)

    def adjusted(self, optimizer, w, a, b, endpoint="final"):
        """(p, Holm-adjusted p, family) of the test of a and b at `endpoint`, or None."""
        k = self.find(optimizer, w, a, b)
        found = (self.final if endpoint == "final" else self.tail).get(k)
        return None if found is None else (*found, self.tests[k].family)

    def p_text(self, optimizer, w, a, b, endpoint="final"):
        """'p = 0.025, Holm in "FP8 geometry, Muon W = 32"' ('p < 0.001, ...'), or ''."""
        found = self.adjusted(optimizer, w, a, b, endpoint)
        if found is None:
            return ""
        q = "p < 0.001" if found[1] < 0.001 else f"p = {found[1]:.3f}"
        return f'{q}, Holm in "{found[2]}"'

    def beats(self, optimizer, w, a, b, endpoint="final"):
        """Whether a is lower than b with a Holm-adjusted p below ALPHA (a difference test)."""
        k = test_key(optimizer, w, a, b)
        adjusted = (self.final if endpoint == "final" else self.tail).get(k)
        if adjusted is None or not adjusted[1] < ALPHA:
            return False
        by_comm = self.groups[(optimizer, w)]
        return mean_sd(paired(by_comm[a], by_comm[b], endpoint)[1])[0] < 0


# what the rule picks for one optimizer, W and wire format: the method, the candidates it was
# chosen among (cheapest first) and, per candidate, the candidates that beat it
Choice = namedtuple("Choice", "comm fits beaten_by seeds")


def recommend(by_comm, name, tests, optimizer, w):
    """The rule's Choice for wire format `name` in one setting (tests: a Multiplicity of the
    results), or None without a candidate."""
    fits = candidates(by_comm, name)
    if not fits:
        return None
    beaten_by = {c: [d for d in fits if d != c and tests.beats(optimizer, w, d, c)]
                 for c in fits}
    gap = lambda c: mean_sd(paired(by_comm[c], by_comm["fp32"])[1])[0]
    pick = min(fits, key=lambda c: (len(beaten_by[c]), cost(c), round(wire_of(by_comm[c]), 3),
                                    gap(c), c))
    return Choice(pick, fits, beaten_by, len(paired(by_comm[pick], by_comm["fp32"])[1]))


def choices(results, workers=(32,), tests=None):
    """{W: {(optimizer, format): Choice}} for the formats with a candidate at that W."""
    tests = tests or Multiplicity(results, workers)
    out = {w: {} for w in workers}
    for optimizer, w, by_comm in settings(results, workers):
        for name, _ in BUDGETS:
            choice = recommend(by_comm, name, tests, optimizer, w)
            if choice is not None:
                out[w][(optimizer, name)] = choice
    return out
