"""Where a speculative step's host time goes, by Python function.

    python benchmarks/step_profile.py [--mode chain --draft-tokens 6] [--prompts 4]

Runs the engine's decoding under cProfile after a warm-up and prints the
functions by their own time. On a GPU the calls into MLX show what the host
waits on: ``tolist`` (the verify forward's dispatch and the wait for its
result), ``async_eval`` (the drafts' dispatch), and the Python that builds
the graphs. A plain-decoding profile of the same prompts comes first, for
comparison.

With ``--trace`` (PyTorch's profiler on the GPU image, as in
``graph_settings.py``), it adds the GPU's view of the same runs: kernels per
token (plain) or per step (speculative), the time the GPU was busy against
the wall time, and one isolated MTP draft step's kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import mlx.core as mx

from mtp_engine.backend import prefer_mlx_attention
from mtp_engine.bench import DEFAULT_MODEL, DEFAULT_PROMPTS, mlx_draft_step, read_prompts
from mtp_engine.engine import MTPEngine
from mtp_engine.recurrent import make_main_cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--mode", default="chain")
    parser.add_argument("--draft-tokens", type=int, default=6)
    parser.add_argument("--drafter", default="auto")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--trace", action="store_true", help="GPU kernel view (PyTorch profiler)")
    args = parser.parse_args()
    prefer_mlx_attention()
    engine = MTPEngine.load(args.model)
    prompts = read_prompts(engine, DEFAULT_PROMPTS, args.prompts, None)
    runs = [("baseline", dict(mode="baseline")),
            (args.mode, dict(mode=args.mode, draft_tokens=args.draft_tokens, drafter=args.drafter))]
    for name, spec in runs:
        for ids in prompts:  # warm-up: traces, kernels, allocator
            engine.generate(ids, max_tokens=args.max_tokens, **spec)
        profile = cProfile.Profile()
        steps = tokens = 0
        t = time.perf_counter()
        profile.enable()
        for ids in prompts:
            result = engine.generate(ids, max_tokens=args.max_tokens, **spec)
            steps += result.stats.steps
            tokens += len(result.tokens)
        profile.disable()
        elapsed = time.perf_counter() - t
        print(f"== {name} on {mx.default_device()}: {tokens} tokens, {steps} steps, {elapsed:.3f} s under the profiler")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
        if args.trace:
            trace_runs(engine, prompts, spec, args.max_tokens)
    if args.trace:
        trace_draft_step(engine, prompts[0])
    compare_dispatch(engine, prompts, runs[1][1], args.max_tokens)


def compare_dispatch(engine, prompts, spec, max_tokens: int, rounds: int = 3) -> None:
    """Chain decoding with each draft dispatched as built (the default)
    against the whole chain left to the verify's sync, interleaved."""
    drafter = engine.drafter_for(spec["mode"], spec.get("drafter", "auto"))
    if not hasattr(drafter, "dispatch_drafts"):
        return
    seconds = {True: 0.0, False: 0.0}
    for _ in range(rounds):
        for flag in (True, False):
            drafter.dispatch_drafts = flag
            t = time.perf_counter()
            for ids in prompts:
                engine.generate(ids, max_tokens=max_tokens, **spec)
            seconds[flag] += time.perf_counter() - t
    drafter.dispatch_drafts = True
    print(f"dispatch each draft: {seconds[True]:.3f} s; chain left to the verify: {seconds[False]:.3f} s "
          f"({rounds} rounds x {len(prompts)} prompts)")


def trace_runs(engine, prompts, spec, max_tokens: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.graph_settings import kernel_summary

    steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for ids in prompts:
            steps += engine.generate(ids, max_tokens=max_tokens, **spec).stats.steps
        wall = time.perf_counter() - t
    print(f"trace {spec['mode']} per step ({steps} steps):", json.dumps(kernel_summary(prof, steps, wall)))


def trace_draft_step(engine, ids, repeats: int = 20) -> None:
    """One MLX draft step (a pair in, its token read back) under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.graph_settings import kernel_summary

    model = engine.model
    hidden = model.model(mx.array(ids)[None], cache=make_main_cache(model))
    for name, drafter in (("compiled", engine.drafter), ("eager", engine.eager_drafter)):
        step = mlx_draft_step(drafter, hidden, ids[1:] + [7], hidden[:, -1:])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(repeats):
                step()
            wall = time.perf_counter() - t
        print(f"trace MTP step ({name} head):", json.dumps(kernel_summary(prof, repeats, wall)))


if __name__ == "__main__":
    main()
