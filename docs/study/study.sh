#!/bin/bash
# The many-simulated-worker study of BENCHMARKS.md section 14, as it was run (resumable: finished
# runs are skipped). From the repository root, after `python prepare_data.py --tokenizer char`.
set -e
COMMON="--workers 32 --seeds 0,1,2 --out_dir out/study -- --preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25"
python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper,geofp8-paper,fp8-paper-ef,bf16 --optimizers adamw $COMMON
python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper,geofp8-paper --optimizers muon $COMMON
python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper-all --optimizers adamw $COMMON
