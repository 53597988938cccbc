#!/bin/bash
# Behaviour is unchanged by a refactor: run this on the old and the new code and compare.
#
#     bash docs/identity.sh /tmp/old      # on the old commit (e.g. in a git worktree)
#     bash docs/identity.sh /tmp/new      # on the new one
#     diff -r /tmp/old /tmp/new && echo identical
#
# It writes fidelity reports (every coordinate system, both collectives, FP8 and NVFP4, error
# feedback, stochastic rounding; update errors under Muon) and the logs of short 2-rank training
# runs (torchrun, gloo) and one simulated-rank run. Wall-clock fields (dt, tok/s, time) are
# removed from the logs: everything else must match byte for byte. About 3 minutes on 2 cores.
set -e
D=${1:?usage: bash docs/identity.sh OUT_DIR}
mkdir -p "$D"
export OMP_NUM_THREADS=1
python -m nanogeo.lab.capture --out="$D/grads.pt" --preset=char-study --data_dir=data/shakespeare_char \
    --workers=8 --train_steps=30 --capture_steps=4 --optimizer=muon --muon_lr=3e-2 > /dev/null
METHODS=bf16,fp8-block,fp8-tensor,fp8-paper,geofp8,geofp8-paper,subspace,subspace-full,hadamard
METHODS=$METHODS,hadamard-paper,nvfp4,geo-nvfp4,subspace-nvfp4,hadamard-nvfp4
METHODS=$METHODS,subspace:error_feedback=True
python -m nanogeo.lab.fidelity "$D/grads.pt" --methods "$METHODS" --per_step --last 3 > "$D/fidelity.txt"
rm "$D/grads.pt"

# keep a log line's and record's numbers, drop its wall-clock ones
untimed() {
    sed -E 's/ \| dt [0-9]+ms \| tok\/s [0-9]+//; s/ \| [0-9.]+s \([0-9]+ms\/step\)//' "$1/stdout" > "$1/stdout.untimed"
    python - "$1" <<'PY'
import json, sys
drop = {"dt_ms", "tok_per_s", "mfu", "time_s", "ms_per_step"}
def clean(x):
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items() if k not in drop}
    return x
d = sys.argv[1]
with open(f"{d}/log.jsonl") as f, open(f"{d}/log.untimed.jsonl", "w") as out:
    for line in f:
        out.write(json.dumps(clean(json.loads(line))) + "\n")
PY
    rm -f "$1/log.jsonl" "$1/stdout" "$1"/ckpt*.pt
}
COMMON="--preset=char-study --max_iters=24 --eval_interval=12 --eval_iters=2 --log_interval=4 --geo_warmup=4 --geo_refresh=4"
run() {  # name, flags...
    local name=$1; shift
    torchrun --standalone --nproc_per_node=2 train.py $COMMON --out_dir="$D/$name" "$@" > "$D/$name.stdout" 2>/dev/null
    mv "$D/$name.stdout" "$D/$name/stdout"; untimed "$D/$name"
}
run subspace --comm=subspace --geo_layers=all --error_feedback --optimizer=muon
run whiten-paper --comm=geofp8 --collective=fp8-sum --fmt=e5m2 --block=tensor --geo_layers=all
run hadamard-nvfp4 --comm=hadamard --fmt=nvfp4 --geo_layers=all
run gain --comm=geofp8 --optimizer=muon --stochastic_round
python train.py $COMMON --out_dir="$D/simulated" --comm=subspace --simulate_workers=8 > "$D/simulated.stdout"
mv "$D/simulated.stdout" "$D/simulated/stdout"; untimed "$D/simulated"
sed -i "/^config:/d; /^model:/d; s|$D|OUT|g" "$D"/*/stdout.untimed "$D"/*/log.untimed.jsonl  # out_dir
# the README's what-to-run arms and the paper's collective, on the fast path with simulated
# ranks (flags as nanogeo/lab/study/arms.py names them): each run's log must match byte for byte
arm() {  # name, flags...
    local name=$1; shift
    python train.py $COMMON --out_dir="$D/arm-$name" --simulate_workers=4 --optimizer=muon "$@" \
        > "$D/arm-$name.stdout"
    mv "$D/arm-$name.stdout" "$D/arm-$name/stdout"; untimed "$D/arm-$name"
}
arm fp8 --comm=fp8
arm subspace --comm=subspace
arm geofp8 --comm=geofp8
arm nvfp4 --comm=fp8 --fmt=nvfp4
arm nvfp4-e4m3s2-ef1 --comm=fp8 --fmt=nvfp4 --stage2_fmt=e4m3 --error_feedback --feedback_stages=1
arm nvfp4-ef12 --comm=fp8 --fmt=nvfp4 --error_feedback --feedback_stages=both
arm fp8-paper --comm=fp8 --fmt=e5m2 --block=tensor --collective=fp8-sum
sed -i "/^config:/d; /^model:/d; s|$D|OUT|g" "$D"/arm-*/stdout.untimed "$D"/arm-*/log.untimed.jsonl
