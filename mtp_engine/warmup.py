"""A decoder's warm-up: every step shape it takes, met before the first row.

On a GPU a process pays first uses (kernels loaded or compiled, buffers
allocated: on an H100 its first prefill 0.6 s with the engine's kernels
compiled on disk, 0.76 s compiling them; every later step milliseconds,
`benchmarks/first_use.py`), and mode "auto"'s
controller needs the step costs measured before it can choose. `warm_up`
meets them all at once, on made-up rows, so a job's first-use cost is one
figure its log and ledger report.

What a warm-up met stays with the engine (`MTPEngine.warmed`): a later
decoder of the same engine, decoding and sampling settings meets nothing
again and starts from the step costs measured then (a persistent engine, or
the rounds of a benchmark in one process, pay first-use costs once).
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import mlx.core as mx

from mtp_engine.sampling import SamplingParams


def warm_up(decoder, sampling: SamplingParams) -> tuple[float, int, int]:
    """Meet, before the first row, every step shape ``decoder`` takes: for
    each of its buckets of rows, rows of a short made-up prompt sampling as
    ``sampling`` take plain steps and steps of each draft depth the mode
    uses, each twice, so kernels compile and the controller's costs (mode
    "auto") start measured. A bucket the engine warmed for the same settings
    before is not stepped again; its costs are copied.

    Returns:
        ``(seconds, shapes met, buckets reused)``: the shapes met now, and
        the buckets whose shapes were met before (their costs copied).
    """
    t0 = time.perf_counter()
    sampling = replace(sampling, seed=0)  # the made-up rows' seed matters to nothing, nor to what they meet
    engine = decoder.engine
    vocab = engine.text.args.vocab_size
    prompt = [(7919 * i + 11) % vocab for i in range(16)]
    uses = range(decoder.k + 1) if decoder.controller is not None else [decoder.k]  # the mode's draft depths
    depths = [d for d in uses for _ in range(3 if d == 0 else 2)]  # a plain step's cost counts from its third
    shapes = set()
    reused = 0
    for size in decoder.buckets:
        config = replace(decoder.decode, batch_size=size)
        key = (config, sampling)
        if key in engine.warmed:
            reused += 1
        else:
            warm = type(decoder)(engine, config, buckets=[size])
            warm.add(None, prompt, [sampling] * size, max_tokens=sum(depths) + len(depths) + 1)
            met = len(shapes)
            for depth in depths:
                if warm.step(depth) or not warm.live:
                    break  # a row finished early: its shape is met at the next bucket or in the job
                shapes.add((size, depth))
            if len(shapes) > met:  # a bucket whose rows all ended at once is met again next time
                engine.warmed[key] = warm.controller.costs if warm.controller is not None else {}
            warm.close()
        if decoder.controller is not None and key in engine.warmed:
            decoder.controller.costs.update(copy.deepcopy(engine.warmed[key]))
    mx.clear_cache()
    return time.perf_counter() - t0, len(shapes), reused
