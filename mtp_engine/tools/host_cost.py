"""Where a forward's time goes on the host: ``python -m mtp_engine.bench
--suite host-cost``.

MLX is lazy: a trunk forward is built op by op in Python, then
``mx.async_eval`` hands its primitives to the backend, which encodes each
(on CUDA: a kernel launch recorded into a graph), and only then does the
device compute. For a large model decoding one sequence the first two can
cost more than the third. For each forward width (1: a plain decoding
step; K+1: a verify forward with per-token state capture, then its commit)
this suite times the three apart, over one prompt's caches:

- **build**: Python constructing the forward, lm-head and token choice;
- **async_eval**: the call that hands the graph to the backend;
- **device**: waiting for the result after that;
- **commit** (verify widths): the caches taking one accepted token.

It also counts the forward's primitives by type (from ``mx.export_to_dot``),
since on a host-bound backend their number is the cost, and splits the
same way each kind of piece alone at each width (``pieces``: one
gated-delta decoder layer, one attention decoder layer, each with its MLP,
and the MLP alone), so a cost that grows with the width can be placed; the
layer counts turn them into a forward's share. Run it with
``--fast-path layer_dispatch=off``: dispatched layers hand their work over
while the graph is built, which folds the encoding into "build".
"""

from __future__ import annotations

import collections
import os
import re
import statistics
import tempfile
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from mtp_engine.cache.batch import append_row, commit_rows, make_batch_cache
from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.model.dispatch import DispatchedLayer
from mtp_engine.sampling import GREEDY, choose
from mtp_engine.verify import decisions

_PRIMITIVE = re.compile(r'label ="([^"]+)", shape=rectangle')


def primitive_counts(*arrays: mx.array) -> collections.Counter:
    """How many primitives of each type the unevaluated graph behind
    ``arrays`` holds (evaluated inputs are not counted)."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return collections.Counter(_PRIMITIVE.findall(f.read()))
    finally:
        os.unlink(path)


def _states(caches: list) -> list[mx.array]:
    """Every array the caches hold, flat."""
    return [a for _, a in tree_flatten([c.state for c in caches]) if isinstance(a, mx.array)]


def _forward(engine, caches: list, width: int) -> mx.array:
    """A plain decoding step (width 1) or a verify forward of ``width``
    tokens with its acceptance decisions, built and not evaluated."""
    inputs = mx.full((1, width), 7, dtype=mx.int32)
    if width == 1:
        logits = engine.lm_head(engine.model.model(inputs, cache=caches)[:, -1:, :])
        return choose(logits, [GREEDY], mx.zeros((1, 1), dtype=mx.int32))
    for c in caches:
        if isinstance(c, StateCaptureCache):
            c.begin_capture()
    hidden = engine.model.model(inputs, cache=caches)
    return decisions(inputs[:, 1:], engine.lm_head(hidden), [GREEDY], [0])


def host_cost_suite(engine, prompt: list[int], widths: list[int], repeats: int = 7) -> dict:
    """Median milliseconds of each phase and the primitive count of one
    forward at each width, over ``prompt``'s caches (the first repeat of
    each width is a warm-up)."""
    if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths must be positive ints, got {widths!r}")
    if repeats < 2:
        raise ValueError(f"repeats must be at least 2 (the first is a warm-up), got {repeats}")
    prefilled = make_main_cache(engine.model)
    engine.prefill(prompt, prefilled, keep_hidden=False)
    caches = make_batch_cache(engine.model)  # a batch of one row, as the decoder runs it
    append_row(caches, prefilled, 0)
    rows = []
    for width in widths:
        commit = (lambda width=width: commit_rows(caches, width, [1])) if width > 1 else None
        rows.append({"width": width, **_split(lambda width=width: _forward(engine, caches, width),
                                              lambda: _states(caches), repeats, commit)})
    layers = engine.model.model.layers
    dispatched = any(isinstance(layer, DispatchedLayer) for layer in layers)
    return {"settings": {"prompt_tokens": len(prompt), "widths": widths, "repeats": repeats,
                         "statistic": "median of the repeats after the first", "layer_dispatch": dispatched},
            "layers": {"gated_delta": sum(layer.is_linear for layer in layers),
                       "attention": sum(not layer.is_linear for layer in layers)},
            "forwards": rows,
            "pieces": [_piece_costs(engine, caches, width, repeats) for width in widths]}


def _piece_costs(engine, caches: list, width: int, repeats: int) -> dict:
    """Each kind of piece of a forward of ``width`` tokens alone, split as
    `host_cost_suite` splits a forward (median ms, primitives), over the
    prompt's caches (which each call advances, as decoding steps do)."""
    layers = engine.model.model.layers
    dim = engine.model.model.embed_tokens.weight.shape[-1]
    dtype = engine.model.model.embed_tokens.weight.dtype
    h = (0.1 * mx.random.normal((1, width, dim), key=mx.random.key(width))).astype(dtype)
    mx.eval(h)
    pieces = {}
    for kind, is_linear in (("gated_delta_layer", True), ("attention_layer", False)):
        i = next((i for i, layer in enumerate(layers) if layer.is_linear == is_linear), None)
        if i is None:
            continue
        layer, cache = layers[i], caches[i]
        mask = "causal" if width > 1 and not is_linear else None  # gated-delta layers: no padding mask

        def build(layer=layer, cache=cache, mask=mask):
            if width > 1 and isinstance(cache, StateCaptureCache):
                cache.begin_capture()
            return layer(h, mask, cache)

        pieces[kind] = _split(build, lambda cache=cache: _states([cache]), repeats)
    pieces["mlp"] = _split(lambda: layers[0].mlp(h), list, repeats)
    return {"width": width, **pieces}


def _split(build, states, repeats: int, commit=None) -> dict:
    """Median build / async_eval / device ms of ``build()`` (and the arrays
    ``states()`` gives after it), and its primitives; with ``commit``, also
    the time and primitives of ``commit()`` evaluated after each repeat
    (else None). The first repeat is a warm-up."""
    laps = []
    for i in range(repeats):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        held = states()
        if not i:
            counts = primitive_counts(out, *held)
        mx.async_eval(out, held)
        t2 = time.perf_counter()
        mx.eval(out, held)
        t3 = time.perf_counter()
        if commit is not None:
            commit()
            if not i:
                commit_counts = primitive_counts(*states())
            mx.eval(states())
        laps.append((t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3))
    build_ms, async_ms, device_ms, commit_ms = (round(1000 * statistics.median(lap[j] for lap in laps[1:]), 3)
                                                for j in range(4))
    return {"build_ms": build_ms, "async_eval_ms": async_ms, "device_ms": device_ms,
            "commit_ms": commit_ms if commit is not None else None,
            "primitives": sum(counts.values()), "primitives_by_type": dict(counts.most_common()),
            "commit_primitives": sum(commit_counts.values()) if commit is not None else None}


def print_host_cost_table(report: dict, log) -> None:
    log(f"{'width':>6}{'build ms':>10}{'async_eval ms':>15}{'device ms':>11}{'commit ms':>11}{'primitives':>12}")
    for r in report["forwards"]:
        commit = "-" if r["commit_ms"] is None else f"{r['commit_ms']:.2f}"
        log(f"{r['width']:>6}{r['build_ms']:>10.2f}{r['async_eval_ms']:>15.2f}{r['device_ms']:>11.2f}{commit:>11}"
            f"{r['primitives']:>12}")
        top = list(r["primitives_by_type"].items())[:8]
        log("       " + ", ".join(f"{name} {n}" for name, n in top))
    layers = report["layers"]
    log(f"pieces alone ({layers['gated_delta']} gated-delta and {layers['attention']} attention layers a forward; "
        "each layer includes its MLP):")
    log(f"{'width':>6}  {'piece':<19}{'build ms':>10}{'async_eval ms':>15}{'device ms':>11}{'primitives':>12}")
    for row in report["pieces"]:
        for name, r in row.items():
            if name != "width":
                log(f"{row['width']:>6}  {name:<19}{r['build_ms']:>10.3f}{r['async_eval_ms']:>15.3f}"
                    f"{r['device_ms']:>11.3f}{r['primitives']:>12}")
