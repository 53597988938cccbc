"""
What else a study's records show: which layers a geometry arm sent in geometry-aware
coordinates over a run (gain_history), the train-loss curves (plot), the error of the mean by
stage of the two-stage collective (stage_table, --stages) and how far the same runs ended apart
in two results files (sensitivity).
"""

import os

from nanogeo.lab.study.report import group, group_order
from nanogeo.lab.study.stats import estimate


def gain_history(results):
    """Markdown: for each geometry arm (optimizer, W, simulated or real ranks, method), per
    seed, how many candidate layers were sent in geometry-aware coordinates at the first logged
    step and at every logged step where that changed ("step:count"), and how many distinct layers
    ever were."""
    arms = {}
    for r in results:
        if r.get("geometry") and not r.get("sweep"):
            key = r["optimizer"], r["workers"], r.get("simulated", False), r["comm"]
            arms.setdefault(key, []).append(r)
    lines = ["| optimizer | W | method | per seed: step:count at each change | layers ever |",
             "| --- | --- | --- | --- | --- |"]
    for (optimizer, workers, simulated, comm), runs in sorted(arms.items()):
        per_seed, ever = [], set()
        for r in sorted(runs, key=lambda r: r["seed"]):
            counts = [(step, len(names)) for step, names in r["geometry"]]
            changes = [f"{step}:{n}" for k, (step, n) in enumerate(counts)
                       if k == 0 or n != counts[k - 1][1]]
            per_seed.append(f"{r['seed']}: {' → '.join(changes)}")
            ever |= {name for _, names in r["geometry"] for name in names}
        ranks = workers if simulated else f"{workers} (real ranks)"
        lines.append(f"| {optimizer} | {ranks} | {comm} | {'; '.join(per_seed)} | {len(ever)} |")
    return "\n".join(lines) + "\n" if arms else ""


def plot(results, out_dir):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no loss plots")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    study = [r for r in results if not r.get("sweep")]
    keys = sorted({group(r) for r in study}, key=group_order)
    for key in keys:
        optimizer, workers, simulated, *_ = key
        fig, ax = plt.subplots(figsize=(7, 4))
        for comm in dict.fromkeys(r["comm"] for r in study):
            curves = [r["curve"] for r in study if r["comm"] == comm and group(r) == key]
            if not curves:
                continue
            steps = [s for s, _ in curves[0]]
            values = [[c[i][1] for c in curves if len(c) > i] for i in range(len(steps))]
            mean = [sum(v) / len(v) for v in values]
            line, = ax.plot(steps, mean, label=f"{comm} ({len(curves)} seeds)", lw=1)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values],
                            color=line.get_color(), alpha=0.2)
        ax.set(xlabel="step", ylabel="train loss (rank 0)", title=f"{optimizer}, W = {workers}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        # one file per group; a second set of train flags for the same optimizer and W gets _2
        same = [k for k in keys if k[:3] == key[:3]]
        suffix = f"_{same.index(key) + 1}" if same.index(key) else ""
        ranks = "sim" if simulated else "ranks"
        fig.savefig(os.path.join(out_dir, f"loss_{optimizer}_{ranks}{workers}{suffix}.png"),
                    dpi=120)
        plt.close(fig)


def stage_table(results, min_seeds=4):
    """Markdown: per method and W, the error of the mean by stage (train.py --log_stages) as a
    ratio to the mean's sampling noise, in L2 and as each optimizer sees it. Per seed the mean
    over its logged steps after the first quarter of the run (the warm-up's first steps are not
    representative); then the mean over seeds +- the 95 % t half-width, the seeds as blocks (a
    seed's steps are not independent draws). Rows with fewer than min_seeds seeds say so."""
    cells = {}
    for r in results:
        late = [stages for step, stages in r.get("stages") or [] if step > r["steps"] // 4]
        for metric in dict.fromkeys(m for stages in late for m in stages):
            parts = [stages[metric] for stages in late if metric in stages]
            seed = {k: sum(p[k] for p in parts) / len(parts) for k in ("stage1", "stage2", "total")}
            key = (r["optimizer"], r["workers"], r["comm"], metric)
            cells.setdefault(key, []).append((seed, len(parts)))
    if not cells:
        return ""
    lines = ["| optimizer | method | W | metric | stage 1 (95 % t) | stage 2 (95 % t) | "
             "total (95 % t) | seeds | logged steps per seed |", "| --- " * 9 + "|"]
    few = False
    for (optimizer, workers, comm, metric), seeds in sorted(cells.items()):
        columns = [estimate([s[k] for s, _ in seeds], digits=3)
                   for k in ("stage1", "stage2", "total")]
        steps = sorted({n for _, n in seeds})
        few |= len(seeds) < min_seeds
        lines.append(f"| {optimizer} | {comm} | {workers} | {metric} | {' | '.join(columns)} | "
                     f"{len(seeds)}{'' if len(seeds) >= min_seeds else ' (too few)'} | "
                     f"{', '.join(map(str, steps))} |")
    if few:
        lines.append(f"\n(too few): under {min_seeds} seeds, too few for an interval to "
                     "decide anything.")
    return "\n".join(lines) + "\n"


def sensitivity(results, other):
    """Markdown: the same runs (method, optimizer, W, seed, steps) in two results files - two
    thread counts, compiled or not, two machines - and how far apart their final val losses
    ended: per method the mean and the largest |difference| over the seeds both have. (Pass
    files of one study each: a run met twice in a file counts once, the later record.)"""
    def key(r):
        return r["comm"], r["optimizer"], r["workers"], r["seed"], r["steps"]
    theirs = {key(r): r for r in other if not r.get("sweep")}
    by_comm = {}
    for r in results:
        if not r.get("sweep") and key(r) in theirs:
            diff = r["final_val_loss"] - theirs[key(r)]["final_val_loss"]
            by_comm.setdefault((r["comm"], r["optimizer"], r["workers"]), []).append(diff)
    lines = ["| method | optimizer | W | seeds | mean abs difference | largest abs difference | "
             "differences |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for (comm, optimizer, workers), diffs in sorted(by_comm.items()):
        lines.append(f"| {comm} | {optimizer} | {workers} | {len(diffs)} | "
                     f"{sum(map(abs, diffs)) / len(diffs):.4f} | {max(map(abs, diffs)):.4f} | "
                     + ", ".join(f"{d:+.4f}" for d in diffs) + " |")
    return "\n".join(lines) + "\n"


def at_endpoint(results, endpoint):
    """The records with their final_val_loss taken from one end point: "final" (train.py's
    final val loss, as recorded) or "tail" (its tail val loss, --tail_evals; records without
    one are left out)."""
    if endpoint == "final":
        return results
    return [{**r, "final_val_loss": r["tail_val_loss"]} for r in results
            if r.get("tail_val_loss") is not None]
