"""
The generated blocks of the README and of docs/study/README.md. A file holds a block between
`<!-- NAME: begin -->` and `<!-- NAME: end -->`; `--answer RESULTS --readme FILE` rewrites every
block FILE has, from the same records, so no number in them is typed by hand:

    what to run   summary(): the README's table - per optimizer, W and wire format the method
                  to run, its bytes, its gaps to fp32 and bf16 and a verdict in words
    answer        answers(): the full tables under the rule, one per W (answer.py)
    findings      findings(): what the data show, in words (findings.py)
    comparisons   comparisons(): every paired comparison behind them (compare.py)
    machines      machines(): which machine, commits and seeds each results file holds
"""

import json
import os

from nanogeo.lab.study.answer import answers, choices, lower, wire_of
from nanogeo.lab.study.arms import BUDGETS
from nanogeo.lab.study.compare import comparisons
from nanogeo.lab.study.findings import against_baselines, findings, goal_note, name, p_text
from nanogeo.lab.study.report import gap_cell, load_results, machine_labels, seed_list, settings
from nanogeo.lab.study.stats import MARGIN, estimate, paired, wrap


def marker(name):
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


SUMMARY_BEGIN, SUMMARY_END = marker("what to run")
ANSWER_BEGIN, ANSWER_END = marker("answer")
COMPARISONS_BEGIN, COMPARISONS_END = marker("comparisons")


def why_picked(by_comm, choice, w, workers):
    """Why the table recommends choice.comm, in a few words: pooled over the W's, lower than
    the cheaper candidates it replaced, or the cheapest with nothing costlier shown lower."""
    comm, fits = choice.comm, choice.fits
    if choice.pooled:
        others = ", ".join(str(x) for x in workers if x != w)
        separated = any(lower(by_comm, a, b) for a in fits for b in fits if a != b)
        alone = f"the rule picks `{choice.alone}`" if separated else "no candidate separated"
        return f"pooled with W = {others} (at W = {w} alone {alone})"
    beaten = [c for c in fits[:fits.index(comm)] if lower(by_comm, comm, c)]
    if beaten:
        return "; ".join(f"lower than `{c}` ({p_text(paired(by_comm[comm], by_comm[c])[1])})"
                         for c in beaten)
    return "no other candidate lower" if len(fits) > 1 else "the only candidate"


def summary(results, workers=(32,), margin=MARGIN):
    """The README's what-to-run table: one row per optimizer, W and wire format with a
    candidate (the paper's optimizer, Muon, first), the method answers() recommends there with
    its bytes, its paired gaps to fp32 and bf16, its seeds and a verdict in words; then the
    three lines that read it."""
    chosen = choices(results, workers)
    lines = ["| optimizer, W | wire | run | bytes vs bf16 | gap to fp32 | gap to bf16 | seeds | "
             "in words |", "| --- " * 8 + "|"]
    for optimizer, w, by_comm in settings(results, workers):
        for fmt, _ in BUDGETS:
            choice = chosen[w].get((optimizer, fmt))
            if choice is None:
                continue
            runs, fp32 = by_comm[choice.comm], by_comm["fp32"]
            seeds, gaps = paired(runs, fp32)
            words = (f"{why_picked(by_comm, choice, w, workers)}; "
                     + against_baselines(by_comm, choice.comm, margin))
            bf16 = gap_cell(runs, by_comm["bf16"], len(seeds)) if "bf16" in by_comm else "—"
            lines.append(f"| {name(optimizer)}, W = {w} | {fmt} | `{choice.comm}` | "
                         f"{wire_of(runs):.3f}× | {estimate(gaps, sign='+')} | {bf16} | "
                         f"{len(seeds)} | {words} |")
    notes = ["- Gaps: final val loss minus fp32's or bf16's, paired by seed: the mean and its 95 % "
             "t half-width.",
             "- Run this: the cheapest method, unless a costlier one is lower at 95 % on the seeds "
             "both ran.",
             f"- Within {margin:g}: a TOST, the 90 % interval inside a margin of {margin:g} "
             "(about 0.12 % of the loss).", goal_note(results, workers, margin)]
    return "\n".join(lines + [""] + [wrap(n) for n in notes if n]) + "\n"


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


BLOCKS = ("what to run", "answer", "findings", "comparisons", "machines")


def block_text(name, paths, results, workers, margin):
    """The text of the generated block `name` (BLOCKS)."""
    if name == "what to run":
        return summary(results, workers, margin)
    if name == "answer":
        return answers(results, workers, margin)
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
