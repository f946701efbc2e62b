#!/usr/bin/env bash
# The CPU suites behind docs/BENCHMARKS.md and the README's CPU table. Each
# writes the current result file of its suite into benchmarks/results/
# (replacing the last one). Run from the project root after `make install`.
#
#   bash benchmarks/cpu.sh bench      # shipped model, every mode side by side -> results/cpu-bench.json
#   bash benchmarks/cpu.sh lossless   # every mode vs mlx-lm greedy, both BLASes -> results/cpu-lossless*.json
#   bash benchmarks/cpu.sh dataset    # over a dataset: plain, single chain, mlx-lm and our batching, batched
#                                     # chains; all prompts, then the loop-free ones -> results/cpu-dataset*.json
#   bash benchmarks/cpu.sh dataset-full  # all 287 prompts of examples/prompts.jsonl: plain, single chain K=4, plain
#                                      # batching and batched chains K=2/3 at B=16/32/64 (~20 min) -> results/cpu-dataset-full.json;
#                                      # then its 13 loop-free prompts (~6 min) -> results/cpu-dataset-full-loop-free.json
#   bash benchmarks/cpu.sh sampling   # plain sampling vs both samplers, T=0.7 and 1.0 -> results/cpu-sampling.json
#   bash benchmarks/cpu.sh quantized  # the shipped model quantized to 4 bits over 48 prompts: plain, single chain,
#                                     # plain batching and batched chains at B=8/32 (~8 min) -> results/cpu-dataset-quantized.json
#   bash benchmarks/cpu.sh job        # the job end to end (python -m jobs.bench) over all of examples/prompts.jsonl at
#                                     # B=32: plain batching, auto, batched chain K=2; greedy, T=0.7 and 1.0 (~20 min)
#                                     # -> results/cpu-job.json
#   bash benchmarks/cpu.sh prefix     # a job of 256 rows sharing a 512-token system prompt (python -m jobs.prefix_data),
#                                     # 128 new tokens, B=32, prefix sharing off and on (~7 min) -> results/cpu-prefix.json
#   bash benchmarks/cpu.sh constraints  # 64 prompts x 128 tokens at B=32, batched chain K=3 and auto, unconstrained and
#                                       # with examples/record.schema.json; then at 48 new tokens (~7 min)
#                                       # -> results/cpu-constraints.json, cpu-constraints-48.json
#   bash benchmarks/cpu.sh logprobs   # 64 prompts x 128 tokens at B=32, plain batching and batched chain K=3, without
#                                     # and with --logprobs 5 (~6 min) -> results/cpu-logprobs.json
set -euo pipefail
py=${PY:-.venv/bin/python}
results=benchmarks/results
case "${1:?bench, lossless, dataset, dataset-full, sampling, quantized, job, prefix, constraints or logprobs}" in
  bench)
    $py -m mtp_engine.bench --json "$results/cpu-bench.json" ;;
  lossless)
    $py -m mtp_engine.lossless --limit 12 --max-tokens 64 --json "$results/cpu-lossless.json"
    MTP_CPU_BLAS=0 $py -m mtp_engine.lossless --limit 12 --max-tokens 64 --json "$results/cpu-lossless-bundled-blas.json" ;;
  dataset)
    $py -m mtp_engine.bench --suite dataset --limit 48 --max-tokens 128 --batch-sizes 8 16 32 --draft-tokens 1 2 3 \
      --single-k 4 --json "$results/cpu-dataset.json"
    $py -m mtp_engine.bench --suite dataset --limit 48 --max-tokens 128 --batch-sizes 16 32 --draft-tokens 2 3 \
      --single-k 4 --no-mlx-lm-batch --loop-free --json "$results/cpu-dataset-loop-free.json" ;;
  dataset-full)
    $py -m mtp_engine.bench --suite dataset --limit 287 --max-tokens 128 --batch-sizes 16 32 64 --draft-tokens 2 3 \
      --single-k 4 --no-mlx-lm-batch --json "$results/cpu-dataset-full.json"
    $py -m mtp_engine.bench --suite dataset --limit 287 --max-tokens 128 --batch-sizes 16 --draft-tokens 2 3 \
      --single-k 4 --no-mlx-lm-batch --loop-free --json "$results/cpu-dataset-full-loop-free.json" ;;
  sampling)
    $py -m mtp_engine.bench --suite sampling --limit 12 --max-tokens 96 --rounds 1 --temperatures 0.7 1.0 \
      --sampling-k 2 3 4 --json "$results/cpu-sampling.json" ;;
  quantized)
    q4=$(mktemp -d)/q4
    $py -m mtp_engine.convert --hf-path models/qwen3-next-tiny-stdlib --mlx-path "$q4" -q --q-bits 4
    $py -m mtp_engine.bench --model "$q4" --suite dataset --limit 48 --max-tokens 64 --batch-sizes 8 32 --draft-tokens 2 3 \
      --single-k 2 --no-mlx-lm-batch --json "$results/cpu-dataset-quantized.json"
    rm -rf "$(dirname "$q4")" ;;
  job)
    $py -m jobs.bench --dataset examples/prompts.jsonl --modes baseline auto chain:2 --rounds 2 --max-tokens 128 \
      --batch-size 32 --draft-tokens 3 --temperatures 0 0.7 1.0 --json "$results/cpu-job.json" ;;
  prefix)
    $py -m jobs.prefix_data --rows 256 --prefix-tokens 512 --suffix-tokens 32 64 \
      --model models/qwen3-next-tiny-stdlib --output /tmp/prefix-256.jsonl
    $py -m jobs.bench --dataset /tmp/prefix-256.jsonl --modes baseline,prefix_sharing=false baseline --rounds 2 \
      --max-tokens 128 --batch-size 32 --json "$results/cpu-prefix.json" ;;
  constraints)
    schema='json_schema="examples/record.schema.json"'
    $py -m jobs.bench --limit 64 --max-tokens 128 --batch-size 32 --rounds 2 \
      --modes chain:3 "chain:3,$schema" auto "auto,$schema" --json "$results/cpu-constraints.json"
    # the same at 48 new tokens, where schema rows and free rows both run to the budget
    $py -m jobs.bench --limit 64 --max-tokens 48 --batch-size 32 --rounds 2 \
      --modes chain:3 "chain:3,$schema" auto "auto,$schema" --json "$results/cpu-constraints-48.json" ;;
  logprobs)
    $py -m jobs.bench --limit 64 --max-tokens 128 --batch-size 32 --rounds 2 \
      --modes baseline baseline,logprobs=5 chain:3 chain:3,logprobs=5 --json "$results/cpu-logprobs.json" ;;
  *) echo "unknown suite $1" >&2; exit 2 ;;
esac
