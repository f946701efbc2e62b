#!/usr/bin/env bash
# The CPU suites behind docs/BENCHMARKS.md and the README's CPU table. Each
# writes the current result file of its suite into benchmarks/results/
# (replacing the last one). Run from the project root after `make install`.
#
#   bash benchmarks/cpu.sh bench      # shipped model, every mode side by side -> results/cpu-bench.json
#   bash benchmarks/cpu.sh lossless   # every mode vs mlx-lm greedy, both BLASes -> results/cpu-lossless*.json
set -euo pipefail
py=${PY:-.venv/bin/python}
results=benchmarks/results
case "${1:?bench or lossless}" in
  bench)
    $py -m mtp_engine.bench --json "$results/cpu-bench.json" ;;
  lossless)
    $py -m mtp_engine.lossless --limit 12 --max-tokens 64 --json "$results/cpu-lossless.json"
    MTP_CPU_BLAS=0 $py -m mtp_engine.lossless --limit 12 --max-tokens 64 --json "$results/cpu-lossless-bundled-blas.json" ;;
  *) echo "unknown suite $1" >&2; exit 2 ;;
esac
