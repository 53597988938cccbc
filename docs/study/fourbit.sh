#!/bin/bash
# The 4-bit study (BENCHMARKS.md section 14, "4 bits on one machine"): can any 4-bit wire train
# as well as fp32 at many ranks? Every arm that a comparison pairs runs on one machine, at one
# commit and one thread count (OMP_NUM_THREADS=1: the thread count changes the rounding), so the
# study driver's tables pair only runs of that machine. Resumable: a finished run is skipped, so
# run this again to continue. From the repository root, after
# `python prepare_data.py --tokenizer char`. Results: out/fourbit/results.json, copied to
# docs/study/fourbit/ as they come.
#
# LANE=a or LANE=b runs one half (two processes, one per core of a 2-core machine; they share
# out/fourbit, whose results.json is locked); no LANE runs both halves one after the other.
# Order: what decides the README's 4-bit row first.
#   1. replication: fp32, bf16, nvfp4 and the rotation at 4 bits, W = 32 and 64, 12 seeds;
#      the two-stage FP8 collective beside them (6 seeds)
#   2. controls that act: the randomized Hadamard rotation (128- and 16-entry blocks) and the
#      rotation, forced on every candidate matrix (no gain check), 12 seeds
#   3. mechanism: W = 32 with twice the per-rank batch (W = 64's global batch), and W = 128
#   4. the 4-bit levers at W = 64: stochastic rounding (both stages, stage 1, stage 2), error
#      feedback, the rotation's rank and refresh, the NVFP4 recipe's 16-blocks + rounding
#   5. transfer: the decisive arms on char-wide (4 x 128), its Muon lr swept with fp32 first
set -e
export OMP_NUM_THREADS=1
LANE=${LANE:-ab}
FLAGS="--preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25 --tail_evals=12 --muon_lr=3e-2"
S12=0,1,2,3,4,5,6,7,8,9,10,11
study() { python -m nanogeo.tools.study --optimizers muon --out_dir out/fourbit "$@"; }

case $LANE in *a*)
study --comms fp32,bf16,nvfp4,subspace-nvfp4 --workers 32 --seeds $S12 -- $FLAGS
study --comms fp8 --workers 32 --seeds 0,1,2,3,4,5 -- $FLAGS
study --comms hadamard-nvfp4-all,hadamard16-nvfp4-all,subspace-nvfp4-all --workers 32 --seeds $S12 -- $FLAGS
# W = 32 with W = 64's global batch: its own group (other train flags), its own fp32
study --comms fp32,nvfp4,subspace-nvfp4 --workers 32 --seeds $S12 -- $FLAGS --batch_size=8 ;;
esac

case $LANE in *b*)
study --comms fp32,bf16,nvfp4,subspace-nvfp4 --workers 64 --seeds $S12 -- $FLAGS
study --comms fp8 --workers 64 --seeds 0,1,2,3,4,5 -- $FLAGS
study --comms hadamard-nvfp4-all,hadamard16-nvfp4-all,subspace-nvfp4-all --workers 64 --seeds $S12 -- $FLAGS ;;
esac

case $LANE in *a*)
study --comms fp32,nvfp4,subspace-nvfp4 --workers 128 --seeds 0,1,2,3,4,5 -- $FLAGS ;;
esac

case $LANE in *b*)
study --comms nvfp4-sr,nvfp4-sr1,nvfp4-sr2,nvfp4-ef,subspace-nvfp4-sr,subspace-nvfp4-ef --workers 64 --seeds 0,1,2,3,4,5 -- $FLAGS
study --comms subspace-nvfp4-r8,subspace-nvfp4-r32,subspace-nvfp4-refresh1,hadamard16-nvfp4-all-sr --workers 64 --seeds 0,1,2,3,4,5 -- $FLAGS ;;
esac

# transfer: char-wide, Muon's lr swept with fp32 first (2 seeds), then the decisive arms
WIDE="--preset=char-wide --max_iters=300 --eval_interval=300 --log_interval=25 --tail_evals=12"
case $LANE in *a*)
python -m nanogeo.tools.study --sweep muon_lr=1e-2,3e-2,6e-2 --optimizers muon --workers 32 --seeds 0,1 --out_dir out/fourbit-wide-sweep -- $WIDE
python -m nanogeo.tools.study --comms fp32,bf16,nvfp4,subspace-nvfp4 --optimizers muon --workers 32 --seeds 0,1,2,3 --lr_from out/fourbit-wide-sweep/sweep.json --out_dir out/fourbit-wide -- $WIDE ;;
esac
