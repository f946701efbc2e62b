"""MLX's CUDA ``quantized_matmul`` over a few rows, as called and padded to
its GEMM path, on the 80B-A3B shapes (a probe; the engine does not pad).

    python benchmarks/few_row_qmm.py [--json OUT] [--skip-model] [--skip-projections] [--context 1024]

MLX's CUDA ``quantized_matmul`` runs products of fewer than 8 rows through a
matrix-vector kernel (about one pass over the weights per row) and 8 rows or
more through a tensor-core GEMM. This measures whether padding a verify
forward's projections to 8 rows pays:

1. Each dense projection of the 80B-A3B shapes (4-bit, groups of 64; the
   router gate at 8 bits), as 48 chained calls in one evaluation (one per
   layer), for T = 1..7 rows: median ms as called and padded to 8 rows, and
   the largest difference between the two outputs; T = 8 for reference.
2. Unless ``--skip-model``: the random 4-bit 80B-A3B model, a prefill of
   ``--context`` tokens, then verify forwards over T tokens with MLX's
   dispatch and with the large projections padded (`PaddedQuantizedLinear`),
   interleaved repeat by repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.recurrent import share_weights, swap_modules
from qmm_rows import timed  # benchmarks/ is on the path when run as a script

PAD_ROWS = 8
MIN_PADDED_WORK = 32 * 2**20  # rows x N x K under which padding measured slower (part 1)
LAYERS = 48
ROWS = (1, 2, 3, 4, 5, 7, 8)
# name: (out features, in features, bits) of the 80B-A3B's dense projections
SHAPES = {
    "linear_attn.in_proj_qkvz": (12288, 2048, 4),
    "linear_attn.out_proj": (2048, 4096, 4),
    "self_attn.q_proj": (8192, 2048, 4),
    "self_attn.o_proj": (2048, 4096, 4),
    "shared_expert.up_proj": (512, 2048, 4),
    "shared_expert.down_proj": (2048, 512, 4),
    "mlp.gate (router)": (512, 2048, 8),
    "lm_head": (151936, 2048, 4),
}


@cache
def _zeros(rows: int, k: int, dtype: mx.Dtype) -> mx.array:
    z = mx.zeros((rows, k), dtype=dtype)
    mx.eval(z)
    return z


def padded_qmm(x, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """``quantized_matmul`` of ``x`` (fewer than `PAD_ROWS` rows) padded with
    zero rows to `PAD_ROWS`, the real rows kept."""
    k = x.shape[-1]
    rows = x.size // k
    padded = mx.concatenate([x.reshape(rows, k), _zeros(PAD_ROWS - rows, k, x.dtype)])
    y = mx.quantized_matmul(padded, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    return y[:rows].reshape(*x.shape[:-1], w.shape[0])


class PaddedQuantizedLinear(nn.QuantizedLinear):
    """Pads products of 2 to 7 rows and at least `MIN_PADDED_WORK` row-weights."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not 2 <= rows < PAD_ROWS or rows * x.shape[-1] * self["weight"].shape[0] < MIN_PADDED_WORK:
            return super().__call__(x)
        return padded_qmm(x, self["weight"], self["scales"], self["biases"],
                          group_size=self.group_size, bits=self.bits)


def _swap(modules, old: type, new: type) -> int:
    def make(m):
        return share_weights(new, m) if getattr(m, "mode", "affine") == "affine" else None

    return swap_modules(modules, {old: make})


def projections() -> list[dict]:
    rows_out = []
    for name, (n, k, bits) in SHAPES.items():
        w = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
        q, s, b = mx.quantize(w, group_size=64, bits=bits)
        del w
        mx.eval(q, s, b)
        calls = 1 if name == "lm_head" else LAYERS
        for rows in ROWS:
            x = mx.random.normal((rows, k)).astype(mx.bfloat16)

            def mlx():
                return [mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=bits)
                        for _ in range(calls)]

            def ours():
                if rows >= PAD_ROWS:
                    return mlx()
                return [padded_qmm(x, q, s, b, group_size=64, bits=bits) for _ in range(calls)]

            diff = mx.abs(mlx()[0].astype(mx.float32) - ours()[0].astype(mx.float32)).max().item()
            scale = mx.abs(mlx()[0].astype(mx.float32)).max().item()
            t_mlx, t_ours = timed(mlx), timed(ours)
            row = {"projection": name, "shape": [n, k], "bits": bits, "calls": calls, "rows": rows,
                   "mlx_ms": round(1e3 * t_mlx, 3), "padded_ms": round(1e3 * t_ours, 3),
                   "max_abs_diff": diff, "max_abs": scale}
            rows_out.append(row)
            print(f"{name:26s} T={rows:2d}: MLX {row['mlx_ms']:7.3f} ms  padded {row['padded_ms']:7.3f} ms  "
                  f"({t_ours / t_mlx:.2f}x)  max|diff| {diff:.3g} of {scale:.3g}", flush=True)
    return rows_out


def model_costs(context_len: int, repeats: int = 12) -> list[dict]:
    """Verify forwards over T tokens with MLX's dispatch and with the padding,
    interleaved repeat by repeat (isolated 80B forwards on the H200 move by
    2x between rounds of one process), medians per setting and width."""
    from mtp_engine.backend import prefer_mlx_attention
    from mtp_engine.bench import prefilled_caches, verify_forward
    from mtp_engine.engine import MTPEngine
    from mtp_engine.synthetic import qwen3_next_80b_config, random_quantized_checkpoint

    prefer_mlx_attention()
    t = time.perf_counter()
    checkpoint = random_quantized_checkpoint(qwen3_next_80b_config())
    print(f"80B-A3B shapes built in {time.perf_counter() - t:.0f} s", flush=True)
    engine = MTPEngine(checkpoint)
    caches = prefilled_caches(engine, [(7 * i) % 1000 + 3 for i in range(context_len)])
    widths = [1, 2, 3, 4, 5, 8]
    modules = (checkpoint.model, checkpoint.head)
    settings = {"MLX": lambda: _swap(modules, PaddedQuantizedLinear, nn.QuantizedLinear),
                "padded": lambda: _swap(modules, nn.QuantizedLinear, PaddedQuantizedLinear)}
    times = {(name, w): [] for name in settings for w in widths}
    for rep in range(repeats + 1):
        for name, apply in settings.items():
            apply()
            for w in widths:
                t = time.perf_counter()
                verify_forward(engine, caches, w)
                if rep:  # the first pass warms up (and compiles) each shape
                    times[(name, w)].append(time.perf_counter() - t)
    out = []
    for name in settings:
        t1 = statistics.median(times[(name, 1)])
        row = {"matmul": name, "context": context_len, "repeats": repeats,
               "forward_ms": {w: round(1e3 * statistics.median(times[(name, w)]), 2) for w in widths},
               "forward_ratio": {w: round(statistics.median(times[(name, w)]) / t1, 3) for w in widths}}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--skip-projections", action="store_true")
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        raise SystemExit("needs MLX's CUDA backend")
    print(f"{mx.default_device()}: {LAYERS} chained calls per evaluation (lm_head: 1)", flush=True)
    report = {"projections": [] if args.skip_projections else projections()}
    if not args.skip_model:
        report["model"] = model_costs(args.context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
