#!/bin/bash
# The 4-bit study (BENCHMARKS.md section 14, "4 bits on one machine"), the runs as they ran: can
# any 4-bit wire train as well as fp32 at many ranks? Every arm that a comparison pairs ran on
# one machine, at one thread count (OMP_NUM_THREADS=1: another CPU rounds differently), so the
# study driver's tables pair only runs of that machine. Resumable: a finished run is skipped, so
# run this again to continue. From the repository root, after
# `python prepare_data.py --tokenizer char`. Results: out/fourbit/results.json (copied to
# docs/study/fourbit/results.json), out/fourbit-stages/results.json (docs/study/fourbit/stages.json).
#
# LANE=a or LANE=b runs one half (two processes, one per core of a 2-core machine; they share
# out/fourbit, whose results.json is locked); no LANE runs both halves one after the other.
# Parts 1 and 2 ran at commit b9807e5, parts 3 to 5 at 0949502; the two commits give the same
# numbers (part 5's recheck: fp32 seeds 0 and 1 and NVFP4 seed 1 at both, the results in
# docs/study/fourbit/recheck.json; NVFP4 seed 0 too, in part 4: --log_stages leaves a run unchanged).
# (Parts 3, W = 64's fp8 and W = 64's Hadamard-16 ran into their own out_dirs at 0949502; their
# records are merged into docs/study/fourbit/results.json: same flags and machine, one group.)
# Planned but not run (CPU time): W = 64 seeds 8-11, W = 64's other controls and levers, W = 32
# with W = 64's global batch, W = 128 training runs with their own fp32, stochastic rounding in
# stage 1 or both stages, the rotation's rank and refresh, the wider model (char-wide).
set -e
export OMP_NUM_THREADS=1
LANE=${LANE:-ab}
FLAGS="--preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25 --tail_evals=12 --muon_lr=3e-2"
study() { python -m nanogeo.tools.study --optimizers muon "$@"; }

# 1. replication: fp32, bf16, NVFP4 and the rotation at 4 bits; W = 32 12 seeds, W = 64 8; the
#    two-stage FP8 collective beside them (W = 32 6 seeds, W = 64 3)
case $LANE in *a*)
study --comms fp32,bf16,nvfp4,subspace-nvfp4 --workers 32 --seeds 0,1,2,3,4,5,6,7,8,9,10,11 --out_dir out/fourbit -- $FLAGS
study --comms fp8 --workers 32 --seeds 0,1,2,3,4,5 --out_dir out/fourbit -- $FLAGS ;;
esac
case $LANE in *b*)
study --comms fp32,bf16,nvfp4,subspace-nvfp4 --workers 64 --seeds 0,1,2,3,4,5,6,7 --out_dir out/fourbit -- $FLAGS
study --comms fp8 --workers 64 --seeds 0,1,2 --out_dir out/fourbit -- $FLAGS ;;
esac

# 2. controls that act, forced on every candidate matrix (no gain check): the randomized
#    Hadamard rotation (128- and 16-entry blocks) and the subspace rotation; W = 32, 6 seeds
case $LANE in *a*)
study --comms hadamard16-nvfp4-all,subspace-nvfp4-all,hadamard-nvfp4-all --workers 32 --seeds 0,1,2,3,4,5 --out_dir out/fourbit -- $FLAGS ;;
esac
case $LANE in *b*)
study --comms hadamard16-nvfp4-all --workers 64 --seeds 0,1,2,3 --out_dir out/fourbit -- $FLAGS ;;
esac

# 3. the levers on stage 2 (the re-quantized mean, the larger error: part 4): error feedback
#    alone and with the rotation, stochastic rounding; W = 32, 6 seeds, paired with part 1's fp32
#    and NVFP4
case $LANE in *b*)
study --comms nvfp4-ef2,subspace-nvfp4-ef2,nvfp4-sr2 --workers 32 --seeds 0,1,2,3,4,5 --out_dir out/fourbit -- $FLAGS ;;
esac
case $LANE in *a*)
study --comms nvfp4-ef2 --workers 64 --seeds 0,1,2,3 --out_dir out/fourbit -- $FLAGS ;;
esac

# 4. mechanism: the error of the mean by stage (--log_stages), against its sampling noise
case $LANE in *a*)
study --comms nvfp4,subspace-nvfp4,nvfp4-ef2 --workers 32 --seeds 0 --out_dir out/fourbit-stages -- $FLAGS --log_stages
study --comms nvfp4,subspace-nvfp4 --workers 64,128 --seeds 0 --out_dir out/fourbit-stages -- $FLAGS --log_stages ;;
esac

# 5. sensitivity: the same fp32 and NVFP4 runs at the other commit (recheck), compiled (other
#    roundings in the model's kernels) and with 2 threads
case $LANE in *b*)
study --comms fp32 --workers 32 --seeds 0,1 --out_dir out/fourbit-recheck -- $FLAGS
study --comms nvfp4 --workers 32 --seeds 1 --out_dir out/fourbit-recheck -- $FLAGS
study --comms fp32,nvfp4 --workers 32 --seeds 0,1 --out_dir out/fourbit-compile -- $FLAGS --compile
OMP_NUM_THREADS=2 study --comms nvfp4,fp32 --workers 32 --seeds 0 --out_dir out/fourbit-threads2 -- $FLAGS ;;
esac
