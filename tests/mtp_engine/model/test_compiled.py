"""Compiled decoder layers compute exactly what the eager layers compute, and
only the engine's own forwards take them."""

from __future__ import annotations

import io

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

from mtp_engine import MTPEngine
from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.cache.batch import append_row, commit_rows, filter_rows, make_batch_cache
from mtp_engine.model.compiled import (
    CompiledDecoderLayer,
    CompiledMTPLayer,
    install_compiled_layers,
)
from mtp_engine.model.loader import load_checkpoint
from mtp_engine.options import MAX_DRAFT_TOKENS, MAX_VERIFY_WIDTH, EngineOptions
from tests.mtp_engine.cache.helpers import begin_capture, prefilled

PROMPT = [12, 7, 99, 31, 5, 150, 42, 8, 77, 3]


@pytest.fixture(scope="module")
def pair(tiny_path):
    # Without layer_dispatch: a dispatched verify forward's graph ends at its
    # last layer, and the graph sizes below compare whole layers.
    compiled = load_checkpoint(tiny_path, options=EngineOptions(compile_layers=True, layer_dispatch=False))
    eager = load_checkpoint(tiny_path, options=EngineOptions(compile_layers=False, layer_dispatch=False))
    return compiled, eager


def _prefill(model, tokens=PROMPT):
    return prefilled(model, tokens)


def _captured(caches):
    return [cp for c in caches if isinstance(c, StateCaptureCache) for cp in c.captured]


def _arrays(tree) -> list[mx.array]:
    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def _graph_size(arrays) -> int:
    """Operations in the graph behind ``arrays`` (compiled layers fuse many)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return dot.getvalue().count("label")


def test_install_shares_weights_and_is_idempotent(pair, tiny_path):
    compiled, eager = pair
    layers = compiled.model.layers
    assert all(isinstance(l, CompiledDecoderLayer) for l in layers)
    assert all(isinstance(l, CompiledMTPLayer) for l in compiled.head.layers)
    assert not any(isinstance(l, CompiledDecoderLayer) for l in eager.model.layers)
    assert all(type(l) is Qwen3NextDecoderLayer for l in eager.model.layers)
    # Same parameter tree, names and values, as the eager model.
    ours, theirs = compiled.model.parameters(), eager.model.parameters()
    assert ours.keys() == theirs.keys()
    first = layers[0]
    install_compiled_layers(compiled.model, compiled.head)
    assert compiled.model.layers[0] is first


def test_default_follows_the_backend(tiny_path):
    # This suite runs on MLX's CPU backend, where compiled layers are the default.
    assert mx.default_device() == mx.cpu
    engine = MTPEngine.load(tiny_path)
    assert all(isinstance(l, CompiledDecoderLayer) for l in engine.model.layers)
    engine = MTPEngine.load(tiny_path, compile_layers=False)
    assert not any(isinstance(l, CompiledDecoderLayer) for l in engine.model.layers)


@pytest.mark.parametrize("width", [1, 2, 4, 7])
def test_verify_forward_is_bit_identical(pair, width):
    compiled, eager = pair
    new = [31, 200, 4, 17, 66, 2, 90][:width]
    results = []
    for ckpt in (compiled, eager):
        caches = _prefill(ckpt.model)
        begin_capture(caches)
        logits = ckpt.model(mx.array([new]), cache=caches)
        results.append((logits, _captured(caches), [c.state for c in caches]))
    (lc, cc, sc), (le, ce, se) = results
    assert _graph_size([lc]) < _graph_size([le])  # the compiled path ran
    assert mx.array_equal(lc, le)
    for ours, theirs in ((cc, ce), (sc, se)):
        ours, theirs = _arrays(ours), _arrays(theirs)
        assert len(ours) == len(theirs) > 0
        assert all(mx.array_equal(a, b) for a, b in zip(ours, theirs))


def test_decode_steps_and_tiled_rows_are_bit_identical(pair):
    compiled, eager = pair
    rows = [[60, 61, 62, 63], [70, 71, 72, 73], [80, 81, 82, 83]]
    outs = []
    for ckpt in (compiled, eager):
        caches = make_batch_cache(ckpt.model)  # a batch of one row, as the decoder runs it
        append_row(caches, _prefill(ckpt.model), 0)
        steps = [ckpt.model(mx.array([[t]]), cache=caches) for t in (5, 9, 200)]
        filter_rows(caches, [0] * len(rows), trim=False)  # a row per path
        begin_capture(caches)
        tree = ckpt.model(mx.array(rows), cache=caches)
        commit_rows(caches, 4, [2] * len(rows))
        filter_rows(caches, [1], trim=False)
        after = ckpt.model(mx.array([[11]]), cache=caches)
        outs.append(steps + [tree, after])
    for a, b in zip(*outs):
        assert mx.array_equal(a, b)


def test_mlx_lm_caches_and_prefill_stay_eager(pair):
    compiled, eager = pair

    def sizes(make_cache, tokens):
        out = []
        for ckpt in (compiled, eager):
            caches = make_cache(ckpt.model)
            out.append(_graph_size([ckpt.model(mx.array([tokens]), cache=caches)]))
            mx.eval([c.state for c in caches])
        return out

    # mlx-lm's own caches (its generate_step, the lossless reference): eager.
    ours, theirs = sizes(lambda m: m.make_cache(), [5, 6, 7])
    assert ours == theirs
    # The engine's caches: eager past MAX_VERIFY_WIDTH tokens (prompt
    # prefill), compiled up to it.
    ours, theirs = sizes(make_main_cache, list(range(1, MAX_VERIFY_WIDTH + 3)))
    assert ours == theirs
    ours, theirs = sizes(_prefill, [5])
    assert ours < theirs


def test_the_widest_verify_forward_is_compiled(pair):
    """A chain of the most drafts (`MAX_DRAFT_TOKENS`) verifies
    `MAX_VERIFY_WIDTH` tokens: compiled like every narrower verify, with the
    eager layers' bits."""
    outs, sizes = [], []
    for ckpt in pair:
        caches = _prefill(ckpt.model)
        begin_capture(caches)
        out = ckpt.model(mx.array([list(range(5, 6 + MAX_DRAFT_TOKENS))]), cache=caches)
        sizes.append(_graph_size([out]))
        outs.append(out)
    assert outs[0].shape[1] == MAX_VERIFY_WIDTH
    assert sizes[0] < sizes[1]
    assert mx.array_equal(*outs)


@pytest.mark.parametrize("width", [1, 3])
def test_mtp_head_is_bit_identical(pair, width):
    compiled, eager = pair
    dim = compiled.config["hidden_size"]
    hidden = mx.random.normal((1, width, dim), key=mx.random.key(width))
    embeddings = mx.random.normal((1, width, dim), key=mx.random.key(width + 100))
    outs = []
    for ckpt in (compiled, eager):
        cache = ckpt.head.make_cache()
        ckpt.head(hidden[:, :1], embeddings[:, :1], cache)  # a position already in the cache
        outs.append(ckpt.head(hidden, embeddings, cache))
    assert _graph_size(outs[:1]) < _graph_size(outs[1:])
    assert mx.array_equal(*outs)


def test_engine_output_and_drafts_are_identical(tiny_path):
    runs = []
    for flag in (True, False):
        engine = MTPEngine.load(tiny_path, compile_layers=flag)
        out = engine.generate(PROMPT, max_tokens=24, mode="chain", draft_tokens=3, trace=True)
        runs.append((out.tokens, [s.drafts for s in out.trace]))
    assert runs[0] == runs[1]
