"""What the command line prints: rows, the calibration and its verdicts, the paper's scenarios."""

from dataclasses import asdict, replace

from nanogeo.lab.perfmodel.calibrate import (PAPER_TARGETS, SEARCH_RANGE, calibrate,
                                               plausible_range, transform_budget)
from nanogeo.lab.perfmodel.model import PAPER_LINE_GBPS, Cluster, Workload, compare, step_time

# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------


def print_rows(rows, title):
    print(title)
    bf16 = rows[0]["vs_bf16"] is not None and rows[0]["comm"] != "bf16"
    print(f"  {'comm':>19s} {'compute':>9s} {'codec':>8s} {'transform':>10s} {'comm':>8s} "
          f"{'exposed':>8s} {'step':>8s} {'vs ' + rows[0]['comm']:>9s}" + (f" {'vs bf16':>8s}" if bf16 else ""))
    for r in rows:
        print(f"  {r['comm']:>19s} {1e3 * r['compute_s']:7.1f}ms {1e3 * r['codec_s']:6.1f}ms "
              f"{1e3 * r['transform_s']:8.1f}ms {1e3 * r['comm_s']:6.1f}ms "
              f"{1e3 * r['exposed_comm_s']:6.1f}ms {1e3 * r['step_s']:6.1f}ms {100 * r['vs_first']:+8.2f}%"
              + (f" {100 * r['vs_bf16']:+7.2f}%" if bf16 else ""))


def settings_text(c: Cluster, leave_out=()):
    return ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}"
                     for k, v in asdict(c).items() if k not in leave_out)


def verdicts(solved: Cluster, unknowns):
    """{name: (value, plausible)} for the solved parameters."""
    out = {}
    for name in unknowns:
        lo, hi = plausible_range(name, solved)
        value = getattr(solved, name)
        out[name] = (value, lo <= value <= hi)
    return out


def describe_calibration(w: Workload, start: Cluster, solved: Cluster, unknowns):
    """Print what was assumed, what was solved (with a plausibility verdict) and what it implies.
    Returns True when every solved parameter is plausible."""
    skip = set(unknowns) | {"geo_gemm_efficiency", "intra_gbps"}
    print("  assumed: " + settings_text(start, skip) + f" (line rate {PAPER_LINE_GBPS:g} GB/s); {w.tokens} tokens/GPU/step; {len(w.whitened)} "
          f"whitened layers {w.whitened[0][0]}x{w.whitened[0][1]}, refresh every {w.whiten_refresh} "
          f"steps, eigendecompositions {'in' if w.eigh_in_step else 'off'} the critical path")
    checks = verdicts(solved, unknowns)
    for name, (value, good) in checks.items():
        lo, hi = plausible_range(name, solved)
        print(f"  solved:  {name} = {value:.4g}  ({'plausible' if good else 'NOT plausible'}: "
              f"expected {lo:g}..{hi:g})")
    base, fp8, geo = (step_time(w, m, solved) for m in ("fp32", "fp8-sum", "geofp8-dense"))
    print(f"  check:   fp8-sum vs fp32 {100 * (fp8['step_s'] / base['step_s'] - 1):+.3f} %, "
          f"geofp8-dense vs fp32 {100 * (geo['step_s'] / base['step_s'] - 1):+.3f} %")
    print(f"  implied: fp32 step {1e3 * base['step_s']:.1f} ms (compute {1e3 * base['compute_s']:.1f} ms); "
          f"its all-reduce {1e3 * base['comm_s']:.1f} ms = {100 * base['comm_s'] / base['step_s']:.1f} % "
          f"of the step, exposed {1e3 * base['exposed_comm_s']:.1f} ms = "
          f"{100 * base['exposed_comm_s'] / base['step_s']:.1f} %")
    print(f"  implied: dense whitening {1e3 * geo['transform_s']:.2f} ms per step = "
          f"{100 * geo['transform_s'] / base['step_s']:.2f} % of the fp32 step (apply + error feedback "
          f"{1e3 * geo['apply_s']:.2f} ms, refresh {1e3 * geo['refresh_s']:.2f} ms amortised"
          + (f", eigendecompositions {1e3 * geo['eigh_s']:.2f} ms amortised)" if w.eigh_in_step else
             f"; eigendecompositions off the path, {1e3 * geo['eigh_s']:.2f} ms amortised if they were on it)"))
    return all(good for _, good in checks.values())


PAPER_SCENARIOS = (   # (what is assumed, workload settings, cluster overrides, the two unknowns)
    ("eigh in step", {"eigh_in_step": True}, {}, ("overlap", "mfu")),
    ("eigh in step", {"eigh_in_step": True}, {}, ("inter_gbps", "mfu")),
    ("eigh in step, MFU 0.3, kernels at 100 %", {"eigh_in_step": True},
     {"mfu": 0.3, "linalg_efficiency": 1.0}, ("overlap", "eigh_tflops")),
    ("eigh off path", {}, {}, ("overlap", "mfu")),
    ("eigh off path, MFU 0.4", {}, {"mfu": 0.4}, ("overlap", "linalg_efficiency")),
    ("eigh off path, MFU 0.3", {}, {"mfu": 0.3}, ("overlap", "linalg_efficiency")),
    ("eigh off path, overlap 0.5", {}, {"overlap": 0.5}, ("inter_gbps", "mfu")),
    ("eigh off path, MFU 0.4, overlap 0.5", {}, {"mfu": 0.4, "overlap": 0.5},
     ("inter_gbps", "linalg_efficiency")),
    ("eigh off path, fraction overlap model", {}, {"overlap_model": "fraction"}, ("overlap", "mfu")),
)


def scenario_table(w: Workload, start: Cluster):
    """One line per alternative set of assumptions: what the two figures then require."""
    print("other assumptions (each row changes the assumed values above as stated, solves two):")
    for label, settings, overrides, unknowns in PAPER_SCENARIOS:
        solved = calibrate(replace(w, **settings), replace(start, **overrides), *unknowns)
        if solved is None:
            print(f"  {label:40s} solve {'+'.join(unknowns):28s} -> no solution in the search range")
            continue
        checks = verdicts(solved, unknowns)
        text = ", ".join(f"{k} {v:.3g}" for k, (v, _) in checks.items())
        print(f"  {label:40s} solve {'+'.join(unknowns):28s} -> {text:38s} "
              + ("plausible" if all(g for _, g in checks.values()) else
                 "NOT plausible (" + ", ".join(k for k, (_, g) in checks.items() if not g) + ")"))


def paper_report(start: Cluster, w: Workload, fp8_unknown, geo_unknown, comms):
    """Calibrate to the paper's two figures, show alternatives, project `comms`. Returns
    (calibrated cluster, projection rows), or None when there is no calibration."""
    print(f"GeoFP8 paper setup: {w.name} model ({w.numel / 1e6:.1f}M gradient elements, "
          f"{w.train_flops / 1e12:.1f} TFLOP per GPU per step) on {start.gpus} GPUs "
          f"({start.nodes} nodes x {start.gpus_per_node})")
    print("targets vs fp32: " + ", ".join(f"{m} {100 * t:+.2f} %" for m, t in PAPER_TARGETS.items()))
    longest, budget = transform_budget(w, start)
    dense = step_time(w, "geofp8-dense", start)
    print(f"bound: at {start.inter_gbps:g} GB/s the FP8 figure allows an fp32 step of at most "
          f"{1e3 * longest:.0f} ms (any MFU, any overlap), so the GeoFP8 figure allows at most "
          f"{1e3 * budget:.1f} ms of whitening per step; the refresh's eigendecompositions alone "
          f"cost {1e3 * dense['eigh_s']:.1f} ms amortised at {start.eigh_tflops:g} TFLOP/s")
    solved = calibrate(w, start, fp8_unknown, geo_unknown)
    if solved is None:
        print(f"no {fp8_unknown} in {SEARCH_RANGE[fp8_unknown]} with {geo_unknown} in "
              f"{SEARCH_RANGE[geo_unknown]} reproduces both figures under these assumptions:")
        print("  assumed: " + settings_text(start, (fp8_unknown, geo_unknown))
              + f"; eigendecompositions {'in' if w.eigh_in_step else 'off'} the critical path")
        scenario_table(w, start)
        return None
    print(f"calibration (solve {fp8_unknown} from the FP8 figure, {geo_unknown} from the GeoFP8 figure):")
    ok = describe_calibration(w, start, solved, (fp8_unknown, geo_unknown))
    print("  verdict: " + ("physically plausible" if ok else "NOT physically plausible"))
    scenario_table(w, start)
    rows = compare(w, solved, comms)
    print_rows(rows, "projection on the calibrated cluster (transform = apply + amortised refresh):")
    eigh = {r["comm"]: r["eigh_s"] for r in rows if r["eigh_s"] > 0}
    if eigh and not w.eigh_in_step:
        print(f"  with the full eigendecompositions in the step ({solved.eigh_tflops:g} TFLOP/s) add "
              + ", ".join(f"{1e3 * s:.1f} ms to {m}" for m, s in eigh.items())
              + " (the -rand rows have none)")
    other = "fraction" if start.overlap_model == "capacity" else "capacity"
    alt = calibrate(w, replace(start, overlap_model=other), fp8_unknown, geo_unknown)
    if alt is not None:
        print(f"the same calibrated with the {other!r} overlap model ({fp8_unknown} "
              f"{getattr(alt, fp8_unknown):.3g}, {geo_unknown} {getattr(alt, geo_unknown):.3g}): "
              "change vs fp32 / vs bf16")
        print("  " + ", ".join(f"{r['comm']} {100 * r['vs_first']:+.2f}/{100 * r['vs_bf16']:+.2f} %"
                               for r in compare(w, alt, comms) if r["comm"] not in ("fp32", "bf16")))
    return solved, rows


