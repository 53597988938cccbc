"""Calibration to the paper: solve one or two unknown machine parameters so that the model
reproduces the paper's end-to-end figures, and check that they are physically plausible."""

import math
from dataclasses import replace

from nanogeo.lab.perfmodel.model import (PAPER_LINE_GBPS, Cluster, Workload, collective_seconds,
                                           parse_method, step_time)

# ----------------------------------------------------------------------------------------------
# Solving for parameters
# ----------------------------------------------------------------------------------------------

SEARCH_RANGE = {"mfu": (0.01, 1.0), "overlap": (0.0, 1.0), "inter_gbps": (0.5, 5000.0),
                "linalg_efficiency": (1e-4, 100.0), "eigh_tflops": (1e-3, 1e4)}


def plausible_range(name, c: Cluster):
    """The range a solved parameter must fall in to be physically believable."""
    return {"mfu": (0.2, 0.6), "overlap": (0.0, 1.0), "inter_gbps": (0.5 * PAPER_LINE_GBPS, PAPER_LINE_GBPS),
            "linalg_efficiency": (0.0, 1.0), "eigh_tflops": (0.0, c.fp32_tflops)}[name]


def solve_1d(f, lo, hi, points=64, iters=80):
    """A root of f in [lo, hi]: the first sign change on a grid (log-spaced when lo > 0), then
    bisection. f may return None where it is undefined. None if f has no sign change."""
    grid = [lo * (hi / lo) ** (i / (points - 1)) if lo > 0 else lo + (hi - lo) * i / (points - 1)
            for i in range(points)]
    values = [f(x) for x in grid]
    for a, b, fa, fb in zip(grid, grid[1:], values, values[1:]):
        if fa is None or fb is None or (fa > 0) == (fb > 0):
            continue
        for _ in range(iters):
            mid = math.sqrt(a * b) if a > 0 else (a + b) / 2
            fm = f(mid)
            if fm is None:
                return None
            a, b, fa = (mid, b, fm) if (fm > 0) == (fa > 0) else (a, mid, fa)
        return (a + b) / 2
    return None


PAPER_TARGETS = {"fp8-sum": -0.1079, "geofp8-dense": -0.076}   # end-to-end time vs fp32


def change_vs(w, c, method, baseline="fp32"):
    return step_time(w, method, c)["step_s"] / step_time(w, baseline, c)["step_s"] - 1


def calibrate(w: Workload, c: Cluster, fp8_unknown="overlap", geo_unknown="mfu",
              targets=PAPER_TARGETS):
    """Solve two parameters of `c` so that both published figures come out of the model.

    The FP8 figure (fp8-sum vs fp32) does not involve the transform; the GeoFP8 figure adds the
    transform's cost. So for each trial value of `geo_unknown` we solve `fp8_unknown` from the
    FP8 figure (inner solve), and pick the `geo_unknown` at which the GeoFP8 figure is met (outer
    solve). Returns the calibrated Cluster, or None when no values in SEARCH_RANGE do it."""
    (fp8_method, fp8_target), (geo_method, geo_target) = targets.items()

    def inner(cluster):
        x = solve_1d(lambda v: change_vs(w, replace(cluster, **{fp8_unknown: v}), fp8_method) - fp8_target,
                     *SEARCH_RANGE[fp8_unknown])
        return None if x is None else replace(cluster, **{fp8_unknown: x})

    def geo_residual(v):
        cluster = inner(replace(c, **{geo_unknown: v}))
        return None if cluster is None else change_vs(w, cluster, geo_method) - geo_target

    if fp8_unknown == geo_unknown:
        raise ValueError("solve for two different parameters")
    v = solve_1d(geo_residual, *SEARCH_RANGE[geo_unknown])
    return None if v is None else inner(replace(c, **{geo_unknown: v}))


def transform_budget(w: Workload, c: Cluster, targets=PAPER_TARGETS):
    """(longest fp32 step, most transform seconds per step) the two figures allow at c's
    bandwidth, whatever MFU and overlap are. FP8 can save at most the whole difference of the two
    collectives less its codec (when nothing is hidden), and that saving is -target_fp8 of the
    fp32 step; the GeoFP8 - FP8 gap is then the transform's share of that same step."""
    (fp8_method, fp8_target), (_, geo_target) = targets.items()
    fp32, _ = collective_seconds("fp32", w, c)
    fp8, codec = collective_seconds(parse_method(fp8_method)[0], w, c)
    longest = (fp32 - fp8 - codec) / -fp8_target
    return longest, (geo_target - fp8_target) * longest


def solve_inter_bandwidth(w: Workload, c: Cluster, target, method="subspace", baseline="bf16"):
    """The NIC bandwidth per GPU (GB/s) at which `method`'s step time is `target` (e.g. -0.076)
    relative to `baseline`. None if no bandwidth in [0.1, 100000] GB/s gives it."""
    return solve_1d(lambda gbps: change_vs(w, replace(c, inter_gbps=gbps), method, baseline) - target,
                    0.1, 100000.0)


