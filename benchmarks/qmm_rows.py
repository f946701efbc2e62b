"""Cost of MLX's 4-bit matmuls by row count, the ops a verify forward over
T tokens runs where one-token decoding runs one row (80B-A3B expert shapes).

    python benchmarks/qmm_rows.py

Prints the median time of a 4-bit ``quantized_matmul`` (a dense projection),
of the same projection through ``gather_qmm`` (the weight as a single
"expert" every row selects), and of ``gather_qmm`` over the routed experts
(top-10 of 512), for T = 1..4 rows, each as 48 chained calls in one
evaluation (one per layer), so launch latency is amortised as in a forward.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

LAYERS = 48


def timed(fn, repeats: int = 20) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    hidden, inter, experts, top = 2048, 512, 512, 10
    dense_w = mx.random.normal((8192, hidden)).astype(mx.bfloat16)
    dq, ds, db = mx.quantize(dense_w, group_size=64, bits=4)
    ew = mx.random.normal((experts, inter, hidden)).astype(mx.bfloat16)
    eq, es, eb = mx.quantize(ew, group_size=64, bits=4)
    mx.eval(dq, ds, db, eq, es, eb)
    print(f"{mx.default_device()}: {LAYERS} chained calls per evaluation")
    base = {}
    for rows in (1, 2, 3, 4):
        x = mx.random.normal((1, rows, hidden)).astype(mx.bfloat16)
        idx = mx.random.randint(0, experts, (1, rows, top)).astype(mx.uint32)

        def dense():
            y = x
            for _ in range(LAYERS):
                y = mx.quantized_matmul(y, dq, ds, db, transpose=True, group_size=64, bits=4)[..., :hidden]
            return y

        dense_as_expert = [a[None] for a in (dq, ds, db)]
        zeros = mx.zeros((1, rows, 1), dtype=mx.uint32)

        def dense_gathered():
            y = x[..., None, None, :]
            for _ in range(LAYERS):
                y = mx.gather_qmm(y, *dense_as_expert, rhs_indices=zeros, transpose=True, group_size=64,
                                  bits=4)[..., :hidden]
            return y

        def routed():
            y = x[..., None, None, :]
            out = []
            for _ in range(LAYERS):
                out.append(mx.gather_qmm(y, eq, es, eb, rhs_indices=idx, transpose=True, group_size=64, bits=4))
            return out

        d, g, r = timed(dense), timed(dense_gathered), timed(routed)
        base.setdefault("d", d)
        base.setdefault("g", g)
        base.setdefault("r", r)
        print(f"T={rows}: dense {1e3 * d:.2f} ms ({d / base['d']:.2f}x), "
              f"dense via gather_qmm {1e3 * g:.2f} ms ({g / base['g']:.2f}x), "
              f"experts {1e3 * r:.2f} ms ({r / base['r']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
