#!/bin/bash
# The many-worker study (issue 13), in priority order; resumable (finished runs are skipped).
cd /work/main && source .venv/bin/activate
COMMON="--workers 32 --seeds 0,1,2 --out_dir out/study -- --preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25"
python -m nanogeo.ablate --comms fp32,fp8-paper --optimizers adamw $COMMON
python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper,geofp8-paper,fp8-paper-ef,bf16 --optimizers adamw $COMMON
python -m nanogeo.ablate --comms fp32,fp8-paper,subspace-paper,geofp8-paper --optimizers muon $COMMON
python -m nanogeo.ablate --comms fp32,e5m2-tensor --optimizers adamw $COMMON
echo STUDY DONE
