"""
The study driver's command line: run a grid of runs (or a sweep), or - with --answer, --table,
--comparisons, --stages or --sensitivity - only read results files (several, comma-separated, are
read as one: a study's seeds may come from several machines) and print what they show.
"""

import argparse
import os
import sys

from nanogeo.run import config
from nanogeo.lab.study.answer import answers
from nanogeo.lab.study.arms import COMMS, EUCLIDEAN
from nanogeo.lab.study.compare import comparisons
from nanogeo.lab.study.diagnostics import (at_endpoint, gain_history, plot, sensitivity,
                                             stage_table)
from nanogeo.lab.study.figure import write_figure
from nanogeo.lab.study import recommended, transfer
from nanogeo.lab.study.page import (COMPARISONS_BEGIN, COMPARISONS_END, write_block,
                                      write_blocks)
from nanogeo.lab.study.report import load_results, table
from nanogeo.lab.study.runs import StudyRun, execute, git_commit, machine, run_dir, write
from nanogeo.lab.study.stats import MARGIN
from nanogeo.lab.study.sweep import (SWEEPABLE, lr_flags, parse_sweep, sweep_summary,
                                       sweep_table)

DESCRIPTION = ("Convergence studies: the same training run with each gradient communication "
               "method, over a grid of methods x optimizers x seeds x data-parallel ranks, "
               "compared seed by seed with Student t intervals; and the short fp32 "
               "learning-rate sweep that tunes each optimizer before a study (the package's "
               "docstring: python -c 'import nanogeo.lab.study as s; help(s)'; adding a method "
               "and running an ablation: docs/ablate.md).")
EPILOG = ("Flags after `--` go to every train.py run, e.g. `-- --preset=char-study "
          "--max_iters=300`. Each run lands in OUT_DIR/ARM/OPTIMIZER/simW/seedS; every run's "
          "record in OUT_DIR/results.json, the table in OUT_DIR/study.md.")


def parse_args(argv):
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m nanogeo.lab.study", description=DESCRIPTION,
                                     epilog=EPILOG, allow_abbrev=False)
    parser.add_argument("--comms", default=None, help="methods (default fp32,bf16,fp8,geofp8), "
                        f"from: {', '.join(COMMS)} (hadamard*: needs train.py --comm=hadamard)")
    parser.add_argument("--optimizers", default="adamw", help="adamw, muon or both "
                        "(adamw,muon) (default %(default)s)")
    parser.add_argument("--seeds", default="1337", help="comma-separated seeds "
                        "(default %(default)s)")
    parser.add_argument("--workers", default="0", help="simulated ranks per run, comma-separated "
                        "(0: real ranks, --nproc of them, through torchrun) (default %(default)s)")
    parser.add_argument("--nproc", type=int, default=2, help="real ranks per run with "
                        "--workers 0 (default %(default)s)")
    parser.add_argument("--reference", default=None, help="the Euclidean method whose gap the "
                        "others recover (default: the first of fp8, fp8-paper, e5m2-tensor, "
                        "nvfp4 in --comms)")
    parser.add_argument("--sweep", default=None, help="FLAG=V1,V2,...: fp32 runs at each value "
                        f"of FLAG ({', '.join(SWEEPABLE)}); the best goes to out_dir/sweep.json")
    parser.add_argument("--lr_from", default=None, help="a sweep.json: every method of an "
                        "optimizer trains with the best values swept for it at that W")
    results = "RESULTS[,RESULTS...]"
    parser.add_argument("--answer", default=None, metavar=results, help="print the "
                        "which-method-to-run tables from results.json files (no runs); with "
                        "--readme FILE, write every generated block FILE holds instead (the "
                        "README's what-to-run table, docs/study/README.md's answer, findings, "
                        "comparisons and machines: nanogeo/lab/study/page.py)")
    parser.add_argument("--comparisons", default=None, metavar=results, help="print every "
                        "comparison the answer rests on (each arm against its Euclidean twin, "
                        "bf16 and fp32) with its TOST verdict (no runs); with --readme FILE, "
                        "write it between FILE's comparisons markers")
    parser.add_argument("--readme", action="append", default=None, metavar="FILE",
                        help="a markdown file whose generated blocks to rewrite; repeatable")
    parser.add_argument("--picks", default=None, metavar="JSON", help="with --answer: write "
                        "the table's picks, for train.py --comm=auto, to JSON (the one train.py "
                        "reads: nanogeo/run/recommended.json)")
    parser.add_argument("--figure", default=None, metavar="PNG", help="with --answer: draw "
                        "the forest plot of the paired differences to PNG and write its values "
                        "beside it (.json); needs matplotlib (pip install -e \".[plot]\")")
    parser.add_argument("--transfer", default=None, metavar=results, help="with --answer: "
                        "the char-wide replication's results; --readme FILE writes FILE's "
                        "transfer blocks (each hypothesis on both models, each pick held / not "
                        "shown / reversed: nanogeo/lab/study/transfer.py) and --figure gains "
                        "its panel")
    parser.add_argument("--margin", type=float, default=MARGIN, help="the equivalence margin "
                        "of --answer and --comparisons in final val loss (default %(default)g, "
                        "about 0.12 %% of the study's loss): two methods are called equivalent "
                        "when the 90 %% paired t interval lies inside +-margin (TOST)")
    parser.add_argument("--table", default=None, metavar=results, help="print study.md's "
                        "tables of results.json files again (no runs), e.g. with another "
                        "--reference")
    parser.add_argument("--stages", default=None, metavar=results, help="print the error of "
                        "the mean by stage of runs with train.py --log_stages, mean +- 95 %% t "
                        "over seeds (no runs)")
    parser.add_argument("--sensitivity", default=None, nargs=2, metavar="RESULTS",
                        help="print how far the same runs in two results files ended apart "
                        "(two thread counts, compiled or not, two machines)")
    parser.add_argument("--endpoint", default="final", choices=("final", "tail"),
                        help="--table compares the runs' final val loss or their tail val loss "
                        "(train.py --tail_evals) (default %(default)s)")
    parser.add_argument("--answer_workers", default=None, help="W of --answer's and "
                        "--comparisons' tables (default 32); several (e.g. 32,64): one table "
                        "per W, in that order")
    parser.add_argument("--out_dir", default="out/ablate", help="where the runs, "
                        "results.json and study.md land (default %(default)s)")
    args = parser.parse_args(argv)
    return parser, args, extra


def tuned_flags(args, optimizers, workers, flag, extra):
    """{(optimizer, W): the learning-rate flags --lr_from gives it}; a ValueError when they,
    the swept flag and the flags after -- set one thing twice."""
    lrs = {(o, w): lr_flags(args.lr_from, o, w or args.nproc) if args.lr_from else []
           for o in optimizers for w in workers}
    from_file = {f.partition("=")[0] for flags in lrs.values() for f in flags}
    if flag and f"--{flag}" in from_file:
        raise ValueError(f"--lr_from sets the {flag} that --sweep sweeps: drop one of them")
    clash = [f for f in extra if f.partition("=")[0] in from_file | {f"--{flag}"}]
    if clash:
        raise ValueError(f"{clash[0]} after -- sets what --sweep / --lr_from set: drop one of "
                         "them")
    return lrs


def plan(parser, args, extra):
    """Every run of this call, in order: [StudyRun]."""
    if args.sweep and args.comms not in (None, "fp32"):
        parser.error("--sweep runs fp32 only: leave --comms out")
    comms = (args.comms or ("fp32" if args.sweep else "fp32,bf16,fp8,geofp8")).split(",")
    optimizers = args.optimizers.split(",")
    unknown = [c for c in comms if c not in COMMS] + [o for o in optimizers
                                                      if o not in ("adamw", "muon")]
    if unknown:
        parser.error(f"unknown method or optimizer {unknown[0]!r}; methods: {', '.join(COMMS)}")
    choices = config.TRAIN_CHOICES["comm"]
    missing = [c for c in comms if COMMS[c][0].partition("=")[2] not in choices]
    if missing:
        parser.error(f"method {missing[0]} needs train.py {COMMS[missing[0]][0]}, which this "
                     "train.py does not have yet: leave it out of --comms")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error("--seeds and --workers take comma-separated integers, e.g. --seeds 0,1,2")
    try:
        flag, values = parse_sweep(args.sweep, optimizers) if args.sweep else (None, [None])
        lrs = tuned_flags(args, optimizers, workers, flag, extra)
    except ValueError as e:
        parser.error(str(e))
    runs = []
    for value in values:
        root = os.path.join(args.out_dir, f"{flag}={value}") if flag else args.out_dir
        swept = [f"--{flag}={value}"] if flag else []
        runs += [StudyRun(c, o, w, s, run_dir(root, c, o, w, args.nproc, s),
                     tuple(lrs[(o, w)] + swept + extra), (flag, value) if flag else ())
                 for o in optimizers for w in workers for s in seeds for c in comms]
    return comms, runs


def read_only(parser, args):
    """--stages, --sensitivity, --table, --answer, --comparisons: print (or write into --readme)
    what results files show; True when one of them was asked for."""
    try:
        if args.stages or args.sensitivity:
            print(stage_table(load_results(args.stages)) if args.stages else
                  sensitivity(*(load_results(f) for f in args.sensitivity)), end="")
            return True
        if args.table:
            results = at_endpoint(load_results(args.table), args.endpoint)
            print(table(results, args.reference or "fp8"), end="")
            history = gain_history(results)
            if history:
                print("\nCandidate layers in geometry-aware coordinates (logged steps):\n")
                print(history, end="")
            return True
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"--stages / --sensitivity / --table: {e}")
    if (args.readme or args.answer_workers) and not (args.answer or args.comparisons):
        parser.error("--readme and --answer_workers go with --answer RESULTS (or --comparisons "
                     "RESULTS): give both")
    for flag, given in (("--figure", args.figure), ("--picks", args.picks),
                        ("--transfer", args.transfer)):
        if given and not args.answer:
            parser.error(f"{flag} goes with --answer RESULTS: give both")
    if not (args.answer or args.comparisons):
        return False
    if args.answer and args.comparisons and args.readme:
        parser.error("--readme takes one of --answer and --comparisons at a time")
    paths = (args.answer or args.comparisons).split(",")
    wide = args.transfer.split(",") if args.transfer else []
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        parser.error(f"--answer / --comparisons {missing[0]}: no such results file (a study's "
                     "out_dir/results.json)")
    missing = [p for p in wide if not os.path.exists(p)]
    if missing:
        parser.error(f"--transfer {missing[0]}: no such results file (the char-wide study's "
                     "docs/study/wide/results.json)")
    if wide and not (args.readme or args.figure):
        parser.error("--transfer writes blocks and a figure panel: give --readme FILE or "
                     "--figure PNG with it")
    try:
        workers = [int(w) for w in (args.answer_workers or "32").split(",")]
    except ValueError:
        parser.error(f"--answer_workers {args.answer_workers!r}: comma-separated integers, "
                     "e.g. 32,64")
    if len(set(workers)) < len(workers):
        parser.error(f"--answer_workers {args.answer_workers!r} names a W twice")
    if not args.margin > 0:
        parser.error(f"--margin {args.margin}: a positive loss difference, e.g. 0.002")
    try:
        if args.answer and args.readme:
            for readme in args.readme:
                names = write_blocks(paths, readme, workers, args.margin)
                if wide:
                    names += transfer.write_blocks(readme, load_results(paths),
                                                   load_results(wide), workers)
                print(f"{readme}: {', '.join(names)}")
        elif args.answer:
            print(answers(load_results(paths), workers, args.margin), end="")
        if args.picks:          # the same picks, for train.py --comm=auto
            print(f"{recommended.write(load_results(paths), workers, paths, args.picks)}: "
                  "the picks for train.py --comm=auto")
        if args.figure:
            print(write_figure(load_results(paths), workers, args.figure, args.margin,
                               load_results(wide) if wide else None))
        if args.comparisons:
            text = comparisons(load_results(paths), workers, args.margin)
            for readme in args.readme or []:
                write_block(readme, COMPARISONS_BEGIN, COMPARISONS_END, text)
            print(text, end="")
    except (ValueError, OSError) as e:
        parser.error(str(e))
    return True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser, args, extra = parse_args(argv)
    if read_only(parser, args):
        return
    comms, runs = plan(parser, args, extra)
    reference = args.reference or next((c for c in comms if c in EUCLIDEAN), "fp8")
    os.makedirs(args.out_dir, exist_ok=True)
    origin = {**git_commit(), "machine": machine()}     # where the runs run: provenance.json
    results, everything = [], []
    for k, run in enumerate(runs, 1):
        sweep = f" {run.sweep[0]}={run.sweep[1]}" if run.sweep else ""
        label = (f"[{k}/{len(runs)}] {run.comm} {run.optimizer} W={run.workers or args.nproc} "
                 f"seed={run.seed}{sweep}")
        result, state = execute(run, args.nproc, args.out_dir, origin, label)
        results.append(result)
        print(f"{label}: val {result['final_val_loss']:.4f} ({state})", flush=True)
        everything = write(results, args.out_dir, reference)
    if args.sweep:
        print(sweep_table(sweep_summary(everything)))
        print(f"best values: {os.path.join(args.out_dir, 'sweep.json')} (use it with --lr_from)")
        return
    plot(everything, args.out_dir)
    print(table(everything, reference))

