#!/usr/bin/env bash
# The H200 suites behind docs/BENCHMARKS.md and the README's H200 table, one
# per device call. Needs MLX's CUDA build on PYTHONPATH
# (../shared/gpu/stage-mlx-cuda.sh installs it into /root/site). Each writes
# its result file into $OUT (default benchmarks/results); copy them into
# benchmarks/results/ to make them current.
#
#   bash benchmarks/h200.sh tests      # the GPU-only tests (kernels, drafts, lossless on CUDA)
#   bash benchmarks/h200.sh shipped    # shipped model, bf16, every chain depth and batch mode -> h200-shipped.json
#   bash benchmarks/h200.sh lossless   # shipped model, bf16, every mode vs mlx-lm greedy -> h200-lossless.json
#   bash benchmarks/h200.sh 80b        # Qwen3-Next-80B-A3B shapes, random 4-bit weights, 1K and 8K -> h200-80b.json
set -u
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH=/root/site:$PWD
bench="python3 -u -m mtp_engine.bench"
case "${1:?tests, shipped, lossless or 80b}" in
  tests)
    timeout "${LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider tests/mtp_engine/kernels tests/mtp_engine/drafters \
      tests/mtp_engine/model/test_rowwise.py 2>&1 | tail -15 ;;
  shipped)
    timeout "${LIMIT:-300}" $bench --limit 8 --max-tokens 64 --rounds 3 \
      --modes baseline mlx_lm chain-k4 chain-k6 chain-k8 chain-k15 --batch-sizes 16 32 --batch-limit 32 \
      --json "$out/h200-shipped.json" 2>&1 | grep -v "^round" ;;
  lossless)
    timeout "${LIMIT:-200}" python3 -u -m mtp_engine.lossless --limit 8 --max-tokens 64 \
      --json "$out/h200-lossless.json" 2>&1 | tail -20 ;;
  80b)
    timeout "${LIMIT:-500}" $bench --synthetic 80b --limit 1 --max-tokens 48 --rounds 2 \
      --modes baseline chain-k2 chain-k3 --contexts 1024 8192 --batch-sizes \
      --json "$out/h200-80b.json" 2>&1 | grep -v "^round" ;;
  *) echo "unknown suite $1" >&2; exit 2 ;;
esac
