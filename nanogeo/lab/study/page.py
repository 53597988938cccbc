"""
The generated blocks of the README and of docs/study/README.md. A file holds a block between
`<!-- NAME: begin -->` and `<!-- NAME: end -->`; `--answer RESULTS --readme FILE` rewrites every
block FILE has, from the same records, so no number in them is typed by hand:

    what to run   summary(): the README's table - per optimizer, W and wire format the method
                  to run, its bytes, its gaps to fp32 and bf16 and a verdict in words
    answer        answers(): the full tables under the rule, one per W (answer.py)
    families      families(): every family of tests, its status and its Holm-adjusted p's
    findings      findings(): what the data show, in words (findings.py)
    comparisons   comparisons(): every paired comparison behind them (compare.py)
    machines      machines(): which machine, commits and seeds each results file holds
"""

import json
import os

from nanogeo.lab.study.answer import answers
from nanogeo.lab.study.arms import BUDGETS, cost
from nanogeo.lab.study.compare import comparisons
from nanogeo.lab.study.findings import against_baselines, findings, goal_note, name
from nanogeo.lab.study.report import gap_cell, load_results, machine_labels, seed_list, settings
from nanogeo.lab.study.rule import MIN_SEEDS, Multiplicity, choices, wire_of
from nanogeo.lab.study.stats import MARGIN, estimate, mean_sd, paired, wrap


def marker(name):
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


SUMMARY_BEGIN, SUMMARY_END = marker("what to run")
ANSWER_BEGIN, ANSWER_END = marker("answer")
COMPARISONS_BEGIN, COMPARISONS_END = marker("comparisons")


def p_words(p):
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def beaten_text(tests, optimizer, w, winner, loser, first):
    """'lower than `fp8` (p = 0.025, Holm in "..."; tail mean: ...)' (first: the pick is the
    winner) or '`fp8` above `subspace` (...)': one candidate the rule passed over, and why."""
    final = tests.p_text(optimizer, w, winner, loser)
    agrees = tests.beats(optimizer, w, winner, loser, "tail")
    tail = tests.adjusted(optimizer, w, winner, loser, "tail")
    if tail is None:
        tail = "tail mean: not recorded"
    else:
        tail = f"tail mean: {p_words(tail[1])}" + ("" if agrees else ", not significant there")
    said = f"lower than `{loser}`" if first else f"`{loser}` above `{winner}`"
    return f"{said} ({final}; {tail})"


def why_picked(by_comm, choice, optimizer, w, fmt, tests):
    """Why the table recommends choice.comm, in a few words: each candidate as cheap or cheaper
    that the rule passed over, and the candidate that beats it (the pick where it does) with the
    adjusted p at both end points; what the rule picks on the tail mean where that differs."""
    comm, fits = choice.comm, choice.fits
    price = lambda c: (cost(c), round(wire_of(by_comm[c]), 3))
    said = []
    for c in fits:
        if c == comm or price(c) > price(comm):
            continue
        winners = choice.beaten_by[c]
        if winners:
            winner = comm if comm in winners else winners[0]
            said.append(beaten_text(tests, optimizer, w, winner, c, winner == comm))
        else:
            said.append(f"as cheap as `{c}` and not separated from it (lower mean)")
    if not said:
        said.append("no other candidate lower" if len(fits) > 1 else "the only candidate")
    on_tail = tail_pick(by_comm, fits, tests, optimizer, w)
    if on_tail and on_tail != comm:
        said.append(f"on the tail mean the rule picks `{on_tail}`")
    if choice.seeds < MIN_SEEDS:
        said.insert(0, f"provisional ({choice.seeds} seeds)")
    return "; ".join(said)


def tail_pick(by_comm, fits, tests, optimizer, w):
    """The rule's pick among the candidates `fits` with every test read at the tail end point;
    None where no test of them has a tail end point."""
    tail = lambda a, b: tests.beats(optimizer, w, a, b, "tail")
    if not any(tests.adjusted(optimizer, w, a, b, "tail") for a in fits for b in fits if a != b):
        return None                                     # no tail val loss recorded
    beaten = {c: sum(tail(d, c) for d in fits if d != c) for c in fits}
    gap = lambda c: mean_sd(paired(by_comm[c], by_comm["fp32"], "tail")[1] or [0.0])[0]
    return min(fits, key=lambda c: (beaten[c], cost(c), round(wire_of(by_comm[c]), 3), gap(c),
                                    c))


def summary(results, workers=(32,), margin=MARGIN):
    """The README's what-to-run table: one row per optimizer, W and wire format with a
    candidate (the paper's optimizer, Muon, first), the method the rule picks there with its
    bytes, its paired gaps to fp32 and bf16 (and to fp32 on the tail mean), its seeds and why
    in words; then the lines that read it."""
    tests = Multiplicity(results, workers)
    chosen = choices(results, workers, tests)
    lines = ["| optimizer, W | wire | run | bytes vs bf16 | gap to fp32 | gap to bf16 | "
             "tail mean: gap to fp32 | seeds | in words |", "| --- " * 9 + "|"]
    for optimizer, w, by_comm in settings(results, workers):
        for fmt, _ in BUDGETS:
            choice = chosen[w].get((optimizer, fmt))
            if choice is None:
                continue
            runs, fp32 = by_comm[choice.comm], by_comm["fp32"]
            seeds, gaps = paired(runs, fp32)
            tail = paired(runs, fp32, "tail")[1]
            words = (f"{why_picked(by_comm, choice, optimizer, w, fmt, tests)}; "
                     + against_baselines(by_comm, choice.comm, margin))
            bf16 = gap_cell(runs, by_comm["bf16"], len(seeds)) if "bf16" in by_comm else "—"
            lines.append(f"| {name(optimizer)}, W = {w} | {fmt} | `{choice.comm}` | "
                         f"{wire_of(runs):.3f}× | {estimate(gaps, sign='+')} | {bf16} | "
                         f"{estimate(tail, sign='+') if len(tail) > 1 else '—'} | "
                         f"{len(seeds)} | {words} |")
    notes = ["- Run this: the cheapest method that no other is lower than at 95 % after Holm's "
             "adjustment in its family (docs/study/README.md: the rule, the families).",
             goal_note(results, workers, margin)]
    return "\n".join(lines + [""] + [wrap(n) for n in notes if n]) + "\n"


def family_status(keys, tests):
    rows = [tests.tests[k].row for k in keys]
    if any(r is None for r in rows):
        return "exploratory"
    return "retrospective" if any(r.retrospective for r in rows) else "fixed before the runs"


def families(results, workers=(32,)):
    """The table of every family of tests (rule.Multiplicity): its name, tests and status, and
    each test's p and Holm-adjusted p at the final and tail end points."""
    tests = Multiplicity(results, workers)
    by_family = {}
    for k, t in tests.tests.items():
        if k in tests.final:
            by_family.setdefault(t.family, []).append(k)
    order = ("fixed before the runs", "retrospective", "exploratory")
    names = sorted(by_family, key=lambda f: order.index(family_status(by_family[f], tests)))
    lines = ["| family | comparison | test | seeds | p | Holm p | tail mean: p | "
             "tail mean: Holm p |", "| --- " * 8 + "|"]
    cell = lambda found: f"{found[0]:.3f} | {found[1]:.3f}" if found else "— | —"
    for family in names:
        keys = by_family[family]
        count = f"{len(keys)} test{'s' if len(keys) > 1 else ''}"
        head = f"{family} ({count}, {family_status(keys, tests)})"
        for n, k in enumerate(keys):
            t = tests.tests[k]
            by = tests.groups[(t.optimizer, t.workers)]
            seeds = len(paired(by[t.a], by[t.b])[1])
            kind = f"TOST ±{t.margin:g}" if t.kind == "equivalent" else "paired t"
            lines.append(f"| {head if n == 0 else ''} | {t.a} − {t.b} ({name(t.optimizer)}, "
                         f"W = {t.workers}) | {kind} | {seeds} | {cell(tests.final[k])} | "
                         f"{cell(tests.tail.get(k))} |")
    return "\n".join(lines) + "\n"


def machines(paths):
    """A table of what each results file holds: per file and machine the runs, the commits
    they ran at, the W's and the seeds; the machines named in full below it."""
    paths = [p for p in paths.split(",") if p] if isinstance(paths, str) else list(paths)
    labels = machine_labels([r for r in load_results(paths) if not r.get("sweep")])
    lines = ["| results | machine | runs | commits | W | seeds |", "| --- " * 6 + "|"]
    for path in paths:
        with open(path) as f:
            records = [r for r in json.load(f) if not r.get("sweep")]
        for m in sorted({r.get("machine") or "" for r in records}):
            rows = [r for r in records if (r.get("machine") or "") == m]
            commits = sorted({(r.get("commit") or "not recorded")[:7] for r in rows})
            ws = ", ".join(str(w) for w in sorted({r["workers"] for r in rows}))
            lines.append(f"| {path} | {labels.get(m, 'not recorded')} | {len(rows)} | "
                         f"{', '.join(commits)} | {ws} | {seed_list({r['seed'] for r in rows})} |")
    named = [wrap(f"- {k} = {m}") for m, k in labels.items()]
    return "\n".join(lines + [""] + named) + "\n"


BLOCKS = ("what to run", "answer", "families", "findings", "comparisons", "machines")


def block_text(name, paths, results, workers, margin):
    """The text of the generated block `name` (BLOCKS)."""
    if name == "what to run":
        return summary(results, workers, margin)
    if name == "answer":
        return answers(results, workers, margin)
    if name == "families":
        return families(results, workers)
    if name == "findings":
        return findings(results, workers, margin)
    if name == "comparisons":
        return comparisons(results, workers, margin)
    return machines(paths)


def write_block(readme, begin, end, text):
    """Replace the file's text between the markers begin and end with text; a ValueError
    naming the fix when they are missing."""
    content = open(readme).read()
    head, found_begin, rest = content.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"{readme} has no {begin} ... {end} block: add one where the table goes")
    with open(readme + ".tmp", "w") as f:
        f.write(f"{head}{begin}\n{text}{end}{tail}")
    os.replace(readme + ".tmp", readme)
    return text


def write_blocks(paths, readme, workers=(32,), margin=MARGIN):
    """Rewrite every generated block `readme` holds (BLOCKS) from the records in `paths`
    (results.json files: a list, or one comma-separated text); returns the names written, a
    ValueError naming the markers when it holds none."""
    paths = [p for p in paths.split(",") if p] if isinstance(paths, str) else list(paths)
    content = open(readme).read()
    names = [n for n in BLOCKS if marker(n)[0] in content]
    if not names:
        raise ValueError(f"{readme} has no generated block (one of "
                         f"{', '.join(marker(n)[0] for n in BLOCKS)}, with its end marker): "
                         "add one where the table goes")
    results = load_results(paths)
    for name in names:
        write_block(readme, *marker(name), block_text(name, paths, results, workers, margin))
    return names
