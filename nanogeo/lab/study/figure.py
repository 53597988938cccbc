"""
The study's figure (docs/study/answer.png): a forest plot of paired differences in final val
loss, one panel per optimizer and W with runs - every candidate method and bf16 against fp32,
every lever against its Euclidean twin, the mixed wire's candidates against bf16 - each a mean
with its 95 % t interval, the equivalence band +-margin shaded, each label with the method's
bytes against bf16's.

    python -m nanogeo.lab.study --answer RESULTS --answer_workers 32,64 --figure docs/study/answer.png

writes the PNG and, beside it, a JSON of exactly the values plotted (docs/study/answer.json: a
test holds them to the comparisons table). matplotlib is optional (pip install -e ".[plot]"):
without it nothing is drawn and one line says so; forest() needs only the records.
"""

import json
import os

from nanogeo.lab.study.rule import MIN_SEEDS, candidates, wire_of
from nanogeo.lab.study.arms import BUDGETS, cost, wire_format
from nanogeo.lab.study.compare import twin
from nanogeo.lab.study.findings import goal_methods, name
from nanogeo.lab.study.report import settings
from nanogeo.lab.study.stats import MARGIN, mean_ci, paired


COLOURS = {"fp32": "tab:blue", "bf16": "tab:green"}    # else a lever against its twin: orange


def panel_rows(by_comm, goal=()):
    """[(a, b)] of one panel: bf16 and every candidate (wire formats in BUDGETS order, each
    cheapest first) against fp32; each lever (a geometry, error feedback, ...) against its
    Euclidean twin; and each mixed-wire candidate among `goal` (findings.goal_methods: a wire
    of at most GOAL_BYTES x bf16's) against bf16 (the goal: bf16's quality at those bytes)."""
    fits = [c for fmt, _ in BUDGETS for c in candidates(by_comm, fmt)]
    rows = [(c, "fp32") for c in (["bf16"] if "bf16" in by_comm else []) + fits]
    rows += [(c, twin(c, list(by_comm))) for c in fits
             if cost(c) > 0 and twin(c, list(by_comm))]
    if "bf16" in by_comm:
        rows += [(c, "bf16") for c in fits if wire_format(c) == "4-bit + FP8" and c in goal]
    return rows


def forest(results, workers=(32,), margin=MARGIN):
    """The plotted values: {"margin", "panels": [{"optimizer", "workers", "title", "rows":
    [{"a", "b", "label", "seeds", "mean", "low", "high", "wire", "provisional"}]}]}; low and
    high bound the 95 % paired t interval of a - b over the seeds both share; a row on fewer than
    rule.MIN_SEEDS seeds is provisional (said in its label, drawn with an open marker)."""
    panels = []
    for optimizer, w, by_comm in settings(results, workers):
        rows = []
        for a, b in panel_rows(by_comm, goal_methods(results, optimizer)):
            diffs = paired(by_comm[a], by_comm[b])[1]
            if len(diffs) < 2:
                continue
            mean, half = mean_ci(diffs)
            wire, provisional = wire_of(by_comm[a]), len(diffs) < MIN_SEEDS
            rows.append({"a": a, "b": b, "seeds": len(diffs), "mean": mean,
                         "low": mean - half, "high": mean + half, "wire": wire,
                         "provisional": provisional,
                         "label": f"{a} − {b}  ({wire:.3f}×, {len(diffs)} seeds"
                                  + (", provisional)" if provisional else ")")})
        if rows:
            panels.append({"optimizer": optimizer, "workers": w, "rows": rows,
                           "title": f"{name(optimizer)}, W = {w}"})
    return {"margin": margin, "panels": panels}


def draw(data, path):
    """The forest plot of forest()'s data as a PNG at `path`; False (and nothing written)
    without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    heights = [len(p["rows"]) + 1.5 for p in data["panels"]]
    fig, axes = plt.subplots(len(heights), 1, sharex=True, squeeze=False,
                             figsize=(9, 0.26 * sum(heights) + 1.2),
                             gridspec_kw={"height_ratios": heights})
    for ax, panel in zip(axes[:, 0], data["panels"]):
        rows = panel["rows"]
        ys = range(len(rows), 0, -1)
        ax.axvspan(-data["margin"], data["margin"], color="0.88", lw=0,
                   label=f"±{data['margin']:g} (equivalence margin)")
        ax.axvline(0, color="0.4", lw=0.8)
        for y, row in zip(ys, rows):
            colour = COLOURS.get(row["b"], "tab:orange")
            ax.plot([row["low"], row["high"]], [y, y], color=colour, lw=1.6)
            ax.plot([row["mean"]], [y], "o", color=colour, ms=4,
                    markerfacecolor="white" if row["provisional"] else colour)
        ax.set_yticks(list(ys), [r["label"] for r in rows], fontsize=7)
        ax.set_ylim(0.3, len(rows) + 0.7)
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[0, 0].legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("paired difference in final val loss, mean and 95 % t interval\n"
                           "blue: against fp32; orange: a lever against its Euclidean twin; "
                           "green: a mixed wire against bf16; open marker: provisional "
                           f"(< {MIN_SEEDS} seeds)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130, metadata={"Software": None})
    plt.close(fig)
    return True


def write_figure(results, workers, path, margin=MARGIN, wide=None):
    """Draw the figure at `path` and write its values to the same name with .json; returns
    the line to print (what was written, or why nothing was). `wide`: the char-wide
    replication's records, drawn below as panels of their own."""
    data = forest(results, workers, margin)
    for panel in forest(wide, workers, margin)["panels"] if wide else []:
        data["panels"].append({**panel, "title": f"char-wide: {panel['title']}"})
    if not data["panels"]:
        raise ValueError(f"no study run at W = {', '.join(map(str, workers))} to plot: pass "
                         "the W the study ran at (--answer_workers)")
    values = os.path.splitext(path)[0] + ".json"        # (the values need no matplotlib)
    with open(values, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    if not draw(data, path):
        return (f"matplotlib not installed: {path} not drawn (pip install -e \".[plot]\"); "
                f"the tables and {values} are written")
    return f"{path} and {values}: the forest plot and its values"
