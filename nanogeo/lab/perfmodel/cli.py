"""The step-time model's command line (python -m nanogeo.lab.perfmodel)."""
import argparse
from dataclasses import asdict, replace

from nanogeo.lab.perfmodel.calibrate import SEARCH_RANGE, solve_inter_bandwidth
from nanogeo.lab.perfmodel.model import (COLLECTIVES, METHODS, TRANSFORMS, Cluster, compare,
                                           paper_600m_config, paper_cluster, paper_workload,
                                           workload)
from nanogeo.lab.perfmodel.report import paper_report, print_rows

DESCRIPTION = ("An analytic step-time model: what does each gradient-communication method cost "
               "end to end, and which machine parameters reproduce the paper's reported timings?")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nanogeo.lab.perfmodel", description=DESCRIPTION,
                                     allow_abbrev=False)
    parser.add_argument("mode", nargs="?", default="scan", choices=["scan", "paper"],
                        help="scan: node counts on a 4-GPU-per-node cluster; paper: calibrate to "
                             "the paper's 64 x GH200 cluster and project the methods there")
    parser.add_argument("--preset", default="llama-600m", help="scan mode's model")
    parser.add_argument("--nodes", default=None, help="comma-separated node counts (scan; default 16)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per GPU per step (scan default 8192, paper 16384)")
    parser.add_argument("--geo_rank", type=int, default=16, help="r of the subspace rotation")
    parser.add_argument("--whiten_rank", type=int, default=32, help="r of the low-rank whitening")
    parser.add_argument("--whiten_refresh", type=int, default=50, help="K: steps between refreshes")
    parser.add_argument("--eigh_in_step", type=int, choices=[0, 1], default=0,
                        help="paper: 1 counts the refresh's eigendecompositions in the step time")
    parser.add_argument("--comms", default=None, help="methods to compare: a collective "
                        f"({', '.join(COLLECTIVES)}), collective+transform ({', '.join(TRANSFORMS)}) "
                        f"or one of {', '.join(METHODS)}")
    parser.add_argument("--target", type=float, default=-0.076,
                        help="scan: solve for the NIC bandwidth that gives this subspace vs bf16 change")
    parser.add_argument("--solve", default="overlap,mfu",
                        help="paper: the parameter the FP8 figure pins, then the one the GeoFP8 "
                             f"figure pins; two of {', '.join(SEARCH_RANGE)}")
    for name, value in asdict(Cluster()).items():
        if name != "nodes":
            parser.add_argument(f"--{name}", type=type(value), default=None,
                                help=f"scan default {value}; paper mode prints its own")
    args = parser.parse_args(argv)
    overrides = {k: getattr(args, k) for k in asdict(Cluster())
                 if k != "nodes" and getattr(args, k) is not None}
    settings = dict(geo_rank=args.geo_rank, whiten_rank=args.whiten_rank, whiten_refresh=args.whiten_refresh)

    if args.mode == "paper":
        unknowns = args.solve.split(",")
        if len(unknowns) != 2 or len(set(unknowns)) != 2 or not set(unknowns) <= set(SEARCH_RANGE):
            parser.error(f"--solve takes two different names of {', '.join(SEARCH_RANGE)}, "
                         "e.g. --solve=overlap,mfu")
        start = paper_cluster(**({"nodes": int(args.nodes)} if args.nodes else {}), **overrides)
        settings["eigh_in_step"] = bool(args.eigh_in_step)
        w = paper_workload(**settings) if args.tokens is None else workload(
            paper_600m_config(), args.tokens, **settings)
        comms = (args.comms or "fp32,bf16,fp8-sum,geofp8-dense,geofp8-lowrank,geofp8-lowrank-rand,"
                 "fp8,fp8+lowrank,fp8+lowrank-rand,subspace").split(",")
        return paper_report(start, w, *unknowns, comms)

    cluster_settings = {**asdict(Cluster()), **overrides}
    tokens = args.tokens or 8192
    print("assumptions: " + ", ".join(f"{k}={v}" for k, v in cluster_settings.items() if k != "nodes")
          + f", tokens/GPU/step={tokens}, r={args.geo_rank}")
    w = workload(args.preset, tokens, **settings)
    comms = (args.comms or "bf16,fp8,subspace,nvfp4").split(",")
    for nodes in (int(n) for n in (args.nodes or "16").split(",")):
        cluster = Cluster(**{**cluster_settings, "nodes": nodes})
        rows = compare(w, cluster, comms)
        print_rows(rows, f"{args.preset} on {cluster.gpus} GPUs ({nodes} nodes):")
        gbps = solve_inter_bandwidth(w, cluster, args.target)
        if gbps is None:
            print(f"  no NIC bandwidth gives subspace vs bf16 {100 * args.target:+.1f}% here")
        else:
            at = compare(w, replace(cluster, inter_gbps=gbps), ("bf16", "subspace"))
            print(f"  subspace vs bf16 = {100 * args.target:+.1f}% at a NIC bandwidth of {gbps:.1f} GB/s "
                  f"per GPU (bf16 exposed comm then {100 * at[0]['exposed_comm_s'] / at[0]['step_s']:.1f}% "
                  "of its step)")
    return rows

