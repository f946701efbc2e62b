"""How MLX's CUDA graph settings move the verify forward's cost (a probe).

MLX's CUDA backend records kernels into CUDA graphs and launches a graph
every ``MLX_MAX_OPS_PER_BUFFER`` operations or ``MLX_MAX_MB_PER_BUFFER``
megabytes of inputs (30 ops and 400 MB on Hopper), reusing executable
graphs from a cache of ``MLX_CUDA_GRAPH_CACHE_SIZE`` entries (400) keyed by
topology. The 80B shapes' routed-expert weights are 268 MB a projection, so
nearly every MoE product closes a graph there. This probe runs in one
process under whatever settings the environment holds (the driver,
``bash benchmarks/h200.sh graph-settings``, starts one process per setting)
and prints one JSON line per model:

- ``forward_ms``: verify forwards (checkpoints on, logits of every token)
  over T tokens, T interleaved repeat by repeat, after a prefill;
- ``same_t_ms``: the same forwards with one T repeated back to back
  (a graph cache that thrashes when T varies shows up as a gap between the
  two);
- ``build_ms`` / ``eval_ms``: host graph building against evaluation;
- with ``--trace``, the GPU's own view through PyTorch's profiler (CUPTI
  sees every kernel in the process, MLX's too): kernels per forward, summed
  kernel time, the time the GPU was busy, and the costliest kernels.

    python benchmarks/graph_settings.py [--synthetic 80b] [--context 1024] [--trace]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

from mtp_engine.backend import prefer_mlx_attention
from mtp_engine.bench import prefilled_caches, verify_forward
from mtp_engine.engine import MTPEngine
from mtp_engine.recurrent import recurrence_path

SETTINGS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE")


def _trace(engine: MTPEngine, caches: list, widths: list[int], repeats: int) -> dict:
    """Kernel counts and GPU busy time per forward from PyTorch's profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    report = {}
    for w in widths:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(repeats):
                verify_forward(engine, caches, w)
            wall = time.perf_counter() - t
        report[w] = kernel_summary(prof, repeats, wall)
    return report


def kernel_summary(prof, repeats: int, wall: float) -> dict:
    """Per repeat: wall time, kernels, summed kernel time, the time the GPU
    was busy (kernel spans merged), and the top kernels by time and count,
    from a finished ``torch.profiler.profile``."""
    import torch

    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    by_name, count = defaultdict(float), defaultdict(int)
    for e in kernels:
        by_name[e.name[:90]] += e.time_range.end - e.time_range.start
        count[e.name[:90]] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "wall_ms": round(1e3 * wall / repeats, 2),
        "kernels": round(len(kernels) / repeats, 1),
        "kernel_ms": round(sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3 / repeats, 2),
        "busy_ms": round(busy / 1e3 / repeats, 2),
        "top_ms": {name: round(us / 1e3 / repeats, 3) for name, us in top},
        "top_count": {n: c / repeats for n, c in sorted(count.items(), key=lambda kv: -kv[1])[:30]},
    }


def probe(engine: MTPEngine, name: str, context: int, widths: list[int], repeats: int, trace: bool) -> dict:
    caches = prefilled_caches(engine, [(7 * i) % 1000 + 3 for i in range(context)])
    for _ in range(2):  # warm-up: every width's kernels and graphs
        for w in widths:
            verify_forward(engine, caches, w)
    runs = {w: [] for w in widths}
    for _ in range(repeats):
        for w in widths:
            runs[w].append(verify_forward(engine, caches, w))
    same = {}
    for w in (widths[0], 4):
        same[w] = statistics.median(sum(verify_forward(engine, caches, w)) for _ in range(repeats))
    total = {w: statistics.median(sum(r) for r in runs[w]) for w in widths}
    report = {
        "model": name,
        "recurrence": recurrence_path(engine.model),
        "settings": {k: os.environ.get(k) for k in SETTINGS},
        "context": context,
        "forward_ms": {w: round(1e3 * total[w], 2) for w in widths},
        "forward_ratio": {w: round(total[w] / total[widths[0]], 3) for w in widths},
        "same_t_ms": {w: round(1e3 * s, 2) for w, s in same.items()},
        "build_ms": {w: round(1e3 * statistics.median(r[0] for r in runs[w]), 2) for w in widths},
        "eval_ms": {w: round(1e3 * statistics.median(r[1] for r in runs[w]), 2) for w in widths},
    }
    if trace:
        try:
            report["trace"] = _trace(engine, caches, [widths[0], 4], 5)
        except Exception as e:  # a probe: say why and keep the timings
            report["trace"] = f"unavailable: {type(e).__name__}: {e}"
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/qwen3-next-tiny-stdlib")
    parser.add_argument("--synthetic", choices=["80b"], default=None)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--json", default=None, help="append the report line to this file")
    args = parser.parse_args()
    prefer_mlx_attention()
    t = time.perf_counter()
    if args.synthetic:
        from mtp_engine.synthetic import qwen3_next_80b_config, random_quantized_checkpoint

        engine = MTPEngine(random_quantized_checkpoint(qwen3_next_80b_config()))
    else:
        engine = MTPEngine.load(args.model)
    report = probe(engine, args.synthetic or args.model, args.context, args.widths, args.repeats, args.trace)
    report["seconds"] = round(time.perf_counter() - t, 1)
    line = json.dumps(report)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
