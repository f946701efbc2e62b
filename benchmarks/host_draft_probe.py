"""Probe: host (C++) drafts for the shipped model on a GPU (`MTPEngine(...,
host_drafts=True)`): one short chain generation against plain decoding,
with a watchdog that dumps the stack if it hangs (a lazy draft primitive on
the CPU stream under a GPU verify did, on MLX 0.32.4 CUDA)."""

import faulthandler
import os
import sys
import time

faulthandler.dump_traceback_later(int(os.environ.get("WATCHDOG", "180")), exit=True)  # a cold GPU JIT-compiles for tens of seconds

from mtp_engine import MTPEngine  # noqa: E402

engine = MTPEngine.load("models/qwen3-next-tiny-stdlib", host_drafts=True)
print("native drafter:", engine.native_drafter is not None, flush=True)
plain = engine.generate("def add(a, b):", max_tokens=24, mode="baseline")
t = time.perf_counter()
out = engine.generate("def add(a, b):", max_tokens=24, mode="chain", draft_tokens=4)
print("chain ok", out.tokens == plain.tokens, out.stats.acceptance_length, f"{time.perf_counter() - t:.2f}s", flush=True)
sys.exit(0)
