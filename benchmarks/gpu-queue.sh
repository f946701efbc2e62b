#!/usr/bin/env bash
# Several h200.sh suites in one device session, without the machine idling between them: `start` copies the tree
# to /root/repo and runs the suites one after another in a detached process (setsid), each into /root/res
# (its output in SUITE.out, the times in queue.log, DONE at the end); `poll` waits until DONE or SECONDS pass and
# brings /root/res back as $OUT/res.tgz. Call `poll` back to back (a machine idle ~30 s is given back) until it prints DONE.
#
#   bash benchmarks/gpu-queue.sh start tests tests-decoder job-80b "audit MODES=adaptive LIMIT=300"
#   bash benchmarks/gpu-queue.sh poll 540
#
# A suite is an h200.sh argument, then any VAR=VALUE it takes. At the end the MLX kernel cache comes back as
# $OUT/ptx.tgz: keep it in .mlx-ptx/ and carry it, and `start` unpacks it (the CUDA driver's, /root/res/nv.tgz, is too
# big to come back beside the results: `cp /root/res/nv.tgz $OUT` in a call of its own brings it). The first
# call installs MLX's CUDA build (../shared/gpu/stage-mlx-cuda.sh) before `start`; /root/res keeps earlier results
# until the machine goes back. A job suite ends rc=1 when some rows differ from plain batching's, as half-precision
# near-ties make them on a GPU: the audit suite says whether each parting is one.
set -u
res=/root/res
case "${1:?start SUITE... or poll SECONDS}" in
  start)
    shift
    mkdir -p "$res"
    rm -rf /root/repo && mkdir -p /root/repo
    tar cf - --exclude=./.gpu-stage --exclude=./.venv . | tar xf - -C /root/repo
    if [ -f .mlx-ptx/ptx.tgz ] && [ ! -d /tmp/mlx ]; then tar xzf .mlx-ptx/ptx.tgz -C /tmp; fi
    # the CUDA driver's cache of kernels built from that PTX, as a machine that ran jobs before keeps it
    if [ -f .mlx-ptx/nv.tgz ] && [ ! -d "$HOME/.nv" ]; then tar xzf .mlx-ptx/nv.tgz -C "$HOME"; fi
    rm -f "$res/DONE"
    script=/root/queue.sh
    {
      echo "cd /root/repo; export PYTHONPATH=/root/site:/root/repo OUT=$res"
      i=0
      for suite in "$@"; do
        read -r name vars <<< "$suite"
        i=$((i + 1))
        echo "echo \"\$(date +%T) start $i $name $vars\" >> $res/queue.log"
        echo "env $vars bash benchmarks/h200.sh $name > $res/$i-$name.out 2>&1; rc=\$?"
        echo "echo \"\$(date +%T) end $i $name rc=\$rc\" >> $res/queue.log"
      done
      echo "tar czf $res/ptx.tgz -C /tmp mlx 2>/dev/null; tar czf $res/nv.tgz -C \$HOME .nv 2>/dev/null; touch $res/DONE"
    } > "$script"
    setsid nohup bash "$script" > /root/queue.nohup 2>&1 < /dev/null &
    echo "started: $*" ;;
  poll)
    end=$((SECONDS + ${2:-540}))
    while [ ! -f "$res/DONE" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    # one file (a call brings back only a few), without the kernel caches: with them (~18 MB) it is too big to come
    # back; ptx.tgz (~3 MB) comes beside it, nv.tgz (~15 MB) stays on the machine
    tar czf "${OUT:?}/res.tgz" -C "$res" --exclude=./ptx.tgz --exclude=./nv.tgz .
    [ -f "$res/ptx.tgz" ] && cp "$res/ptx.tgz" "$OUT/"
    cat "$res/queue.log" 2>/dev/null
    for f in "$res"/*.out; do [ -f "$f" ] && { echo "== $f"; tail -n 6 "$f"; }; done
    [ -f "$res/DONE" ] && echo DONE ;;
  *) echo "unknown command $1" >&2; exit 2 ;;
esac
