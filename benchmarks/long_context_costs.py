"""Forward costs at one long context on the 80B-A3B shapes, one prefill.

    python benchmarks/long_context_costs.py --context 32768

The benchmark's suite prefills the context once per mode and run, which at
32K on the 80B shapes outlasts a 10-minute device call; this prefills once
and reports the cost model's inputs there: a verify forward over T tokens
(checkpoints on) against one token, one MTP step, and peak memory.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from mtp_engine.backend import prefer_mlx_attention
from mtp_engine.bench import forward_costs
from mtp_engine.engine import MTPEngine
from mtp_engine.synthetic import qwen3_next_80b_config, random_quantized_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    prefer_mlx_attention()
    engine = MTPEngine(random_quantized_checkpoint(qwen3_next_80b_config()))
    context = [(7 * i) % 1000 + 3 for i in range(args.context)]
    mx.reset_peak_memory()
    t = time.perf_counter()
    costs = forward_costs(engine, context, [1, 2, 3, 4, 8], repeats=10)
    t1 = costs["verify_s"][1]
    report = {
        "context": args.context,
        "seconds": round(time.perf_counter() - t, 1),
        "forward_1_ms": round(1e3 * t1, 2),
        "forward_ratio": {w: round(s / t1, 3) for w, s in costs["verify_s"].items()},
        "mtp_step_ratio": round(costs["mtp_step_s"] / t1, 3),
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 2),
    }
    print(json.dumps(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
