"""Where a forward's time goes: host graph building against evaluation.

    python benchmarks/host_time.py [--synthetic 80b] [--context 1024]

Times, for a verify forward over T = 1..4 tokens (per-token checkpoints on),
the host's graph building (Python, up to the lazy logits) and the evaluation
(mx.eval: kernel dispatch and execution), medians of repeats. A forward whose
evaluation barely grows with T while its total does is held back by host
work per token, not by the device.
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx

from mtp_engine.backend import prefer_mlx_attention
from mtp_engine.bench import prefilled_caches, verify_forward
from mtp_engine.engine import MTPEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/qwen3-next-tiny-stdlib")
    parser.add_argument("--synthetic", choices=["80b"], default=None)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    prefer_mlx_attention()
    if args.synthetic:
        from mtp_engine.synthetic import qwen3_next_80b_config, random_quantized_checkpoint

        engine = MTPEngine(random_quantized_checkpoint(qwen3_next_80b_config()))
    else:
        engine = MTPEngine.load(args.model)
    caches = prefilled_caches(engine, [(7 * i) % 1000 + 3 for i in range(args.context)])

    print(f"{args.synthetic or args.model} on {mx.default_device()}, context {args.context}")
    base = None
    for width in (1, 2, 3, 4):
        verify_forward(engine, caches, width)
        runs = [verify_forward(engine, caches, width) for _ in range(args.repeats)]
        build = statistics.median(r[0] for r in runs)
        run = statistics.median(r[1] for r in runs)
        total = statistics.median(r[0] + r[1] for r in runs)
        base = base or total
        print(f"T={width}: build {1e3 * build:.2f} ms, eval {1e3 * run:.2f} ms, total {1e3 * total:.2f} ms"
              f" ({total / base:.2f}x T=1)", flush=True)


if __name__ == "__main__":
    main()
