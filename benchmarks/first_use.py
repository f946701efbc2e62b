"""A fresh process's first-use costs, step by step: python benchmarks/first_use.py MODE [ROWS [depths=D,D,...]
[SWITCH=VALUE ...]]

Loads the shipped model, then times (synchronized) each step of a warm-up as `mtp_engine.warmup` takes it (plain
steps, then each draft depth twice; ``depths=`` another order) and the same steps once more, so each first use
stands beside its later cost. SWITCH=VALUE: fast paths, as ``--fast-path`` takes them.
"""

import sys
import time

t0 = time.perf_counter()
from mtp_engine import MTPEngine  # noqa: E402 (imported first: the CPU BLAS binding)
import mlx.core as mx  # noqa: E402

from mtp_engine.decoder import Decoder  # noqa: E402
from mtp_engine.modes import DecodeConfig  # noqa: E402
from mtp_engine.options import EngineOptions  # noqa: E402
from mtp_engine.sampling import SamplingParams  # noqa: E402

mode, rows = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32
order = [a for a in sys.argv[3:] if a.startswith("depths=")]
switches = dict(EngineOptions.parse_switch(a) for a in sys.argv[3:] if not a.startswith("depths="))
engine = MTPEngine.load("models/qwen3-next-tiny-stdlib", **switches)
mx.synchronize()
print(f"import and load {time.perf_counter() - t0:.3f} s", flush=True)
t = time.perf_counter()
mx.eval(mx.ones((32, 64), mx.bfloat16) @ mx.ones((64, 64), mx.bfloat16))  # the BLAS library's first use
print(f"first matmul {time.perf_counter() - t:.3f} s", flush=True)
depths = [0, 0, 0] + ([1, 1, 2, 2, 3, 3] if mode == "auto" else [])
if order:
    depths = [int(d) for d in order[-1].split("=")[1].split(",")]
for attempt in (1, 2):
    decoder = Decoder(engine, DecodeConfig(mode=mode, draft_tokens=3, batch_size=rows), buckets=[rows])
    prompt = [(7919 * i + 11 + attempt) % engine.text.args.vocab_size for i in range(16)]
    decoder.add(None, prompt, [SamplingParams()] * rows, max_tokens=64)
    t = time.perf_counter()
    decoder._admit()
    mx.synchronize()
    times = [f"join {time.perf_counter() - t:.3f}"]
    for depth in depths:
        t = time.perf_counter()
        decoder.step(depth)
        mx.synchronize()
        times.append(f"d{depth} {time.perf_counter() - t:.3f}")
    print(f"{mode} pass {attempt}: " + " ".join(times), flush=True)
    decoder.close()
