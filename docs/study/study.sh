#!/bin/bash
# The many-simulated-worker study of BENCHMARKS.md section 14, as it was run (resumable: finished
# runs are skipped). From the repository root, after `python prepare_data.py --tokenizer char`.
set -e
COMMON="--workers 32 --seeds 0,1,2 --out_dir out/study -- --preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25"
python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper,geofp8-paper,fp8-paper-ef,bf16 --optimizers adamw $COMMON
python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper,geofp8-paper --optimizers muon $COMMON
python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper-all --optimizers adamw $COMMON
# Muon: error feedback and bf16. The first command was stopped during subspace-paper-all's
# seed 1 (5.8 s a step on the loaded machine) to free the CPU; the second finished the grid.
python -m nanogeo.ablate --comms fp32,fp8-paper,fp8-paper-ef,bf16,subspace-paper-all --optimizers muon $COMMON
python -m nanogeo.ablate --comms fp32,fp8-paper,fp8-paper-ef,bf16 --optimizers muon $COMMON
