#!/usr/bin/env bash
# The H200 benchmark runs behind the README's H200 table, one suite per call
# (each fits a 10-minute device call). Needs MLX's CUDA build on PYTHONPATH
# (../shared/gpu/stage-mlx-cuda.sh installs it into /root/site).
#
#   bash benchmarks/h200.sh shipped   # shipped model, all modes, batch B=1..32
#   bash benchmarks/h200.sh 80b       # 80B-A3B shapes, random 4-bit, 1K and 8K context
#   bash benchmarks/h200.sh 80b-batch # 80B-A3B shapes, batch mode at B = 1, 8, 16, 32
#   bash benchmarks/h200.sh cudnn     # shipped model, cuDNN attention on and off
#   bash benchmarks/h200.sh lossless  # shipped model, every mode vs mlx-lm greedy, bf16 and fp32
#   bash benchmarks/h200.sh compile   # shipped model, compiled decoder layers against eager ones
#   bash benchmarks/h200.sh 80b-compile # 80B-A3B shapes at 1K, compiled against eager
#   bash benchmarks/h200.sh lossless8 # shipped model, bf16, 8 prompts x every mode, with measured noise
#   bash benchmarks/h200.sh kernel    # CUDA recurrence kernel: its GPU tests, then the shipped model's chain modes
#   bash benchmarks/h200.sh kernel-80b # 80B-A3B shapes at 1K and 8K with the CUDA recurrence kernel
#   bash benchmarks/h200.sh lazy      # shipped model, chain modes with lazy chain drafts (one sync per step)
#   bash benchmarks/h200.sh lazy-80b  # 80B-A3B shapes at 1K, 8K and 32K, lazy chain drafts, final kernel
#   bash benchmarks/h200.sh lossless-fp32 # shipped model, every mode vs mlx-lm greedy, float32 only
#   bash benchmarks/h200.sh host-time # graph building against evaluation by T, shipped model and 80B shapes
#   bash benchmarks/h200.sh qmm-rows  # MLX's 4-bit matmuls (dense, routed experts) by row count
#   bash benchmarks/h200.sh 80b-32k   # 80B-A3B shapes, forward costs and peak memory at 32K (one prefill)
#   bash benchmarks/h200.sh distill-variants # MTP head self-distillation, hard_weight 0 / 0.5 / 1 (110 s each), chain modes of each
#   bash benchmarks/h200.sh distill   # distill SOURCE (default the shipped model) for DISTILL_SECONDS, then the lazy chain suite on it
#   bash benchmarks/h200.sh few-row-qmm # 80B projections by row count as MLX runs them and padded to its GEMM path,
#                                       # then 80B verify forwards with and without the padding, interleaved
#   bash benchmarks/h200.sh graph-settings # shipped model and 80B shapes: verify forwards under MLX's CUDA graph settings
#                                          # (graph cache size, ops/MB per graph, graphs off), one process per setting
#   bash benchmarks/h200.sh eval-mode # after the synthetic model's fix (inference mode, so the CUDA recurrence kernel
#                                     # serves it): verify forwards by graph setting, then the shipped and 80B benches
#                                     # with MLX_MAX_OPS_PER_BUFFER=300
#   bash benchmarks/h200.sh eval-mode-final # 80B shapes at 1K and 8K (2 rounds), then the shipped model's chain modes
#   bash benchmarks/h200.sh forward-parts # where the 80B verify forward's growth with T goes (MoE, mixers and their pieces)
#   bash benchmarks/h200.sh compiled-head # shipped model, chain modes drafted by the compiled MLX head against the eager one
#   bash benchmarks/h200.sh step-profile # shipped model, plain and chain K=6 decoding under cProfile
#                                     # (TRACE=--trace adds the GPU kernel view)
#   bash benchmarks/h200.sh layer-kernels # kernels of each verify-forward part at T = 1 and 7, step trace, chain suite
#   bash benchmarks/h200.sh rowwise   # few-row dense products row by row: GPU test, kernels, chain suite and lossless, on and off
#   bash benchmarks/h200.sh final-rowwise # row-by-row GPU test, then the shipped model's chain modes (3 rounds)
#   bash benchmarks/h200.sh 80b-moe   # 80B verify(T)/forward(1) curve at 1K and 8K (contiguous MoE indices)
#   bash benchmarks/h200.sh rowwise-batch # batch mode's throughput with few-row products row by row and as GEMMs
#   bash benchmarks/h200.sh chain-kernel # chain drafts in one kernel launch: GPU tests, block-size probe,
#                                        # chain modes to K=15 against the MLX head, lossless
#   bash benchmarks/h200.sh 80b-32k-modes # 80B shapes at 32K: interleaved verify curve, then baseline against
#                                         # chain K=3 and tree K=3 (peak memory, the cost of tiling, cost model)
#   bash benchmarks/h200.sh 80b-32k-overhead # 80B shapes at 32K: chain K=2/3 against baseline, 2 rounds
#   bash benchmarks/h200.sh 80b-batch-short # 80B shapes, batch mode at B = 1 and 8 (short, to fit a call's end)
#   bash benchmarks/h200.sh chain-kernel-final # GPU tests, chain modes (3 rounds) next to batch mode's throughput,
#                                              # then batch mode with few-row products row by row and as GEMMs
#   bash benchmarks/h200.sh host-drafts # shipped model, chain modes drafted on the host CPU (C++ head) and on the GPU (MLX), one run
#                                       # (needs _mtp_draft built for the GPU machine's Python in $EXT_DIR:
#                                       #  bash benchmarks/build_host_draft_ext.sh builds it into .gpu-stage/b/ext)
#
# cuDNN's attention builds a graph for every new key length it sees; a verify
# forward over K+1 queries gets a new key length every step, so the runs turn
# it off (MLX_CUDA_USE_CUDNN_SDPA=0; the `cudnn` part measures both).
set -u
out=${OUT:-benchmarks/h200-out}
mkdir -p "$out"
export PYTHONPATH=/root/site:$PWD
bench="python3 -u -m mtp_engine.bench"
case "${1:?shipped, 80b, 80b-batch, cudnn or lossless}" in
  host-drafts)  # host (C++) and MLX drafts side by side in one run
    cp "${EXT_DIR:?folder holding _mtp_draft*.so}"/_mtp_draft*.so /root/site/
    python3 -c "import _mtp_draft; print('extension ok')" || exit 1
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-400}" $bench --limit 8 --max-tokens 64 --rounds 2 --host-drafts \
      --modes baseline chain-k2 chain-k4 chain-k6 chain-k4-mlxdraft chain-k6-mlxdraft adaptive-k5 --batch-sizes \
      --json "$out/host-drafts.json" 2>&1 | tee "$out/host-drafts.log" ;;
  compiled-head)  # the shipped model's chain modes drafted by the compiled MLX head and the eager one, one run; then its tests
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-300}" $bench --limit 8 --max-tokens 64 --rounds 2 \
      --modes baseline chain-k4 chain-k4-eagerhead chain-k6 chain-k6-eagerhead chain-k8 --batch-sizes \
      --json "$out/compiled-head-shipped.json" 2>&1 | tee "$out/compiled-head-shipped.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/mtp_engine/test_compiled_head.py \
      2>&1 | tail -30 | tee "$out/compiled-head-tests.log" ;;
  layer-kernels)  # kernels of each part of a verify forward at T = 1 and 7, then the step profile with its trace and the chain suite
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 150 python3 -u benchmarks/layer_kernels.py --json "$out/layer-kernels.json" \
      2>&1 | tee "$out/layer-kernels.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 150 python3 -u benchmarks/step_profile.py --top 12 --trace \
      2>&1 | tee "$out/step-profile-trace.log" | grep "^trace\|^==\|^dispatch" | cut -c1-200
    bash "$0" compiled-head ;;
  rowwise)  # few-row dense products row by row: its GPU test, kernels by part, chain suite on and off, lossless on and off
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/mtp_engine/test_rowwise.py \
      2>&1 | tail -5 | tee "$out/rowwise-tests.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 100 python3 -u benchmarks/layer_kernels.py --json "$out/rowwise-layer-kernels.json" \
      2>&1 | grep -v Warn | tee "$out/rowwise-layer-kernels.log" | grep "kernels {"
    for rowwise in on off; do
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout 200 $bench --limit 8 --max-tokens 64 --rounds 2 --rowwise $rowwise \
        --modes baseline chain-k4 chain-k6 chain-k8 tree-k3 paths-k3-p2 --batch-sizes \
        --json "$out/rowwise-$rowwise-shipped.json" 2>&1 | tee "$out/rowwise-$rowwise-shipped.log" | grep -v "^round"
    done
    for rowwise in on off; do
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout 150 python3 -u -m mtp_engine.lossless --limit 8 --max-tokens 64 --rowwise $rowwise \
        --json "$out/rowwise-$rowwise-lossless.json" 2>&1 | tee "$out/rowwise-$rowwise-lossless.log" | tail -1
    done ;;
  final-rowwise)  # the row-by-row GPU test, then the shipped model's chain modes with mlx-lm's reference, 3 rounds
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/mtp_engine/test_rowwise.py \
      2>&1 | tail -3 | tee "$out/final-rowwise-tests.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 240 $bench --limit 8 --max-tokens 64 --rounds 3 \
      --modes baseline mlx_lm chain-k4 chain-k6 chain-k8 --batch-sizes \
      --json "$out/final-rowwise-shipped.json" 2>&1 | tee "$out/final-rowwise-shipped.log" | grep -v "^round" ;;
  80b-moe)  # 80B verify(T)/forward(1) with contiguous MoE indices: 1K once, 8K twice (one process each)
    for context in 1024 8192 8192; do
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-100}" python3 -u benchmarks/graph_settings.py --synthetic 80b \
        --context $context --widths 1 2 3 4 5 8 --repeats 20 --json "$out/80b-moe-curve.jsonl"
    done 2>&1 | grep -v Warn | tee "$out/80b-moe-curve.log" ;;
  chain-kernel)  # the chain-draft kernel: GPU tests, block-size probe, chain modes, lossless
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/mtp_engine/test_cuda_drafter.py \
      -k gpu 2>&1 | tail -25 | tee "$out/chain-kernel-tests.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 90 python3 -u benchmarks/chain_kernel_probe.py 2>&1 | tee "$out/chain-kernel-probe.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 240 $bench --limit 8 --max-tokens 64 --rounds 2 \
      --modes baseline mlx_lm chain-k4 chain-k6 chain-k8 chain-k8-mlxdraft chain-k10 chain-k12 chain-k15 --batch-sizes \
      --json "$out/chain-kernel-shipped.json" 2>&1 | tee "$out/chain-kernel-shipped.log" | grep -v "^round"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-100}" python3 -m mtp_engine.lossless --limit 8 --max-tokens 64 \
      2>&1 | tail -20 | tee "$out/chain-kernel-lossless.log" ;;
  80b-32k-modes)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 200 python3 -u benchmarks/graph_settings.py --synthetic 80b \
      --context 32768 --widths 1 2 3 4 5 8 --repeats 20 --json "$out/80b-32k-curve.jsonl" 2>&1 | grep -v Warn \
      | tee "$out/80b-32k-curve.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 370 $bench --synthetic 80b --limit 1 --max-tokens 24 --rounds 1 \
      --modes baseline chain-k3 tree-k3 --contexts 32768 --batch-sizes --time-budget 330 \
      --json "$out/80b-32k-modes.json" 2>&1 | tee "$out/80b-32k-modes.log" ;;
  80b-32k-overhead)  # 80B shapes at 32K, chain K=2 and 3 against baseline over 2 rounds (engine overhead again)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 420 $bench --synthetic 80b --limit 1 --max-tokens 32 --rounds 2 \
      --modes baseline chain-k2 chain-k3 --contexts 32768 --batch-sizes --time-budget 400 \
      --json "$out/80b-32k-overhead.json" 2>&1 | tee "$out/80b-32k-overhead.log" ;;
  80b-batch-short)  # 80B shapes, batch mode at B = 1 and 8 only (does mlx-lm's BatchGenerator still fail there?)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-200}" $bench --synthetic 80b --limit 1 --max-tokens 16 \
      --rounds 1 --modes baseline --batch-sizes 1 8 --batch-limit 8 \
      --json "$out/h200-80b-batch-short.json" 2>&1 | tee "$out/h200-80b-batch-short.log" ;;
  chain-kernel-final)  # GPU tests; chains (kernel and MLX head) and batch mode side by side; batch mode's rows on/off
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/mtp_engine/test_cuda_drafter.py \
      -k gpu 2>&1 | tail -5 | tee "$out/chain-kernel-final-tests.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 260 $bench --limit 8 --max-tokens 64 --rounds 3 \
      --modes baseline mlx_lm chain-k4 chain-k6 chain-k8 chain-k8-mlxdraft chain-k10 chain-k12 chain-k15 \
      --batch-sizes 16 32 --batch-limit 32 \
      --json "$out/chain-kernel-final.json" 2>&1 | tee "$out/chain-kernel-final.log" | grep -v "^round"
    for rowwise in on off; do
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout 90 $bench --limit 4 --max-tokens 64 --rounds 1 --rowwise $rowwise \
        --modes baseline --batch-sizes 8 16 32 --batch-limit 32 \
        --json "$out/rowwise-batch-$rowwise.json" 2>&1 | tee "$out/rowwise-batch-$rowwise.log" | grep "products\|dataset"
    done ;;
  rowwise-batch)  # batch mode's dataset throughput (32 prompts) with few-row products row by row and as GEMMs
    for rowwise in on off; do
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout 120 $bench --limit 4 --max-tokens 64 --rounds 1 --rowwise $rowwise \
        --modes baseline --batch-sizes 8 16 32 --batch-limit 32 \
        --json "$out/rowwise-batch-$rowwise.json" 2>&1 | tee "$out/rowwise-batch-$rowwise.log" | grep "products\|dataset"
    done ;;
  step-profile)  # host time of plain and chain K=6 decoding by Python function (cProfile), shipped model
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-200}" python3 -u benchmarks/step_profile.py --top "${TOP:-45}" $TRACE \
      2>&1 | tee "$out/step-profile${TRACE:+-trace}.log" ;;
  few-row-qmm)  # padding 2-7-row quantized products to MLX's GEMM path: projections, then 80B verify forwards
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-330}" python3 -u benchmarks/few_row_qmm.py \
      --json "$out/few-row-qmm.json" 2>&1 | tee "$out/few-row-qmm.log" ;;
  graph-settings)  # one process per setting; the first (default settings, with a kernel trace) also compiles MLX's kernels
    probe="python3 -u benchmarks/graph_settings.py --json $out/graph-settings.jsonl"
    for setting in "" MLX_CUDA_GRAPH_CACHE_SIZE=4000 MLX_MAX_MB_PER_BUFFER=100000 MLX_MAX_OPS_PER_BUFFER=100 \
        MLX_MAX_OPS_PER_BUFFER=300 "MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=100000 MLX_CUDA_GRAPH_CACHE_SIZE=4000" \
        MLX_USE_CUDA_GRAPHS=0 ""; do
      trace=$([ -z "$setting" ] && [ ! -s "$out/graph-settings.jsonl" ] && echo --trace)
      echo "== ${setting:-default} $(date +%T)"
      env $setting MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-300}" $probe $trace
      env $setting MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-300}" $probe --synthetic 80b $trace
    done 2>&1 | tee "$out/graph-settings.log" ;;
  eval-mode)
    probe="python3 -u benchmarks/graph_settings.py --json $out/eval-mode-settings.jsonl"
    for setting in "" MLX_MAX_OPS_PER_BUFFER=300; do
      env $setting MLX_CUDA_USE_CUDNN_SDPA=0 timeout 120 $probe --synthetic 80b
    done 2>&1 | grep -v Warn | tee "$out/eval-mode-settings.log"
    for setting in "" MLX_MAX_OPS_PER_BUFFER=300 MLX_MAX_OPS_PER_BUFFER=1000; do
      env $setting MLX_CUDA_USE_CUDNN_SDPA=0 timeout 60 $probe
    done 2>&1 | tee -a "$out/eval-mode-settings.log"
    MLX_MAX_OPS_PER_BUFFER=300 MLX_CUDA_USE_CUDNN_SDPA=0 timeout 150 $bench --limit 8 --max-tokens 64 --rounds 1 \
      --modes baseline mlx_lm chain-k2 chain-k4 chain-k6 --batch-sizes --json "$out/ops300-shipped.json" 2>&1 | tee "$out/ops300-shipped.log"
    MLX_MAX_OPS_PER_BUFFER=300 MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-200}" $bench --synthetic 80b --limit 1 --max-tokens 32 \
      --rounds 1 --modes baseline mlx_lm chain-k2 chain-k3 --contexts 1024 --batch-sizes \
      --json "$out/ops300-80b.json" 2>&1 | tee "$out/ops300-80b.log" ;;
  eval-mode-final)  # the README's latest 80B table, then the shipped model in the same call
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-330}" $bench --synthetic 80b --limit 1 --max-tokens 48 --rounds 2 \
      --modes baseline chain-k2 chain-k3 --contexts 1024 8192 --batch-sizes --time-budget 280 \
      --json "$out/final-80b.json" 2>&1 | tee "$out/final-80b.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout 200 $bench --limit 8 --max-tokens 64 --rounds 2 \
      --modes baseline chain-k2 chain-k4 chain-k6 --batch-sizes --json "$out/final-shipped.json" 2>&1 | tee "$out/final-shipped.log" ;;
  forward-parts)  # 80B verify forward against its MoE blocks, gated-delta mixers, attention mixers and convs
    # a freshly started machine compiles MLX's kernels in the first (unmeasured) pass: minutes
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-540}" python3 -u benchmarks/forward_parts.py \
      --json "$out/forward-parts.json" 2>&1 | tee "$out/forward-parts.log" ;;
  shipped)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-330}" $bench --limit 8 --max-tokens 64 --rounds 1 \
      --batch-limit 32 --json "$out/h200-shipped.json" 2>&1 | tee "$out/h200-shipped.log" ;;
  80b)  # the README's 80B table (32K left out: its prefills alone outlast a call)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-560}" $bench --synthetic 80b --limit 1 --max-tokens 32 \
      --rounds 1 --modes baseline mlx_lm chain-k2 chain-k3 tree-k3 --contexts 1024 8192 --batch-sizes \
      --time-budget 300 --json "$out/h200-80b.json" 2>&1 | tee "$out/h200-80b.log" ;;
  80b-batch)  # dataset throughput of batch mode (failed in batched prefill on 2026-11-30)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-420}" $bench --synthetic 80b --limit 1 --max-tokens 32 \
      --rounds 1 --modes baseline --batch-sizes 1 8 16 32 --batch-limit 32 \
      --json "$out/h200-80b-batch.json" 2>&1 | tee "$out/h200-80b-batch.log" ;;
  cudnn)
    for v in 1 0; do
      MLX_CUDA_USE_CUDNN_SDPA=$v timeout "${LIMIT:-90}" $bench --limit 2 --max-tokens 32 --rounds 1 \
        --modes baseline chain-k3 --batch-sizes --json "$out/cudnn-$v.json" > "$out/cudnn-$v.log" 2>&1
      echo "cudnn=$v exit $?"; tail -5 "$out/cudnn-$v.log"
    done ;;
  compile)
    for l in compiled eager; do
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-170}" $bench --limit 8 --max-tokens 64 --rounds 1 \
        --modes baseline mlx_lm chain-k2 chain-k3 tree-k3 --batch-sizes --layers $l \
        --json "$out/compile-$l.json" 2>&1 | tee "$out/compile-$l.log"
    done ;;
  80b-compile)
    for l in compiled eager; do  # compiled timed out in its cost model on 2026-11-30
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-270}" $bench --synthetic 80b --limit 1 --max-tokens 32 \
        --rounds 1 --modes baseline mlx_lm chain-k2 chain-k3 --contexts 1024 --batch-sizes --layers $l \
        --json "$out/80b-compile-$l.json" 2>&1 | tee "$out/80b-compile-$l.log"
    done ;;
  kernel)
    # needs pytest's wheels in .gpu-stage/b (pytest, pluggy, iniconfig, packaging)
    timeout "${LIMIT:-70}" python3 -m pytest -q -p no:cacheprovider tests/mtp_engine/test_cuda_recurrence.py \
      2>&1 | tail -4 | tee "$out/kernel-tests-runtime-nt.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-110}" $bench --limit 8 --max-tokens 64 --rounds 1 \
      --modes baseline mlx_lm chain-k2 chain-k3 tree-k3 --batch-sizes \
      --json "$out/kernel-shipped-runtime-nt.json" 2>&1 | tee "$out/kernel-shipped-runtime-nt.log" ;;
  kernel-80b)  # run on 2026-11-30 with an earlier kernel that compiled once per token count
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-540}" $bench --synthetic 80b --limit 1 --max-tokens 32 --rounds 1 \
      --modes baseline mlx_lm chain-k2 chain-k3 tree-k3 --contexts 1024 8192 --batch-sizes --time-budget 330 \
      --json "$out/kernel-80b.json" 2>&1 | tee "$out/kernel-80b.log" ;;
  lazy)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-150}" $bench --limit 8 --max-tokens 64 --rounds 1 \
      --modes baseline mlx_lm chain-k2 chain-k3 chain-k4 adaptive-k5 tree-k3 --batch-sizes \
      --json "$out/lazy-shipped.json" 2>&1 | tee "$out/lazy-shipped.log" ;;
  distill-variants)  # needs .train-data (python -m mtp_engine.train prepare)
    for hw in 0 0.5 1; do
      python3 -u -m mtp_engine.train distill --out "/root/distill-hw$hw" --batch-size 128 --steps 100000 \
        --eval-every 150 --hard-weight $hw --max-seconds "${DISTILL_SECONDS:-110}" 2>&1 \
        | grep -v "^step" | tee "$out/distill-hw$hw.log"
      MLX_CUDA_USE_CUDNN_SDPA=0 timeout 80 $bench --model "/root/distill-hw$hw" --limit 8 --max-tokens 64 \
        --rounds 1 --modes baseline chain-k2 chain-k3 chain-k4 --batch-sizes --json "$out/distill-hw$hw.json" \
        2>&1 | tail -14 | tee -a "$out/distill-hw$hw.log"
    done ;;
  distill)
    python3 -u -m mtp_engine.train distill --model "${SOURCE:-models/qwen3-next-tiny-stdlib}" --out /root/distilled \
      --batch-size 128 --steps 100000 --eval-every 200 --hard-weight "${HARD_WEIGHT:-1}" \
      --max-seconds "${DISTILL_SECONDS:-300}" 2>&1 | grep -v "^step [0-9]*[1-9] " | tee "$out/distill.log"
    mkdir -p "$out/distilled" && cp -r /root/distilled/. "$out/distilled/"
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-150}" $bench --model /root/distilled --limit 8 --max-tokens 64 \
      --rounds 1 --modes baseline mlx_lm chain-k2 chain-k3 chain-k4 adaptive-k5 tree-k3 --batch-sizes \
      --json "$out/distilled-shipped.json" 2>&1 | tee "$out/distilled-shipped.log" ;;
  lazy-80b)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-560}" $bench --synthetic 80b --limit 1 --max-tokens 32 --rounds 1 \
      --modes baseline mlx_lm chain-k2 chain-k3 --contexts 1024 8192 32768 --batch-sizes --time-budget 330 \
      --json "$out/lazy-80b.json" 2>&1 | tee "$out/lazy-80b.log" ;;
  lossless-fp32)
    MLX_CUDA_USE_CUDNN_SDPA=0 MLX_ENABLE_TF32=0 timeout "${LIMIT:-150}" python3 -u -m mtp_engine.lossless --limit 12 \
      --max-tokens 64 --dtype float32 --json "$out/lossless-fp32.json" 2>&1 | tee "$out/lossless-fp32.log" ;;
  host-time)
    (MLX_CUDA_USE_CUDNN_SDPA=0 timeout 100 python3 -u benchmarks/host_time.py --context 1024 --repeats 30
     MLX_CUDA_USE_CUDNN_SDPA=0 timeout 400 python3 -u benchmarks/host_time.py --synthetic 80b --context 1024 \
       --repeats 15) 2>&1 | tee "$out/host-time.log" ;;
  qmm-rows)
    timeout 200 python3 -u benchmarks/qmm_rows.py 2>&1 | tee "$out/qmm-rows.log" ;;
  80b-32k)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-520}" python3 -u benchmarks/long_context_costs.py --context 32768 \
      --json "$out/80b-32k-costs.json" 2>&1 | tee "$out/80b-32k-costs.log" ;;
  lossless8)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-400}" python3 -u -m mtp_engine.lossless --limit 8 --max-tokens 64 \
      --json "$out/lossless-bf16-noise.json" 2>&1 | tee "$out/lossless-bf16-noise.log" ;;
  lossless)
    MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${LIMIT:-240}" python3 -u -m mtp_engine.lossless --limit 12 --max-tokens 64 \
      --json "$out/lossless-bf16.json" 2>&1 | tee "$out/lossless-bf16.log"
    MLX_CUDA_USE_CUDNN_SDPA=0 MLX_ENABLE_TF32=0 timeout "${LIMIT:-150}" python3 -u -m mtp_engine.lossless --limit 12 \
      --max-tokens 64 --dtype float32 --json "$out/lossless-fp32.json" 2>&1 | tee "$out/lossless-fp32.log" ;;
esac
