#!/bin/bash
# The per-step view of the char-wide study (issue 57): the error of the averaged gradient (relative
# L2) and of the update Muon takes from it, for each arm's wire, on gradients captured from each
# model - char-study and char-wide - after 200 steps of Muon at its tuned rate, 32 simulated
# workers, 4 steps (BENCHMARKS.md section 18's tools). What the rotation's room does with width
# is measured here, not guessed: at width 64 a rank-16 rotation covers a quarter of each side of
# a matrix, at width 128 an eighth.
#   MUON_LR_WIDE=<the sweep's best> bash docs/study/wide_fidelity.sh     (from the repository root)
# Writes out/wide-fidelity/{char-study,char-wide}.json (nanogeo.lab.fidelity --json).
set -e
export OMP_NUM_THREADS=1
OUT=${OUT:-out/wide-fidelity}
mkdir -p $OUT
# each arm of the study as the fidelity tool names its wire (error feedback over the 4 steps;
# the published method on every candidate matrix: its profiled choice of 4 needs a warm-up)
METHODS=bf16,fp8-block,subspace,fp8-paper,geofp8-paper:select=all
METHODS=$METHODS,nvfp4:stage2_fmt=e4m3:error_feedback=True:feedback_stages=1
METHODS=$METHODS,nvfp4:error_feedback=True:feedback_stages=both
for model in char-study:3e-2 char-wide:${MUON_LR_WIDE:?set MUON_LR_WIDE}; do
  preset=${model%%:*}; lr=${model#*:}
  python -m nanogeo.lab.capture --out $OUT/$preset.pt --preset=$preset \
      --data_dir=data/shakespeare_char --batch_size=4 --block_size=64 --optimizer=muon \
      --muon_lr=$lr --learning_rate=3e-3 --warmup_iters=20 --workers=32 --train_steps=200 \
      --capture_steps=4
  python -m nanogeo.lab.fidelity $OUT/$preset.pt --methods $METHODS \
      --json $OUT/$preset.json > $OUT/$preset.txt
  rm $OUT/$preset.pt
done
