#!/bin/bash
# The cross-commit recheck (issue 59, item 5). A study pairs each seed's arms on one machine,
# but some pairs join runs made at two commits: the mixed study's arms (ddcb53b) and the namesake
# study's nvfp4-e4m3s2 (44f2bc0) with the namesake arms of 06360f0 (docs/study/namesake,
# docs/study/mixed); the first study's later arms (489b55b, 65f0122, c37b508) with its fp32, bf16,
# fp8 and nvfp4 of d921664 (AdamW) and 3b4294b (Muon) (docs/study/results.json; the fourbit
# study's two commits have their own check, docs/study/fourbit/recheck.json). A pair across two
# commits is a pair of one commit if the two commits train the arm to the same bits. This reruns
# on one machine, at every commit of such a pair, the arms the other commit's runs are compared
# with (at each W used; one seed), and compares the endpoints to the last bit - and the runs at
# a study's own commit with its recorded ones (made on another machine, where recorded):
#   STUDY=mixed  06360f0, ddcb53b: fp32 and bf16 at W = 32 and 64, nvfp4 at W = 32;
#                06360f0, 44f2bc0: fp32, bf16 and nvfp4 at W = 32;
#                44f2bc0, ddcb53b: nvfp4-e4m3s2 at W = 32 (its seeds ran at both)
#                                                              (seed 12, Muon, both endpoints)
#   STUDY=first  d921664, 489b55b, 65f0122, c37b508: fp32, bf16, fp8, nvfp4 (seed 0, AdamW);
#                3b4294b, 489b55b, 65f0122, c37b508: the same (seed 0, Muon)     (W = 32; the
#                first study recorded the final val loss only). Not rechecked: its arms whose
#                seeds are split over two of those commits (geofp8, subspace, fp8-ef and the
#                4-bit geometry arms) - only the baselines they are compared with.
#
# From main's root (worktrees of the commits are made next to it; main's .venv serves them, as
# train.py imports from its cwd; one process per core of a 2-core machine):
#   STUDY=mixed LANE=a bash docs/study/recheck.sh & STUDY=mixed LANE=b bash docs/study/recheck.sh
#   wait; STUDY=mixed bash docs/study/recheck.sh compare      # -> docs/study/mixed/recheck.json
# (and STUDY=first: docs/study/first-recheck.json). Resumable: a finished run is skipped.
set -e
export OMP_NUM_THREADS=1
PY=${PY:-$PWD/.venv/bin/python}
ROOT=$PWD
STUDY=${STUDY:-mixed}
OUT=$ROOT/out/recheck/$STUDY
STEPS="--preset=char-study --max_iters=300 --eval_interval=300 --log_interval=25"
ARMS="fp32:--comm=fp32 bf16:--comm=bf16 fp8:--comm=fp8 nvfp4:--comm=fp8,--fmt=nvfp4
nvfp4-e4m3s2:--comm=fp8,--fmt=nvfp4,--stage2_fmt=e4m3"
case $STUDY in
  mixed)
    FLAGS="--optimizer=muon $STEPS --tail_evals=12 --muon_lr=3e-2"; SEED=12
    RECORDED="docs/study/namesake/results.json docs/study/mixed/results.json"
    TARGET=docs/study/mixed/recheck.json
    JOBS="06360f0,ddcb53b:32,64:fp32,bf16 06360f0,ddcb53b:32:nvfp4
44f2bc0,06360f0:32:fp32,bf16,nvfp4 44f2bc0,ddcb53b:32:nvfp4-e4m3s2" ;;
  first)
    SEED=0; RECORDED=docs/study/results.json; TARGET=docs/study/first-recheck.json
    JOBS="d921664,489b55b,65f0122,c37b508:32:fp32,bf16,fp8,nvfp4:adamw
3b4294b,489b55b,65f0122,c37b508:32:fp32,bf16,fp8,nvfp4:muon" ;;
  *) echo "STUDY must be mixed or first, got $STUDY" >&2; exit 2 ;;
esac

flags_of() {    # optimizer -> the study's flags (the first study's: no tail, AdamW at 3e-2)
  case $STUDY:$1 in
    mixed:muon) echo "$FLAGS" ;;
    first:adamw) echo "--optimizer=adamw --learning_rate=3e-2 $STEPS" ;;
    first:muon) echo "--optimizer=muon --muon_lr=3e-2 $STEPS" ;;
    *) echo "no flags for $STUDY:$1" >&2; exit 2 ;;
  esac
}

# one line per run: commit W arm optimizer
runs() {
  for job in $JOBS; do
    IFS=: read -r commits ws arms optimizer <<< "$job"
    for c in ${commits//,/ }; do for w in ${ws//,/ }; do for a in ${arms//,/ }; do
      echo "$c $w $a ${optimizer:-muon}"
    done; done; done
  done
}

run() {     # commit W arm optimizer
  local commit=$1 w=$2 arm=$3 optimizer=$4
  local tree=$ROOT/../recheck-$commit dir=$OUT/$commit/$optimizer/$arm/sim$w
  local comm=$(for a in $ARMS; do [ "${a%%:*}" = "$arm" ] && echo "${a#*:}" | tr , ' '; done)
  [ -n "$comm" ] || { echo "no flags for the arm $arm: add it to ARMS" >&2; exit 2; }
  local flags="--simulate_workers=$w --seed=$SEED $comm $(flags_of $optimizer)"
  [ -f "$dir/done.json" ] && grep -qF -- "\"$flags\"" "$dir/done.json" && return 0
  mkdir -p "$OUT"
  (   # one lane at a time makes a worktree; an existing one must be at its commit
    flock 9
    [ -d "$tree" ] || { git worktree add -f "$tree" "$commit" > /dev/null &&
                        ln -sfn "$ROOT/data" "$tree/data"; }
  ) 9> "$OUT/worktrees.lock"
  [ "$(git -C "$tree" rev-parse --short=7 HEAD)" = "$commit" ] ||
    { echo "$tree is not at $commit" >&2; exit 2; }
  mkdir -p "$dir"
  (cd "$tree" && $PY train.py --out_dir="$dir/run" --overwrite=true $flags > "$dir/stdout" 2>&1)
  $PY - "$dir" "$commit" "$w" "$arm" "$optimizer" "$SEED" "$flags" <<'PYEOF'
import json, sys
import torch
d, commit, w, arm, optimizer, seed, flags = sys.argv[1:]
summary = [r["summary"] for r in map(json.loads, open(f"{d}/run/log.jsonl")) if "summary" in r][-1]
info = dict(l.split(":", 1) for l in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
            if ":" in l)
info = {k.strip(): v.strip() for k, v in info.items()}
json.dump({"commit": commit, "workers": int(w), "arm": arm, "optimizer": optimizer,
           "seed": int(seed), "flags": flags, "final_val_loss": summary["final_val_loss"],
           "tail_val_loss": summary.get("tail_val_loss"),
           "machine": f"{info['model name']} (family {info['cpu family']}, model {info['model']}),"
                      f" torch {torch.__version__}, OMP_NUM_THREADS 1"},
          open(f"{d}/done.json", "w"), indent=1)
PYEOF
}

if [ "${1:-}" = compare ]; then
  $PY - "$OUT" "$TARGET" $RECORDED <<'PYEOF'
import glob, itertools, json, sys
out, target, recorded_files = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = sorted((json.load(open(f)) for f in glob.glob(f"{out}/**/done.json", recursive=True)),
              key=lambda r: (r["optimizer"], r["arm"], r["workers"], r["commit"]))
recorded = [r for f in recorded_files for r in json.load(open(f)) if not r.get("sweep")]
ENDPOINTS = [k for k in ("final_val_loss", "tail_val_loss") if runs and runs[0][k] is not None]
assert all((r["tail_val_loss"] is None) == (runs[0]["tail_val_loss"] is None) for r in runs)
same_arm = lambda r: (r["optimizer"], r["arm"], r["workers"])
pairs, against = [], []
for key, group in itertools.groupby(runs, key=same_arm):
    group = list(group)
    for a, b in itertools.combinations(group, 2):       # every two commits of one arm
        equal = all(a[k] == b[k] for k in ENDPOINTS)
        pairs.append({"commits": [a["commit"], b["commit"]], "optimizer": key[0], "arm": key[1],
                      "workers": key[2], "seed": a["seed"],
                      **{k: [a[k], b[k]] for k in ENDPOINTS}, "bit_equal": equal})
        print(f"{key[0]} {key[1]:5s} W = {key[2]}: {a['commit']} {a['final_val_loss']!r} vs "
              f"{b['commit']} {b['final_val_loss']!r} -> {'equal' if equal else 'DIFFERENT'}")
for r in runs:      # against the study's own record of the run (another machine)
    for x in recorded:
        if (x["optimizer"], x["comm"], x["workers"], x["seed"], x["commit"][:7]) == (
                r["optimizer"], r["arm"], r["workers"], r["seed"], r["commit"]):
            equal = all(x.get(k) == r[k] for k in ENDPOINTS)
            against.append({"commit": r["commit"], "optimizer": r["optimizer"], "arm": r["arm"],
                            "workers": r["workers"], "seed": r["seed"],
                            "recorded_machine": x.get("machine", "not recorded"),
                            **{k: [x.get(k), r[k]] for k in ENDPOINTS}, "bit_equal": equal})
            print(f"{r['optimizer']} {r['arm']:5s} W = {r['workers']} at {r['commit']}: recorded "
                  f"{x['final_val_loss']!r}, here {r['final_val_loss']!r} -> "
                  f"{'equal' if equal else 'different'}")
json.dump({"machine": runs[0]["machine"] if runs else None, "endpoints": ENDPOINTS,
           "pairs": pairs, "against_recorded": against, "runs": runs},
          open(target, "w"), indent=1)
print(f"{sum(p['bit_equal'] for p in pairs)} of {len(pairs)} commit pairs bit-equal -> {target}")
PYEOF
  exit 0
fi

runs | awk -v lane="${LANE:-ab}" '{ l = (NR % 2) ? "a" : "b"; if (index(lane, l)) print }' |
while read -r commit w arm optimizer; do
  run "$commit" "$w" "$arm" "$optimizer"
done
