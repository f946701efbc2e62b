"""Per-token captured states equal the states of token-by-token decoding,
on every recurrence path this machine runs."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
import pytest
from mlx_lm.utils import load as mlx_lm_load

from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.kernels import cpu_recurrence, recurrence
from mtp_engine.model.gated_delta import (
    CapturingGatedDeltaNet,
    install_state_capture,
    recurrence_path,
)

PATHS = [recurrence.MLX_OPS, pytest.param(recurrence.CPU_PRIMITIVE, marks=pytest.mark.skipif(
    cpu_recurrence.availability() is not None, reason="needs the _mtp_cpu_recurrence extension"))]


@pytest.fixture(scope="module", params=PATHS)
def loaded(tiny_path, request):
    model, _ = mlx_lm_load(str(tiny_path))
    reference, _ = mlx_lm_load(str(tiny_path))
    install_state_capture(model, request.param)
    assert recurrence_path(model) == request.param
    return model, reference


def _prefill(model, tokens):
    caches = make_main_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def test_install_swaps_layers_and_shares_weights(loaded):
    model, reference = loaded
    swapped = [l.linear_attn for l in model.layers if l.is_linear]
    assert swapped and all(isinstance(a, CapturingGatedDeltaNet) for a in swapped)
    # Same parameter tree (names and values) as the untouched model.
    assert model.parameters().keys() == reference.parameters().keys()
    # Installing twice keeps the layer (and may change its path).
    first = swapped[0]
    install_state_capture(model, first.recurrence)
    assert [l.linear_attn for l in model.layers if l.is_linear][0] is first


def test_swapped_model_decodes_exactly_like_mlx_lm(loaded):
    model, reference = loaded
    tokens = mx.array([[5, 17, 40, 99, 3, 250, 7]])
    ours = model(tokens, cache=make_main_cache(model))
    theirs = reference(tokens, cache=reference.make_cache())
    assert mx.array_equal(ours, theirs)


@pytest.mark.parametrize("width", [1, 2, 4, 6])
def test_captured_states_equal_token_by_token_states(loaded, width):
    model, _ = loaded
    prompt = [11, 23, 5, 99, 140, 7, 8]
    new = [31, 200, 4, 17, 66, 2][:width]

    captured = _prefill(model, prompt)
    for c in captured:
        if isinstance(c, StateCaptureCache):
            c.begin_capture()
    model(mx.array(new)[None], cache=captured)

    stepped = _prefill(model, prompt)
    linear = [i for i, c in enumerate(captured) if isinstance(c, StateCaptureCache)]
    assert linear
    for t, token in enumerate(new):
        model(mx.array([[token]]), cache=stepped)
        mx.eval([c.state for c in stepped])
        for i in linear:
            conv, ssm = captured[i].captured[t]
            assert mx.array_equal(conv, stepped[i][0]), f"layer {i} conv state after token {t}"
            assert mx.array_equal(ssm, stepped[i][1]), f"layer {i} ssm state after token {t}"
    for i in linear:
        assert captured[i].capture is False  # one forward per begin_capture


def test_capture_forward_matches_plain_forward(loaded):
    model, _ = loaded
    prompt, new = [1, 2, 3, 4, 5], [6, 7, 8, 9]
    plain = _prefill(model, prompt)
    out_plain = model(mx.array(new)[None], cache=plain)
    capturing = _prefill(model, prompt)
    for c in capturing:
        if isinstance(c, StateCaptureCache):
            c.begin_capture()
    out_capturing = model(mx.array(new)[None], cache=capturing)
    assert mx.array_equal(out_plain, out_capturing)
    for a, b in zip(plain, capturing):
        xs, ys = tree_flatten(a.state), tree_flatten(b.state)
        assert len(xs) == len(ys) > 0
        for (_, x), (_, y) in zip(xs, ys):
            assert (x is None and y is None) or mx.array_equal(x, y)


def test_batched_capture_rows_are_independent(loaded):
    """Row r of a batch-P capture equals capturing row r alone."""
    model, _ = loaded
    rows = [[3, 9, 27], [4, 16, 64], [5, 25, 125]]
    batched = make_main_cache(model)
    for c in batched:
        if isinstance(c, StateCaptureCache):
            c.begin_capture()
    model(mx.array(rows), cache=batched)
    for r, row in enumerate(rows):
        single = make_main_cache(model)
        for c in single:
            if isinstance(c, StateCaptureCache):
                c.begin_capture()
        model(mx.array([row]), cache=single)
        for cb, cs in zip(batched, single):
            if isinstance(cb, StateCaptureCache):
                for (bc, bs), (sc, ss) in zip(cb.captured, cs.captured):
                    assert mx.array_equal(bc[r : r + 1], sc)
                    assert mx.array_equal(bs[r : r + 1], ss)


def test_captured_states_index_like_a_list(loaded):
    """Captured states are built when read; they index as a list would."""
    model, _ = loaded
    caches = _prefill(model, [1, 2, 3, 4, 5])
    for c in caches:
        if isinstance(c, StateCaptureCache):
            c.begin_capture()
    model(mx.array([[6, 7, 8]]), cache=caches)
    linear = [c for c in caches if isinstance(c, StateCaptureCache)]
    assert linear
    for c in linear:
        captured = c.captured
        assert len(captured) == 3 and len(list(captured)) == 3
        last_conv, last_ssm = captured[-1]
        assert mx.array_equal(last_conv, captured[2][0]) and mx.array_equal(last_ssm, captured[2][1])
        # The last captured state is the one the forward left in the cache.
        assert mx.array_equal(last_conv, c[0]) and mx.array_equal(last_ssm, c[1])
        with pytest.raises(IndexError):
            captured[3]
