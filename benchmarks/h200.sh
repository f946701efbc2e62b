#!/usr/bin/env bash
# The H200 suites behind docs/BENCHMARKS.md and the README's H200 table, one
# per device call. Needs MLX's CUDA build on PYTHONPATH
# (../shared/gpu/stage-mlx-cuda.sh installs it into /root/site). Each writes
# its result file into $OUT (default benchmarks/results); copy them into
# benchmarks/results/ to make them current.
#
#   bash benchmarks/h200.sh tests      # the GPU-only tests (kernels on the device, RoPE launches, quantized products) and
#                                      # sampled exactness on CUDA; tests-decoder: batched exactness (one call each)
#   bash benchmarks/h200.sh ab-job     # the job suite's job, an older commit against this tree, alternating (gpu-ab.sh)
#   bash benchmarks/h200.sh shipped    # shipped model, bf16, every chain depth one prompt at a time -> h200-shipped.json
#   bash benchmarks/h200.sh dataset    # shipped model over a dataset: plain, single chain, mlx-lm and our batching,
#                                      # batched chains B=8..32 K=1..4, all prompts then loop-free -> h200-dataset*.json
#   bash benchmarks/h200.sh sampling   # shipped model, plain sampling vs both samplers, T=0.7 and 1.0 -> h200-sampling.json
#   bash benchmarks/h200.sh lossless   # shipped model, bf16, every mode vs mlx-lm greedy -> h200-lossless.json
#   bash benchmarks/h200.sh profile    # the job suite's job under cProfile, one mode a process -> h200-profile-MODE.txt
#   bash benchmarks/h200.sh audit      # shipped model, a 64-row job in each speculative mode, audited against plain
#                                      # decoding (python -m jobs audit) -> h200-audit-MODE.json; MODES="..." picks
#                                      # modes (adaptive, one row at a time, takes minutes: give it a call of its own)
#   bash benchmarks/h200.sh job        # shipped model, a 64-prompt x 96-token job end to end: plain batching, auto,
#                                      # batched chain K=3 at B=32, greedy and T=0.7 (python -m jobs.bench) -> h200-job.json
#   bash benchmarks/h200.sh job-batches # the same job, plain batching and auto at each of BATCHES (default 32 64 128),
#                                      # greedy, 3 rounds a size: the best plain batching -> GPU-job-bN.json
#   bash benchmarks/h200.sh job-80b    # the runner end to end on Qwen3-Next-80B-A3B shapes (random 4-bit weights,
#                                      # generated 1K-token prompts x 256 new tokens, drafts projected at 0.93,0.82,0.64):
#                                      # plain batching vs auto; 64 prompts at B=32, 2 rounds; job-80b-b8: 32 at B=8, 2 rounds;
#                                      # job-80b-sampled: T=0.8; job-80b-weak: profile 0.70,0.45,0.27; job-80b-falling:
#                                      # 32 prompts x 1024 tokens, 0.70,0.45,0.27 from token 512 on; job-80b-prefix: 32
#                                      # rows sharing a 2K-token system prompt (64-256-token suffixes), plain batching
#                                      # and auto, prefix sharing off and on, 2 rounds (~250 s; compare round 2: a
#                                      # process's first job pays its kernel compiles) (one call each)
#                                      # -> GPU-job-80b*.json (GPU: h200 or h100). For job and job-80b*: MODES="..."
#                                      # picks the modes (jobs.bench --modes), TEMPS="..." job's temperatures,
#                                      # EXTRA="..." more jobs.bench arguments (e.g. --phase-times), ROUNDS=N
#                                      # the rounds, PROMPTS=N (job-80b*) the prompts, TAG=-x a suffix of the file name
#   bash benchmarks/h200.sh 80b        # Qwen3-Next-80B-A3B shapes, random 4-bit weights, 1K-token prompts x 128 new
#   bash benchmarks/h200.sh 80b-b8     # tokens, drafts projected at profile 0.93,0.82,0.64: B=32; B=8; single chains
#   bash benchmarks/h200.sh 80b-depths # K=3..8 (one call each) -> h200-80b.json, h200-80b-b8.json, h200-80b-depths.json
#   bash benchmarks/h200.sh 80b-8k     # as 80b-b8 with 8K-token prompts, 8 of them, phases timed -> h200-80b-8k.json
#   bash benchmarks/h200.sh 80b-phases # as 80b, every phase of the decoder timed -> h200-80b-phases.json
#   bash benchmarks/h200.sh 80b-host   # one 80B forward of 1 / 4 / 7 tokens split into Python building it, MLX
#                                      # encoding it and the device; primitives counted; the same for each
#                                      # decoder layer kind and the MLP alone -> h200-80b-host.json
#   bash benchmarks/h200.sh 80b-prefill # one 1K-token 80B prefill and its pieces alone (layers, mixers, recurrence,
#                                      # MoE parts, the expert products on the tensor cores and in blocks of 8-64
#                                      # rows) -> h200-80b-prefill.json
#   bash benchmarks/h200.sh qwen3.5-27b       # Qwen3.5-27B (dense) shapes, random 4-bit weights, 1K context, drafts
#   bash benchmarks/h200.sh qwen3.5-35b-a3b   # projected at profile 0.93,0.82,0.64 -> h200-qwen3.5-*.json (one call each)
#
# A fresh machine compiles each of MLX's CUDA kernels the first time it runs: the 80B suites' warm-up took
# 427 s on one, 29 s once compiled. MLX caches them under /tmp/mlx. To carry them to a later machine, end a
# warm call with `tar czf $OUT/ptx.tgz -C /tmp mlx` (about 4 MB), keep the file as .mlx-ptx/ptx.tgz (ignored)
# and name .mlx-ptx in the next call's carry: this script unpacks it first.
# Staging in four calls: split the CUDA wheel into parts of 28,000,000 bytes (three of them fit beside the
# ~38 MB tree under a call's 64 MiB); the fourth call carries the small last part, the other wheels and .mlx-ptx.
# The machine's image lacks llguidance (constrained rows need it; without it their tests fail there): its wheel
# (llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl, 3 MB) rides in the third call beside a part.
# Several suites back to back in a detached process, polled by later calls: benchmarks/gpu-queue.sh.
set -u
# A queue suite's VAR=VALUE holds no spaces (benchmarks/gpu-queue.sh): in MODES, TEMPS, EXTRA and BATCHES a "+" stands for one
# (MODES=baseline+auto, EXTRA=--draft-tokens+5).
for var in MODES TEMPS EXTRA BATCHES; do if [ -n "${!var:-}" ]; then export "$var=${!var//+/ }"; fi; done
if [ -f .mlx-ptx/ptx.tgz ] && [ ! -d /tmp/mlx ]; then tar xzf .mlx-ptx/ptx.tgz -C /tmp; fi
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH=/root/site:$PWD
bench="python3 -u -m mtp_engine.bench"
# The shipped model's 64-prompt job that the job, ab-job and profile suites run (each adds modes, rounds, temperatures).
job="--dataset examples/prompts.jsonl --limit 64 --max-tokens 96 --batch-size 32"
# Result files are named after the card that made them: h200-*.json or h100-*.json.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && echo h100 || echo h200)

case "${1:?tests, ab, ab-job, first-use, tests-decoder, profile, shipped, dataset, sampling, lossless, job, job-batches, audit, job-80b, job-80b-b8, job-80b-sampled, job-80b-weak, job-80b-falling, job-80b-prefix, 80b, 80b-b8, 80b-depths, 80b-phases, 80b-8k, 80b-host, 80b-prefill, qwen3.5-27b or qwen3.5-35b-a3b}" in
  tests)
    # TESTS=a,b: these pytest arguments instead, comma-separated (a queue suite's VAR=VALUE holds no spaces)
    tests=${TESTS:-tests/mtp_engine/kernels,tests/mtp_engine/drafters,tests/mtp_engine/model/test_rowwise.py}
    [ -n "${TESTS:-}" ] || tests+=",tests/mtp_engine/model/test_dispatch.py,tests/mtp_engine/model/test_rope.py"
    [ -n "${TESTS:-}" ] || tests+=",tests/mtp_engine/model/test_quantized.py,tests/mtp_engine/test_sampling.py"
    timeout "${LIMIT:-480}" python3 -m pytest -q -p no:cacheprovider ${tests//,/ } -rfEs --durations=15 2>&1 \
      | tee "$out/$gpu-tests.log" | tail -40 ;;
  ab|ab-job)
    # an older commit (gpu-ab.sh stage REV; .ab-old in the call's carry) against this tree, alternating; ab: ARGS to
    # mtp_engine.bench (default the 80b suite's B=32 run); ab-job: the job suite's job (MODES, ROUNDS, TEMPS, EXTRA;
    # TAG=-x names its files ab-job-x-*)
    if [ "$1" = ab-job ]; then
      export NAME=ab-job${TAG:-} MODULE=jobs.bench ARGS="$job --model $PWD/models/qwen3-next-tiny-stdlib
        --modes ${MODES:-baseline auto} --rounds ${ROUNDS:-4} --temperatures ${TEMPS:-0} ${EXTRA:-}"
    fi
    QUEUED=1 bash benchmarks/gpu-ab.sh run ;;
  first-use)
    # a fresh process's first uses step by step (benchmarks/first_use.py): auto with the kernel cache empty, auto and
    # plain batching reading it
    export MTP_KERNEL_CACHE=/tmp/first-use-kernels; rm -rf "$MTP_KERNEL_CACHE"
    for run in "auto, kernel cache empty:auto" "auto, kernel cache filled:auto" "baseline, kernel cache filled:baseline"; do
      echo "== ${run%%:*}"; timeout 60 python3 benchmarks/first_use.py "${run##*:}" 32 2>&1 | grep -v Warn
    done | tee "$out/$gpu-first-use.log" ;;
  tests-decoder)
    timeout "${LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider tests/mtp_engine/test_decoder.py -rfEs --durations=10 2>&1 \
      | tee "$out/$gpu-tests-decoder.log" | tail -30 ;;
  shipped)
    timeout "${LIMIT:-300}" $bench --limit 8 --max-tokens 64 --rounds 3 \
      --modes baseline mlx_lm chain-k2 chain-k3 chain-k4 chain-k6 chain-k8 --batch-sizes \
      --json "$out/$gpu-shipped.json" 2>&1 | grep -v "^round" ;;
  dataset)
    timeout "${LIMIT:-300}" $bench --suite dataset --limit 32 --max-tokens 128 --batch-sizes 8 16 32 \
      --draft-tokens 1 2 3 4 --single-k 4 --json "$out/$gpu-dataset.json" 2>&1 | grep -v "^round"
    timeout "${LIMIT:-420}" $bench --suite dataset --limit 48 --max-tokens 128 --batch-sizes 16 32 \
      --draft-tokens 2 3 --single-k 4 --no-mlx-lm-batch --loop-free --json "$out/$gpu-dataset-loop-free.json" \
      2>&1 | grep -v "^round" ;;
  sampling)
    timeout "${LIMIT:-300}" $bench --suite sampling --limit 4 --max-tokens 64 --rounds 1 --temperatures 0.7 1.0 \
      --sampling-k 2 3 --json "$out/$gpu-sampling.json" 2>&1 | grep -v "^round" ;;
  lossless)
    timeout "${LIMIT:-200}" python3 -u -m mtp_engine.lossless --limit 8 --max-tokens 64 \
      --json "$out/$gpu-lossless.json" 2>&1 | tail -20 ;;
  job)
    timeout "${LIMIT:-560}" python3 -u -m jobs.bench $job --modes ${MODES:-baseline auto chain:3} --rounds ${ROUNDS:-2} \
      --temperatures ${TEMPS:-0 0.7} ${EXTRA:-} --json "$out/$gpu-job${TAG:-}.json" ;;
  job-batches)
    for bs in ${BATCHES:-32 64 128}; do  # (this --batch-size comes after $job's, and the later one wins)
      timeout "${LIMIT:-180}" python3 -u -m jobs.bench $job --batch-size "$bs" --modes ${MODES:-baseline auto} \
        --rounds ${ROUNDS:-3} --temperatures ${TEMPS:-0} ${EXTRA:-} --json "$out/$gpu-job-b$bs.json" | tail -4
    done ;;
  profile)
    # the job suite's job under cProfile, one process per mode (MODES, default plain batching and auto; ROUNDS, default
    # 3): where the host's time goes, by function -> GPU-profile-MODE.txt (the 45 costliest by own and by total time)
    for mode in ${MODES:-baseline auto}; do
      timeout "${LIMIT:-240}" python3 -m cProfile -o "/tmp/profile-$mode.prof" -m jobs.bench $job --modes "$mode" \
        --rounds ${ROUNDS:-3} --temperatures ${TEMPS:-0} ${EXTRA:-} 2>&1 | tail -3
      python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(45); \
s.sort_stats('cumulative').print_stats(45)" "/tmp/profile-$mode.prof" > "$out/$gpu-profile-$mode.txt"
    done ;;
  audit)
    # A 64-row job of the shipped model (bfloat16) in every mode (plain batching too), each folder audited against plain
    # decoding (python -m jobs audit; --logprobs 0 keeps the token ids, so the audit finds where tokens part, not only
    # where texts do): identical rows, near-ties, divergences -> h200-audit-MODE.json
    for mode in ${MODES:-baseline auto chain adaptive tree adaptive_tree paths}; do
      timeout "${LIMIT:-90}" python3 -m jobs generate --dataset examples/prompts.jsonl --model models/qwen3-next-tiny-stdlib \
        --output "/tmp/audit-$mode" --overwrite --limit 64 --max-tokens 96 --mode "$mode" --logprobs 0 2>&1 | tail -1
      timeout "${LIMIT:-90}" python3 -m jobs audit "/tmp/audit-$mode" --json "$out/$gpu-audit-$mode.json" \
        | grep -v ": identical" | tee -a "$out/$gpu-audit.log" | tail -1
    done ;;
  job-80b|job-80b-b8|job-80b-sampled|job-80b-weak|job-80b-falling|job-80b-prefix)
    profile=0.93,0.82,0.64; args="--prompts 64 --batch-size 32"; rounds=1; modes=${MODES:-baseline auto}
    case "$1" in
      job-80b) rounds=2 ;;
      job-80b-b8) args="--prompts 32 --batch-size 8"; rounds=2 ;;
      job-80b-sampled) args="$args --temperatures 0.8" ;;
      job-80b-weak) profile=0.70,0.45,0.27 ;;
      job-80b-falling) args="--prompts 32 --batch-size 32 --profile-after 512:0.70,0.45,0.27 --max-tokens 1024" ;;
      job-80b-prefix) args="--prompts 32 --batch-size 32 --shared-prefix 2048 64 256"; rounds=2
        modes=${MODES:-"baseline,prefix_sharing=false baseline auto,prefix_sharing=false auto"} ;;
    esac
    timeout "${LIMIT:-560}" python3 -u -m jobs.bench --synthetic 80b --prompt-tokens 1024 --max-tokens 256 \
      --modes $modes --rounds ${ROUNDS:-$rounds} --acceptance-profile $profile $args ${PROMPTS:+--prompts $PROMPTS} \
      ${EXTRA:-} --json "$out/$gpu-$1${TAG:-}.json" ;;
  80b|80b-b8|80b-depths|80b-phases|80b-8k)
    # The target settings: prompts of 1K tokens x 128 new tokens, drafts projected at profile
    # 0.93,0.82,0.64. 80b: 32 prompts at B=32, K=3 and auto (~210 s); 80b-b8: 16 prompts at B=8 (~140 s); the batched
    # runs twice, the second round starting one mode later; one-at-a-time decoding on the first prompt (plain and
    # chain K=3, 2 rounds interleaved, after the batched reference run), the rest of the reference from plain
    # batching. 80b-depths: single-sequence
    # chains K=3..8 and plain decoding on 1 prompt, 3 rounds interleaved (~90 s). 80b-phases: 80b with each decoder phase timed. One call each.
    ctx=1024
    case "$1" in
      80b-8k) ctx=8192; args="--limit 8 --batch-sizes 8 --draft-tokens 3 --single-k 3 --single-limit 1 --phase-times" ;;
      80b) args="--limit 32 --batch-sizes 32 --draft-tokens 3 --single-k 3 --single-limit 1 --single-rounds 2 --batch-rounds 2" ;;
      80b-b8) args="--limit 16 --batch-sizes 8 --draft-tokens 3 --single-k 3 --single-limit 1 --single-rounds 2 --batch-rounds 2" ;;
      80b-depths) args="--limit 1 --batch-sizes --single-k 3 4 6 8 --single-rounds 3" ;;
      80b-phases) args="--limit 32 --batch-sizes 32 --draft-tokens 3 --single-k 3 --single-limit 1 --phase-times" ;;
    esac
    timeout "${LIMIT:-580}" $bench --synthetic 80b --suite dataset --acceptance-profile 0.93,0.82,0.64 \
      --max-tokens 128 --contexts $ctx $args --no-mlx-lm-batch --json "$out/$gpu-$1.json" 2>&1 | grep -v "^round" ;;
  80b-prefill)
    timeout "${LIMIT:-200}" $bench --synthetic 80b --suite prefill-cost --contexts 1024 --block-rows 8 16 32 64 \
      --json "$out/$gpu-80b-prefill.json" ;;
  80b-host)
    timeout "${LIMIT:-200}" $bench --synthetic 80b --suite host-cost --contexts 1024 --widths 1 4 7 \
      --fast-path layer_dispatch=off --json "$out/$gpu-80b-host.json" ;;
  qwen3.5-27b|qwen3.5-35b-a3b)
    timeout "${LIMIT:-560}" $bench --synthetic "$1" --suite dataset --acceptance-profile 0.93,0.82,0.64 \
      --limit 16 --max-tokens 48 --contexts 1024 --batch-sizes 8 16 --draft-tokens 2 3 --single-k 3 \
      --no-mlx-lm-batch --json "$out/$gpu-$1.json" 2>&1 | grep -v "^round" ;;
  *) echo "unknown suite $1" >&2; exit 2 ;;
esac
