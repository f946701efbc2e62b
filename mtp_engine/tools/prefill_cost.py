"""Where a prompt's prefill goes: ``python -m mtp_engine.bench --suite
prefill-cost``.

Prompt prefill is half or more of a batched job's time on the H200 (the
80B-A3B shapes at B=32 with 1K-token prompts), so it caps every speedup
that includes it. This suite times one prompt's whole prefill
(`MTPEngine.prefill`), then the trunk's pieces alone over that prompt's
length, each evaluated and waited for:

- one gated-delta decoder layer, its mixer, the recurrence alone (the path
  the engine chose for it) and its input projections;
- one attention decoder layer and its mixer;
- the MLP half (MoE: the block, its routing (softmax, top-k and scores,
  `EngineSparseMoeBlock.route`), its shared expert, the routed experts'
  products in the tensor-core kernel where the block runs it
  (`EngineOptions.prefill_moe_kernel`), and grouped in blocks of each
  ``--block-rows`` as `mtp_engine.model.moe.grouped_switch_glu` runs them
  without it).

The layer counts give each kind's share of the whole (``estimate_ms``: the
two layer kinds times their counts). Medians of the repeats after a
warm-up, milliseconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from mtp_engine.cache.capture import EngineKVCache, StateCaptureCache, make_main_cache
from mtp_engine.kernels import recurrence as rec
from mtp_engine.model.gated_delta import projections, recurrence_path
from mtp_engine.model.moe import EngineSparseMoeBlock, grouped_switch_glu


def _ms(run: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``run()`` evaluated and synchronized, after
    one untimed call."""
    laps = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        mx.eval(run())
        mx.synchronize()
        if i:
            laps.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(laps), 3)


def prefill_cost_suite(engine, prompt: list[int], block_rows: list[int], repeats: int = 5) -> dict:
    """The whole prefill of ``prompt`` and each piece alone over its length."""
    if not block_rows or any(not isinstance(r, int) or r < 1 for r in block_rows):
        raise ValueError(f"block_rows must be positive ints, got {block_rows!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if len(prompt) < 2:
        raise ValueError(f"the prompt needs at least 2 tokens, got {len(prompt)}")
    layers = engine.model.model.layers
    linear = [layer for layer in layers if layer.is_linear]
    attention = [layer for layer in layers if not layer.is_linear]
    # The chunk a prefill feeds (all but the last token), as embeddings.
    tokens = mx.array(prompt[:-1])[None]
    h = engine.model.model.embed_tokens(tokens)
    mx.eval(h)
    pieces = {"prefill": _ms(lambda: engine.prefill(prompt, make_main_cache(engine.model), False)[1], repeats)}
    if linear:
        layer = linear[0]
        mixer = layer.linear_attn
        x = layer.input_layernorm(h)
        mx.eval(x)
        pieces["gated_delta_layer"] = _ms(lambda: layer(h, None, StateCaptureCache(2)), repeats)
        pieces["gated_delta_mixer"] = _ms(lambda: mixer(x, None, StateCaptureCache(2)), repeats)
        pieces["gated_delta_projections"] = _ms(lambda: projections(mixer, x), repeats)
        pieces["recurrence"] = _ms(_recurrence(mixer, x), repeats)
    if attention:
        layer = attention[0]
        x = layer.input_layernorm(h)
        mx.eval(x)
        pieces["attention_layer"] = _ms(lambda: layer(h, "causal", EngineKVCache()), repeats)
        pieces["attention_mixer"] = _ms(lambda: layer.self_attn(x, "causal", EngineKVCache()), repeats)
    mlp = layers[0].mlp
    x = layers[0].post_attention_layernorm(h)
    mx.eval(x)
    pieces["mlp"] = _ms(lambda: mlp(x), repeats)
    blocks = {}
    if isinstance(mlp, EngineSparseMoeBlock):  # an MoE block (with contiguous_moe, the default)
        pieces["router"] = _ms(lambda: mlp.route(x), repeats)
        pieces["shared_expert"] = _ms(lambda: mlp.shared_expert(x), repeats)
        inds = mlp.route(x)[0]
        mx.eval(inds)
        if mlp.prefill_kernel:
            from mtp_engine.kernels import cuda_moe

            pieces["experts_tensor_cores"] = _ms(lambda: cuda_moe.tiles_switch_glu(mlp.switch_mlp, x, inds), repeats)
        for rows in block_rows:
            blocks[rows] = _ms(lambda: grouped_switch_glu(mlp.switch_mlp, x, inds, rows), repeats)
    estimate = len(linear) * pieces.get("gated_delta_layer", 0.0) + len(attention) * pieces.get("attention_layer", 0.0)
    return {
        "settings": {"prompt_tokens": len(prompt), "repeats": repeats, "statistic": "median after a warm-up",
                     "recurrence": recurrence_path(engine.model)},
        "layers": {"gated_delta": len(linear), "attention": len(attention)},
        "pieces_ms": pieces,
        "expert_blocks_ms": {str(rows): ms for rows, ms in blocks.items()},
        "estimate_ms": round(estimate, 3),
    }


def _recurrence(mixer, x: mx.array) -> Callable[[], mx.array]:
    """The gated-delta recurrence alone over ``x``'s tokens, on the path the
    engine chose, with inputs of the layer's shapes."""
    B, S, _ = x.shape
    keys = mx.random.split(mx.random.key(0), 5)
    q = mx.random.normal((B, S, mixer.num_k_heads, mixer.head_k_dim), key=keys[0]).astype(x.dtype)
    k = mx.random.normal((B, S, mixer.num_k_heads, mixer.head_k_dim), key=keys[1]).astype(x.dtype)
    v = mx.random.normal((B, S, mixer.num_v_heads, mixer.head_v_dim), key=keys[2]).astype(x.dtype)
    a = mx.random.normal((B, S, mixer.num_v_heads), key=keys[3]).astype(x.dtype)
    b = mx.random.normal((B, S, mixer.num_v_heads), key=keys[4]).astype(x.dtype)
    state = mx.zeros((B, mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim), dtype=mx.float32)
    mx.eval(q, k, v, a, b, state)
    return lambda: rec.gated_delta_tokens(mixer.recurrence, mixer, q, k, v, a, b, state, None, False)[0]


def print_prefill_cost_table(report: dict, log) -> None:
    s, layers, pieces = report["settings"], report["layers"], report["pieces_ms"]
    log(f"prefill of {s['prompt_tokens']} tokens: {pieces['prefill']:.2f} ms "
        f"({layers['gated_delta']} gated-delta and {layers['attention']} attention layers, "
        f"estimate from the layers alone {report['estimate_ms']:.2f} ms; recurrence: {s['recurrence']})")
    for name, ms in pieces.items():
        if name != "prefill":
            log(f"  {name:<24}{ms:>10.3f} ms")
    for rows, ms in report["expert_blocks_ms"].items():
        log(f"  experts in blocks of {rows:<4}{ms:>10.3f} ms")
