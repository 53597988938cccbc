#!/bin/bash
# The 4-bit study's runs that need code newer than fourbit.sh's commit: error feedback on stage
# 2, the per-stage error decomposition (--log_stages), and the machine-sensitivity checks. Same
# machine, same thread count (OMP_NUM_THREADS=1), resumable, like fourbit.sh; its own out_dirs.
# From the repository root, after `python prepare_data.py --tokenizer char`.
#   1. stage-2 error feedback at W = 64 (6 seeds), with its own fp32 and NVFP4 references at
#      this commit (seeds 0-5: bit for bit fourbit.sh's, if the code did not change them)
#   2. the decomposition: stage 1 vs stage 2, each against the mean's sampling noise, in L2 and
#      as Muon and AdamW see it, at W = 32, 64 (2 seeds) and 128 (1 seed)
#   3. sensitivity: the same runs with 2 threads instead of 1, and compiled (torch.compile
#      rounds differently): does any rounding change move a 4-bit run as far as a method's gap?
set -e
export OMP_NUM_THREADS=1
FLAGS="--preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25 --tail_evals=12 --muon_lr=3e-2"
study() { python -m nanogeo.tools.study --optimizers muon "$@"; }

study --comms fp32,nvfp4,nvfp4-ef2,hadamard16-nvfp4-all-ef2,subspace-nvfp4-ef2,nvfp4-ef12 --workers 64 --seeds 0,1,2,3,4,5 --out_dir out/fourbit2 -- $FLAGS
study --comms nvfp4,subspace-nvfp4,hadamard16-nvfp4-all,nvfp4-ef2 --workers 32,64 --seeds 0,1 --out_dir out/fourbit-stages -- $FLAGS --log_stages
study --comms nvfp4,subspace-nvfp4 --workers 128 --seeds 0 --out_dir out/fourbit-stages -- $FLAGS --log_stages
OMP_NUM_THREADS=2 study --comms fp32,nvfp4,subspace-nvfp4 --workers 32 --seeds 0,1,2 --out_dir out/fourbit-threads2 -- $FLAGS
study --comms fp32,nvfp4,subspace-nvfp4 --workers 32 --seeds 0,1,2 --out_dir out/fourbit-compile -- $FLAGS --compile
