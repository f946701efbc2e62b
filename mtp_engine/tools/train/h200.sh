#!/usr/bin/env bash
# The shipped model's training on one GPU machine, run from the project root
# with PyTorch (the H200 image's python3); docs: models/qwen3-next-tiny-stdlib/README.md.
#
#   bash mtp_engine/tools/train/h200.sh start RUNS FIT_S SMALL_S DISTILL_S
#       detached (setsid): fit the small and medium presets for SMALL_S seconds and the large one for
#       FIT_S seconds, all at once; then distill the head of the run with the lowest held-out
#       perplexity for DISTILL_S seconds; RUNS/DONE at the end. Data: $DATA (default .train-data,
#       prepare's outputs; train.npy may be train.npy.xz).
#   bash mtp_engine/tools/train/h200.sh tune RUNS SOURCE TUNE_S DISTILL_S
#       detached: continue the fit of SOURCE (a model folder, run or portable copy) for TUNE_S seconds
#       with sequence-level unlikelihood on its looping greedy continuations (RUNS/tune), then distill
#       the head for DISTILL_S seconds (RUNS/distill); RUNS/DONE at the end.
#   bash mtp_engine/tools/train/h200.sh poll RUNS SECONDS
#       wait up to SECONDS (less if RUNS/DONE appears), then copy into $OUT the logs' tails
#       (logs.txt), every fit's progress (scaling.json) and a bfloat16 copy of the newest step of
#       the run in progress (p/), so a lost machine costs only the minutes since the last poll.
#   bash mtp_engine/tools/train/h200.sh resume RUNS PORTABLE KIND ...
#       on a fresh machine: continue a run from a portable copy brought back by poll
#       (KIND fit: FIT_S; KIND distill: DISTILL_S), detached.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
train="python3 -m mtp_engine.train"
data=${DATA:-.train-data}
cmd=${1:?start, poll or resume}
runs=${2:?RUNS folder}
mkdir -p "$runs"

pipeline() {  # FIT_S SMALL_S DISTILL_S [RESUME_FIT]
  local fit_s=$1 small_s=$2 distill_s=$3 resume=${4:-} p
  for p in small medium; do
    [ -n "$resume" ] && break
    $train fit --preset $p --data "$data" --out "$runs/fit-$p" --steps 1000000 --max-seconds "$small_s" \
      --eval-every 1000 >/dev/null 2>&1 &
  done
  $train fit --preset large --data "$data" --out "$runs/fit-large" --steps 1000000 --max-seconds "$fit_s" \
    --eval-every 1000 ${resume:+--resume "$resume"} >/dev/null 2>&1 &
  wait
  best=$($train best "$runs"/fit-*)
  echo "$best" > "$runs/BEST"
  $train distill --source "$best" --data "$data" --out "$runs/distill" --steps 1000000 --max-seconds "$distill_s" \
    --pool-sequences 6144 --regenerate-every 300 --eval-every 500 >/dev/null 2>&1
  touch "$runs/DONE"
}

case $cmd in
  tune)
    source=${3:?SOURCE folder}
    setsid bash -c "$train fit --resume $source --data $data --out $runs/tune --steps 1000000 \
        --max-seconds ${4:-300} --lr 5e-4 --min-lr 5e-5 --warmup 50 --eval-every 200 --unlikelihood 1.0 \
        --ul-batch 64 --prefix-len 64 --new-tokens 128 --pool-sequences 8192 --regenerate-every 100 >/dev/null 2>&1; \
      $train distill --source $runs/tune --data $data --out $runs/distill --steps 1000000 --max-seconds ${5:-360} \
        --pool-sequences 6144 --regenerate-every 300 --eval-every 500 >/dev/null 2>&1; touch $runs/DONE" \
      > "$runs/pipeline.log" 2>&1 < /dev/null &
    echo "tune started (pid $!), runs in $runs" ;;
  start)
    export -f pipeline; export runs data train
    setsid bash -c "pipeline ${3:-780} ${4:-360} ${5:-360}" > "$runs/pipeline.log" 2>&1 < /dev/null &
    echo "pipeline started (pid $!), runs in $runs" ;;
  resume)
    portable=${3:?PORTABLE folder}; kind=${4:?fit or distill}
    export -f pipeline; export runs data train
    if [ "$kind" = fit ]; then
      setsid bash -c "pipeline ${5:-600} 0 ${6:-360} $portable" > "$runs/pipeline.log" 2>&1 < /dev/null &
    else
      setsid bash -c "$train distill --source $portable --resume $portable --data $data --out $runs/distill \
        --steps 1000000 --max-seconds ${5:-360} --pool-sequences 6144 --regenerate-every 300 --eval-every 500 \
        >/dev/null 2>&1; touch $runs/DONE" > "$runs/pipeline.log" 2>&1 < /dev/null &
    fi
    echo "resumed ($kind)" ;;
  poll)
    end=$((SECONDS + ${3:-540}))
    while [ $SECONDS -lt $end ] && [ ! -f "$runs/DONE" ]; do sleep 10; done
    out=${OUT:-/tmp/poll}; mkdir -p "$out"
    for f in "$runs"/pipeline.log "$runs"/*/train.log; do
      [ -f "$f" ] && { echo "== $f"; tail -n 25 "$f"; }
    done > "$out/logs.txt"
    python3 - "$runs" > "$out/scaling.json" <<'PY'
import json, sys
from pathlib import Path
from mtp_engine.tools.train.checkpoint import latest_step
out = {}
for run in sorted(Path(sys.argv[1]).glob("*/")):
    step = latest_step(run)
    if step is not None:
        progress = json.loads((step / "progress.json").read_text())
        progress.pop("optimizer_state", None)
        out[run.name] = {"config": json.loads((run / "config.json").read_text()), **progress}
print(json.dumps(out, indent=1))
PY
    current=$runs/distill
    [ -f "$current/latest" ] || current=$runs/tune
    [ -f "$current/latest" ] || current=$runs/fit-large
    [ -f "$current/latest" ] && $train portable "$current" "$out/p" > /dev/null
    ls -la "$out" "$out/p" 2>/dev/null; cat "$out/logs.txt" | grep -v '^$' | tail -n 40
    [ -f "$runs/DONE" ] && echo "DONE" ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
