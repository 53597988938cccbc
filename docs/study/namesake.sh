#!/bin/bash
# The namesake study (issue 44): does geometry-aware FP8 beat Euclidean FP8 on the two-stage
# collective, and which 4-bit method to run - at >= 24 seeds, every arm of a seed on one machine,
# back to back. Resumable: a finished run is skipped, so run this again to continue. From the
# repository root, after `python prepare_data.py --tokenizer char`. Results: out/namesake/results.json
# (copied to docs/study/namesake/results.json as they come; step 4's sweep to
# docs/study/namesake/adamw-sweep/), pooled with the earlier studies' (docs/study/results.json:
# the 4-bit study's machine, seeds 0-11, and older runs of unrecorded machines, never pooled) by
#   python -m nanogeo.tools.study --answer docs/study/namesake/results.json,docs/study/results.json ...
# Seeds 12-35 here, so no seed number is shared with the 4-bit study's machine: each seed is a
# block of its own, its arms paired on one CPU.
# It runs at commit 06360f0 (the code the 4-bit study's runs share); later commits changed the
# whitening's refresh (a subspace eigensolver), so continue it in a worktree of that commit:
#   git worktree add ../study 06360f0 && cd ../study && python prepare_data.py --tokenizer char
#   LANE=a bash ../main/docs/study/namesake.sh & LANE=b bash ../main/docs/study/namesake.sh
# Ran to the end on 2026-12-04 on one machine, AMD EPYC cpu family 25 model 17 (torch
# 2.13.0+cpu): steps 1-4 and the AdamW sweep at 06360f0, step 5 at 44f2bc0 (BENCHMARKS.md
# section 17; the results: docs/study/README.md).
#
# LANE=a (seeds 12-23) or LANE=b (seeds 24-35) runs one half: two processes, one per core of a
# 2-core machine, sharing out/namesake (its results.json is locked). The same flags as the
# 4-bit study (fourbit.sh), Muon at its tuned rate (muon_lr 3e-2, docs/study/sweep.md), so that
# the two studies' runs fall into one group per machine and their seeds can be pooled.
set -e
export OMP_NUM_THREADS=1
LANE=${LANE:-ab}
FLAGS="--preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25 --tail_evals=12 --muon_lr=3e-2"
OUT=${OUT:-out/namesake}
study() { python -m nanogeo.tools.study --optimizers muon --out_dir $OUT "$@"; }
seeds() { case $1 in a) echo 12,13,14,15,16,17,18,19,20,21,22,23 ;;
                    b) echo 24,25,26,27,28,29,30,31,32,33,34,35 ;; esac; }
lanes() { case $LANE in *a*) echo a ;; esac; case $LANE in *b*) echo b ;; esac; }

# 1. FP8, Muon, W = 32: fp32, bf16, Euclidean FP8 (two-stage e4m3), the rotation and the
#    published whitening on it - the README's first sentence
for lane in $(lanes); do
  study --comms fp32,bf16,fp8,subspace,geofp8 --workers 32 --seeds $(seeds $lane) -- $FLAGS
done
# 2. 4 bits, Muon, W = 32: NVFP4, the rotation on it, stage-2 error feedback (paired with 1's
#    fp32 and bf16)
for lane in $(lanes); do
  study --comms nvfp4,subspace-nvfp4,nvfp4-ef2 --workers 32 --seeds $(seeds $lane) -- $FLAGS
done
# 3. FP8, Muon, W = 64, 12 seeds: the five arms of 1
for lane in $(lanes); do
  study --comms fp32,bf16,fp8,subspace,geofp8 --workers 64 --seeds $(seeds $lane | cut -d, -f1-6) -- $FLAGS
done
# 4. AdamW, W = 32, 12 seeds: first an fp32 learning-rate sweep on the study's machine whose grid
#    reaches past the old best (3e-2 sat at the end of the first study's grid), seed 12 in lane
#    a, 13 in lane b; then the five arms of 1 at the swept rate (--lr_from). A lane waits for the
#    other's sweep runs (10 in all), then writes sweep.json from all of them (every run skipped).
AFLAGS="--preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25 --tail_evals=12"
SWEEP=${SWEEP:-out/adamw-sweep}
adamw() { python -m nanogeo.tools.study --optimizers adamw --workers 32 "$@" -- $AFLAGS; }
# done when every (rate, seed) pair of the grid has a run in $SWEEP
swept() { python -c "import json, sys; runs = {(r['sweep'][1], r['seed']) for r in json.load(open('$SWEEP/results.json'))}
sys.exit(len(runs & {(v, s) for v in '1e-2 2e-2 3e-2 6e-2 1e-1'.split() for s in (12, 13)}) < 10)" 2>/dev/null; }
for lane in $(lanes); do
  adamw --sweep learning_rate=1e-2,2e-2,3e-2,6e-2,1e-1 --seeds $(case $lane in a) echo 12 ;; b) echo 13 ;; esac) --out_dir $SWEEP
done
until swept; do echo "waiting for the other lane's sweep runs in $SWEEP"; sleep 60; done
adamw --sweep learning_rate=1e-2,2e-2,3e-2,6e-2,1e-1 --seeds 12,13 --out_dir $SWEEP
for lane in $(lanes); do
  adamw --lr_from $SWEEP/sweep.json --comms fp32,bf16,fp8,subspace,geofp8 --out_dir $OUT \
        --seeds $(seeds $lane | cut -d, -f1-6)
done
# 5. (not run by this script: the study's worktree is at 06360f0, which has no --stage2_fmt)
#    nvfp4-e4m3s2, W = 32, 12 seeds: the NVFP4 all-to-all with an e4m3 all-gather - what a
#    finer stage-2 format buys where stage 2's re-quantization is the larger error (0.41x bf16's
#    bytes on char-study at W = 32; NVFP4 0.29x, e4m3 0.52x). It ran from a worktree at 44f2bc0
#    (git worktree add ../study5 44f2bc0), same FLAGS and seeds, on the machine that ran 1-2
#    (pairs: nvfp4, fp32; nvfp4 seed 12 ends bit-equal at both commits), with the stage
#    decomposition over 4 seeds (docs/study/namesake/stages.json):
#      study --comms nvfp4-e4m3s2 --workers 32 --seeds $(seeds a | cut -d, -f1-6) -- $FLAGS  (and b)
#      study --comms nvfp4,nvfp4-e4m3s2 --workers 32 --seeds 12,13,24,25 --out_dir out/stages \
#            -- $FLAGS --log_stages
#    Not run yet: nvfp4-ef12 (feedback on both stages), W = 32, >= 12 seeds, from 06360f0:
#      study --comms nvfp4-ef12 --workers 32 --seeds $(seeds a | cut -d, -f1-6) -- $FLAGS
