"""
The smoke test's command line (python -m nanogeo.smoke): --worker is one torchrun rank
(ranks.py), --nproc=N is make gpu-smoke (launcher.py), anything else the one-process checks
(single.py).
"""

import argparse

import model as model_lib
from nanogeo.smoke.launcher import first_contact
from nanogeo.smoke.ranks import worker
from nanogeo.smoke.single import one_process

DESCRIPTION = ("The GPU smoke test: does the NCCL/CUDA path work on this node, and how fast are "
               "its parts?")


def make_parser():
    parser = argparse.ArgumentParser(prog="python -m nanogeo.smoke", description=DESCRIPTION,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default="llama-600m", choices=list(model_lib.PRESETS))
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=2048)
    parser.add_argument("--numel", type=float, default=64e6, help="codec test tensor size")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the torch.compile'd codec and step (--no-compile: eager "
                             "only; on a CPU inductor's compile takes minutes)")
    parser.add_argument("--nproc", type=int, default=0,
                        help="make gpu-smoke: torchrun this many ranks (one per GPU) and run the "
                             "first-contact checks; 0: the single-process checks above")
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="--nproc: include the training check (train.py runs)")
    parser.add_argument("--timeout", type=float, default=480,
                        help="--nproc: seconds allowed for each torchrun (within --deadline)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="--nproc: seconds for the whole smoke test, its torchruns and "
                             "train.py runs together (default 600 on GPUs, 1200 on CPU ranks: "
                             "inductor compiles slowly on a CPU); what finds none left FAILs")
    parser.add_argument("--pg_timeout", type=float, default=120,
                        help="--nproc: seconds a rank's collective waits for the others before "
                             "the process group reports a hang (NCCL's watchdog names it)")
    parser.add_argument("--figures", action=argparse.BooleanOptionalAction, default=True,
                        help="--nproc on CUDA: also time the collectives against NCCL's bf16 "
                             "all_reduce and a llama-300m step (not checked; smoke.json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    if args.nproc:
        return first_contact(args)
    return one_process(args)
