"""Chain drafts on CUDA: one kernel launch (`mtp_engine.cuda_drafter`)
against the compiled MLX head, K = 1..15, by the kernel's block size.

    python benchmarks/chain_kernel_probe.py [--model DIR] [--repeats N]

Each figure is the median wall time of a chain of K drafts from one pending
pair, tokens read back (so it includes the launch and one host sync), after
the head consumed a 64-token context. Needs MLX's CUDA backend.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mtp_engine import MTPEngine, bench, cuda_drafter
from mtp_engine.recurrent import make_main_cache


def median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=bench.DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    engine = MTPEngine.load(args.model)
    if engine.kernel_drafter is None:
        raise SystemExit("the chain kernel does not serve this head here (CUDA only)")
    ids = engine.encode(open(bench.DEFAULT_PROMPTS).readline())[:64]
    hidden = engine.model.model(mx.array(ids)[None], cache=make_main_cache(engine.model))
    pairs, h1 = ids[1:] + [7], hidden[:, -1:]
    ks = (1, 2, 4, 6, 8, 10, 12, 15)
    rows = {"mlx head": [median_ms(bench.chain_draft(engine.drafter, hidden, pairs, h1, k), args.repeats) for k in ks]}
    for threads in (256, 512, 1024):
        cuda_drafter.THREADS = threads
        try:
            rows[f"kernel, {threads} threads"] = [
                median_ms(bench.chain_draft(engine.kernel_drafter, hidden, pairs, h1, k), args.repeats) for k in ks
            ]
        except Exception as e:  # noqa: BLE001 - a block size the device refuses is a result here
            print(f"{threads} threads: {type(e).__name__}: {e}")
    print("ms per chain of K drafts (launch + sync):")
    print(f"{'drafter':<24}" + "".join(f"{'K=' + str(k):>9}" for k in ks))
    for name, times in rows.items():
        print(f"{name:<24}" + "".join(f"{t:>9.3f}" for t in times))


if __name__ == "__main__":
    main()
