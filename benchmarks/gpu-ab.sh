#!/usr/bin/env bash
# The 80b suite's batched run for an older commit and this tree, alternating old / new / old / new in one device
# session (ratios between machines move with their hosts, so old against new is only measured on one machine).
#
#   bash benchmarks/gpu-ab.sh stage REV    # here: REV's tree (no models or results) into .ab-old/ (git-ignored)
#   # on the device, after the staging calls, with .ab-old in the call's carry:
#   setsid nohup bash benchmarks/gpu-ab.sh run > /root/ab.nohup 2>&1 < /dev/null &
#   OUT=$OUT bash benchmarks/gpu-queue.sh poll 540    # back to back until DONE
#
# ARGS (default the 80b suite's B=32 K=3 run) goes to `python -m $MODULE` (default mtp_engine.bench; jobs.bench for a
# job) in both trees, so it must mean the same in both; results: /root/res/$NAME-{old,new}-{1,2}.json and .out (NAME:
# ab, or ab-job as h200.sh sets it, so the two suites in one queue keep their files apart). As a
# suite of gpu-queue.sh, with .ab-old in the call's carry: "ab" (the default ARGS) or "ab-job ROUNDS=4" (h200.sh sets
# MODULE and ARGS; a queue suite's VAR=VALUE cannot carry an ARGS with spaces).
set -u
case "${1:?stage REV or run}" in
  stage)
    root=$(git rev-parse --show-toplevel); cd "$root"
    grep -qx '/.ab-old/' .git/info/exclude 2>/dev/null || echo '/.ab-old/' >> .git/info/exclude
    rm -rf .ab-old && mkdir .ab-old
    git archive "${2:?a commit}" | tar x -C .ab-old --exclude=models --exclude=benchmarks/results
    du -sh .ab-old ;;
  run)
    args=${ARGS:-"--synthetic 80b --suite dataset --acceptance-profile 0.93,0.82,0.64 --max-tokens 128 --contexts 1024
      --limit 32 --batch-sizes 32 --draft-tokens 3 --single-k 3 --single-limit 1 --single-rounds 2 --batch-rounds 2
      --no-mlx-lm-batch"}
    res=/root/res; mkdir -p $res; rm -f $res/DONE
    if [ -f .mlx-ptx/ptx.tgz ] && [ ! -d /tmp/mlx ]; then tar xzf .mlx-ptx/ptx.tgz -C /tmp; fi
    if [ -f .mlx-ptx/nv.tgz ] && [ ! -d "$HOME/.nv" ]; then tar xzf .mlx-ptx/nv.tgz -C "$HOME"; fi
    rm -rf /root/ab && mkdir -p /root/ab/new && cp -r .ab-old /root/ab/old
    tar cf - --exclude=./.gpu-stage --exclude=./.venv --exclude=./.ab-old . | tar xf - -C /root/ab/new
    for i in 1 2; do
      for side in old new; do
        dir=/root/ab/$side
        echo "$(date +%T) start $side $i" >> $res/queue.log
        # shellcheck disable=SC2086
        (cd $dir && PYTHONPATH=/root/site:$dir timeout "${LIMIT:-170}" python3 -u -m "${MODULE:-mtp_engine.bench}" $args \
          --json "$res/${NAME:-ab}-$side-$i.json" > "$res/${NAME:-ab}-$side-$i.out" 2>&1)
        rc=$?
        echo "$(date +%T) end $side $i rc=$rc" >> $res/queue.log
      done
    done
    [ "${QUEUED:-0}" = 1 ] || touch $res/DONE ;;  # in gpu-queue.sh's queue (h200.sh ab) the queue ends with DONE
  *) echo "unknown command $1" >&2; exit 2 ;;
esac
