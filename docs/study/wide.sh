#!/bin/bash
# The char-wide study (issue 57): does the what-to-run table, found on char-study (0.12M, width
# 64), hold on the wider char-wide (0.82M, 4 layers of width 128)? Its plan - arms, seeds,
# hypotheses, family, margin - is docs/study/plan.md's "char-wide" entry, committed before the
# first run. Muon, 32 simulated ranks, 300 steps, the studies' flags.
#
# From the root of a worktree of the commit the runs run at (the numerics must not move under a
# running study; main's .venv serves it, since train.py and the driver import from their cwd):
#   git worktree add ../wide COMMIT && cd ../wide && ln -s ../main/data data
#   STEP=sweep LANE=a bash docs/study/wide.sh & STEP=sweep LANE=b bash docs/study/wide.sh
#   LANE=a bash docs/study/wide.sh & LANE=b bash docs/study/wide.sh       (the arms)
#   STEP=publish bash docs/study/wide.sh      (any time: what has finished, into $RESULTS)
# One process per core of a 2-core machine. Resumable: a finished run is skipped, so run it
# again to continue. Every run lands in out/wide/MACHINE/ (MACHINE: a hash of the CPU, torch
# and thread count, nanogeo.lab.study.runs.machine), so the arms of one seed run on one machine;
# a seed whose arms were begun on another machine is run whole again here. After each run the
# records of every machine are merged into $RESULTS (main's docs/study/wide/results.json).
set -e
export OMP_NUM_THREADS=1
LANE=${LANE:-ab}
STEP=${STEP:-arms}
PY=${PY:-python}
FLAGS="--preset=char-wide --max_iters=300 --eval_interval=300 --log_interval=25 --tail_evals=12"
# Muon's rate for every arm, fixed from the sweep below (its best value; see plan.md): 1e-2,
# mean final val loss of seeds 0 and 1 1.4960 - against 5e-3 1.5230, 2e-2 1.5010, 3e-2 1.5138,
# 6e-2 1.5834, 1e-1 1.6456 (docs/study/wide/results.json, this machine: cfcbb4dc)
MUON_LR=${MUON_LR:-1e-2}
ARMS=fp32,bf16,fp8,subspace,fp8-paper,geofp8-paper,nvfp4-e4m3s2-ef1,nvfp4-ef12
MACHINE=$($PY -c "import hashlib; from nanogeo.lab.study.runs import machine; \
print(hashlib.sha1(machine().encode()).hexdigest()[:8])")
OUT=out/wide/$MACHINE
RESULTS=${RESULTS:-../main/docs/study/wide/results.json}
study() { $PY -m nanogeo.lab.study --optimizers muon --workers 32 "$@"; }
lanes() { case $LANE in *a*) echo a ;; esac; case $LANE in *b*) echo b ;; esac; }

# every machine's records in one file: this machine's replace what the file held of them
publish() {
  mkdir -p "$(dirname "$RESULTS")"
  $PY - "$OUT" "$RESULTS" <<'EOF'
import fcntl, glob, json, os, sys
out, results = sys.argv[1], sys.argv[2]
with open(os.path.join(out, "publish.lock"), "w") as lock:     # the lanes publish in turn
    fcntl.flock(lock, fcntl.LOCK_EX)
    kept = json.load(open(results)) if os.path.exists(results) else []
    mine = [r for f in glob.glob(os.path.join(out, "**", "results.json"), recursive=True)
            for r in json.load(open(f))]
    ours = lambda r: any(a.startswith(f"--out_dir={out}/") for a in r["command"])
    records = [r for r in kept if not ours(r)] + mine
    records.sort(key=lambda r: (bool(r.get("sweep")), r["seed"], r["comm"], str(r.get("sweep"))))
    json.dump(records, open(results + ".tmp", "w"), indent=1)
    os.replace(results + ".tmp", results)
EOF
}

# exit 0 when another machine ran every arm of this seed (then it is not run again here)
complete_elsewhere() {
  [ -f "$RESULTS" ] || return 1
  $PY - "$1" "$ARMS" "$OUT" "$RESULTS" <<'EOF'
import json, sys
seed, arms, out, results = int(sys.argv[1]), set(sys.argv[2].split(",")), sys.argv[3], sys.argv[4]
by_machine = {}
for r in json.load(open(results)):
    if r["seed"] == seed and not r.get("sweep") and not any(
            a.startswith(f"--out_dir={out}/") for a in r["command"]):
        by_machine.setdefault(r["machine"], set()).add(r["comm"])
sys.exit(0 if any(arms <= done for done in by_machine.values()) else 1)
EOF
}

# STEP=publish: merge what has finished so far into $RESULTS (the runs write their own
# results.json after each run; the lanes publish after each seed)
[ "$STEP" = publish ] && { publish; exit 0; }

if [ "$STEP" = sweep ]; then
  # 1. fp32 at five rates, seeds 0 (lane a) and 1 (lane b)
  for lane in $(lanes); do
    study --seeds $(case $lane in a) echo 0 ;; b) echo 1 ;; esac) \
          --sweep muon_lr=${GRID:-1e-2,2e-2,3e-2,6e-2,1e-1} --out_dir $OUT/sweep -- $FLAGS
    publish
  done
  exit 0
fi

# STEP=next (one lane per process, LANE=a or b): the plan's rule carried out - while the
# sweep's best rate is the lowest swept (best_at_edge in sweep.json), extend the grid below it
# (5e-3, 3e-3, 2e-3, 1e-3; the high end lost by far: 1e-1 is the worst), waiting for the other
# lane's seed; then the arms at the best rate.
best() {
  $PY - "$OUT/sweep/sweep.json" "$1" <<'EOF'
import json, sys
sweep = json.load(open(sys.argv[1]))["sweeps"][0]
done = [v for v in sweep["values"] if len(v["final_val_loss"]) == 2]     # both seeds
low = min(done, key=lambda v: float(v["value"]))
pick = min(done, key=lambda v: v["mean"])
print(("extend" if pick is low and sweep["best_at_edge"] else pick["value"])
      if sys.argv[2] == "decide" else pick["value"])
EOF
}
# every value swept on both seeds (sweep.json keeps the seeds all values share)
both_seeds() {
  [ "$($PY -c "import json; s = json.load(open('$OUT/sweep/sweep.json'))['sweeps'][0]
print(all(len(v['final_val_loss']) == 2 for v in s['values']))")" = True ]
}
if [ "$STEP" = next ]; then
  for low in 5e-3 3e-3 2e-3 1e-3; do
    until both_seeds; do sleep 60; done
    [ "$(best decide)" = extend ] || break
    STEP=sweep GRID=$low,$(best pick) bash "$0"     # (the driver sweeps two values or more:
                                                    # the best so far, run already, is skipped)
  done
  # the last extension (1e-3, the grid's end) waits for the other lane's seed too: both lanes
  # pick from the same two seeds, so their arms run at one rate
  until both_seeds; do sleep 60; done
  MUON_LR=$(best pick)
  [ -n "$MUON_LR" ] || { echo "wide.sh: no rate swept on both seeds in $OUT/sweep"; exit 1; }
  MUON_LR=$MUON_LR STEP=arms bash "$0"
  exit 0
fi

[ -n "$MUON_LR" ] || { echo "wide.sh: set MUON_LR to the sweep's best rate (plan.md)"; exit 1; }
# 2. the eight arms, seed by seed: lane a seeds 12-17, lane b 18-23
for lane in $(lanes); do
  for seed in $(case $lane in a) echo 12 13 14 15 16 17 ;; b) echo 18 19 20 21 22 23 ;; esac); do
    complete_elsewhere $seed && continue
    study --comms $ARMS --seeds $seed --out_dir $OUT/arms -- $FLAGS --muon_lr=$MUON_LR
    publish
  done
done
