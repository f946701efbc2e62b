"""The gated-delta recurrence as one MLX CPU primitive (`native/cpu_recurrence.cpp`,
`mtp_engine.cpu_recurrence`): the same numbers as mlx-lm's ops, bit for bit,
for every token's output and state, and the engine's forwards run it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import _gated_delta_step_ops

from mtp_engine.kernels import cpu_recurrence, recurrence
from mtp_engine.model.gated_delta import CapturingGatedDeltaNet

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or cpu_recurrence.extension() is None,
    reason="needs MLX's CPU backend and the _mtp_cpu_recurrence extension (make install builds it)",
)


def inputs(B, T, H, Dk, Dv, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, H, Dk)) * 0.2
    k = mx.random.normal((B, T, H, Dk)) * 0.2
    v = mx.random.normal((B, T, H, Dv))
    g = mx.sigmoid(mx.random.normal((B, T, H)) + 2)
    beta = mx.sigmoid(mx.random.normal((B, T, H)))
    state = mx.random.normal((B, H, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


def ops_reference(q, k, v, g, beta, state):
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), mx.stack(states)


# T >= 8 takes the primitive's transposed-state loops (prefill), fewer tokens
# the row-by-row ones; both must give mlx-lm's numbers.
@pytest.mark.parametrize("B, T, H, Dk, Dv", [(1, 1, 4, 64, 64), (2, 5, 4, 16, 16), (1, 9, 2, 128, 128),
                                             (3, 4, 8, 32, 64), (2, 12, 4, 64, 64), (1, 33, 2, 16, 32)])
def test_equals_mlx_lm_ops_bit_for_bit(B, T, H, Dk, Dv):
    args = inputs(B, T, H, Dk, Dv)
    y, states = cpu_recurrence.gated_delta_tokens(*args, keep_states=True)
    ref_y, ref_states = ops_reference(*args)
    assert y.shape == (B, T, H, Dv) and states.shape == (T, B, H, Dv, Dk)
    assert mx.array_equal(y, ref_y).item()
    assert mx.array_equal(states, ref_states).item()


def test_last_state_only_and_one_token_launches_agree():
    q, k, v, g, beta, state = inputs(2, 6, 4, 16, 16, seed=3)
    y, states = cpu_recurrence.gated_delta_tokens(q, k, v, g, beta, state, keep_states=True)
    y_last, last = cpu_recurrence.gated_delta_tokens(q, k, v, g, beta, state, keep_states=False)
    assert last.shape[0] == 1 and mx.array_equal(last[0], states[-1]).item()
    assert mx.array_equal(y_last, y).item()
    s = state
    for t in range(6):  # one token at a time, as plain decoding runs it
        sl = slice(t, t + 1)
        y1, s1 = cpu_recurrence.gated_delta_tokens(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s, False)
        assert mx.array_equal(y1[:, 0], y[:, t]).item() and mx.array_equal(s1[0], states[t]).item()
        s = s1[0]


def test_a_prefill_launch_equals_one_token_launches():
    # 20 tokens in one launch (transposed-state loops) against 20 launches of
    # one token (row-by-row loops), as a prompt's prefill and plain decoding.
    q, k, v, g, beta, state = inputs(1, 20, 4, 64, 64, seed=7)
    y, last = cpu_recurrence.gated_delta_tokens(q, k, v, g, beta, state, keep_states=False)
    s = state
    for t in range(20):
        sl = slice(t, t + 1)
        y1, s1 = cpu_recurrence.gated_delta_tokens(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s, False)
        assert mx.array_equal(y1[:, 0], y[:, t]).item()
        s = s1[0]
    assert mx.array_equal(s, last[0]).item()


def test_inside_compile_and_on_strided_inputs():
    q, k, v, g, beta, state = inputs(1, 4, 4, 16, 16, seed=5)
    want = cpu_recurrence.gated_delta_tokens(q, k, v, g, beta, state, True)
    got = mx.compile(lambda *a: cpu_recurrence.gated_delta_tokens(*a, True))(q, k, v, g, beta, state)
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got))
    qt = mx.swapaxes(mx.swapaxes(q, 1, 2) + 0, 1, 2)  # same values, other strides
    strided = cpu_recurrence.gated_delta_tokens(qt, k, v, g, beta, state, True)
    assert mx.array_equal(strided[0], want[0]).item()


@pytest.mark.parametrize("change, message", [
    (lambda a: [a[0].astype(mx.float16), *a[1:]], "q must be float32"),
    (lambda a: [*a[:3], a[3][..., None], *a[4:]], "g must have 3 dimensions"),
    (lambda a: [*a[:5], a[5][:, :2]], "shapes do not agree"),
])
def test_bad_inputs_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        cpu_recurrence.gated_delta_tokens(*change(list(inputs(1, 2, 4, 16, 16))), True)


def test_the_engine_runs_it(tiny_engine):
    layers = [layer.linear_attn for layer in tiny_engine.model.layers if layer.is_linear]
    assert layers and all(isinstance(l, CapturingGatedDeltaNet) for l in layers)
    assert all(l.recurrence == recurrence.CPU_PRIMITIVE for l in layers)
