"""The CUDA gated-delta kernel: the same recurrence as mlx-lm's ops, and the
same arithmetic per token whether tokens come alone or together (these need
a CUDA device with MLX's CUDA build and are skipped elsewhere); and the
engine's use of it, which runs on every backend."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import _gated_delta_step_ops, gated_delta_update

from mtp_engine.cache.capture import StackedStates
from mtp_engine.kernels import cuda_recurrence, recurrence
from mtp_engine.backend import is_cuda_backend

needs_cuda = pytest.mark.skipif(not is_cuda_backend(), reason="needs MLX on a CUDA GPU")


def _inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0):
    keys = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0]).astype(dtype) * Dk**-0.5
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1])
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2]).astype(dtype)
    a = mx.random.normal((B, T, Hv), key=keys[3]).astype(dtype)
    b = mx.random.normal((B, T, Hv), key=keys[4]).astype(dtype)
    A_log = mx.random.uniform(-1, 1, (Hv,), key=keys[5])
    dt_bias = mx.random.normal((Hv,), key=keys[6])
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[7]) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B, T", [(1, 1), (1, 4), (3, 5), (2, 64)])
def test_matches_mlx_lm_recurrence(dtype, B, T):
    q, k, v, a, b, A_log, dt_bias, state = _inputs(B, T, 2, 4, 64, 32, dtype)
    y_ref, s_ref = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    y, states = cuda_recurrence.gated_delta_tokens(q, k, v, a, b, A_log, dt_bias, state, keep_states=False)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert y.dtype == dtype and len(states) == 1 and states[0].shape == (B, 4, 32, 64)
    assert mx.allclose(y.astype(mx.float32), y_ref.astype(mx.float32), atol=tol, rtol=tol)
    assert mx.allclose(states[0], s_ref, atol=1e-5, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_every_token_equals_one_token_launches(dtype):
    """A verify forward's outputs, every token's state, and each row's state
    at its own token (what a commit keeps) are those of one-token launches."""
    B, T = 3, 5
    q, k, v, a, b, A_log, dt_bias, state = _inputs(B, T, 2, 4, 64, 32, dtype, seed=3)
    y, states = cuda_recurrence.gated_delta_tokens(q, k, v, a, b, A_log, dt_bias, state, keep_states=True)
    assert isinstance(states, cuda_recurrence.DeferredStates) and len(states) == T
    every = states.stacked()
    assert every.shape == (T, B, 4, 32, 64)
    s, one_token = state, []
    for t in range(T):
        sl = slice(t, t + 1)
        y1, s1 = cuda_recurrence.gated_delta_tokens(
            q[:, sl], k[:, sl], v[:, sl], a[:, sl], b[:, sl], A_log, dt_bias, s, keep_states=False
        )
        s = s1[0]
        one_token.append(s)
        assert mx.array_equal(y[:, sl], y1), f"output of token {t}"
        assert mx.array_equal(every[t], s), f"state after token {t}"
        assert mx.array_equal(states[t], s), f"state after token {t}, every row there"
    last = [4, 0, 2]
    kept = states.rows(mx.array(last))
    for row, t in enumerate(last):
        assert mx.array_equal(kept[row], one_token[t][row]), f"row {row} at token {t}"
    # One row writes its states at once (a commit slices them).
    y1, states1 = cuda_recurrence.gated_delta_tokens(
        q[:1], k[:1], v[:1], a[:1], b[:1], A_log, dt_bias, state[:1], keep_states=True
    )
    assert isinstance(states1, StackedStates) and mx.array_equal(y1, y[:1])
    assert mx.array_equal(states1.stacked(), every[:, :1])


# -- the engine's routing through the kernel, on any backend ----------------
#
# The kernel itself needs CUDA; the engine code around it (which forwards go
# through it in which mode, commits from each row's own token) runs here with
# a stand-in of the launch that computes the recurrence with mlx-lm's ops,
# token by token. With it, every mode must still give mlx-lm's greedy output
# exactly, one sequence at a time and batched.


def _ops_stand_in(calls, kept):
    def launch(q, k, v, g, beta, state, mode, last=None):
        B, T = q.shape[:2]
        calls.append((T, mode))
        if (repeat := v.shape[-2] // q.shape[-2]) > 1:
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        ys, states = [], []
        for t in range(T):
            y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
            ys.append(y[:, None])
            states.append(state)
        y, every = mx.concatenate(ys, axis=1), mx.stack(states)
        if mode == cuda_recurrence.AT:
            kept.append(last.tolist())
            return mx.zeros((1,)), every[last, mx.arange(B)][None]
        return y, {cuda_recurrence.FINAL: every[-1:], cuda_recurrence.EVERY: every}.get(mode, mx.zeros((1,)))

    return launch


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the stand-in stands in for the kernel off CUDA")
def test_engine_forwards_take_the_kernel_path_and_stay_lossless(tiny_path, reference_factory, monkeypatch):
    from mtp_engine import MTPEngine
    from tests.conftest import PROMPTS

    calls: list[tuple[int, int]] = []  # (tokens, mode) per launch
    kept: list[list[int]] = []  # each row's last kept token, per launch in mode AT
    monkeypatch.setattr(recurrence, "select", lambda layer, cuda, cpu: (recurrence.CUDA_KERNEL, None))
    monkeypatch.setattr(cuda_recurrence, "_launch", _ops_stand_in(calls, kept))
    engine = MTPEngine.load(tiny_path, compile_layers=False)
    reference = reference_factory(tiny_path)
    wants = {}
    for prompt in PROMPTS[:3]:
        ids = engine.encode(prompt)
        want, _ = reference.greedy(ids, 32)
        wants[prompt] = want
        for mode, kwargs in [("baseline", {}), ("chain", {"draft_tokens": 3}), ("tree", {"draft_tokens": 3}),
                             ("paths", {"draft_tokens": 3, "paths": 2})]:
            got = engine.generate(ids, max_tokens=32, mode=mode, **kwargs).tokens
            # The engine stops at EOS, which it leaves out; mlx-lm goes on.
            assert got == want[: len(got)], (prompt, mode)
            assert len(got) == 32 or want[len(got)] in engine.eos_token_ids, (prompt, mode)
    FINAL, EVERY, OUTPUTS, AT = cuda_recurrence.FINAL, cuda_recurrence.EVERY, cuda_recurrence.OUTPUTS, cuda_recurrence.AT
    assert (1, FINAL) in calls  # one-token decoding
    assert (4, EVERY) in calls  # a chain's verify forwards of K+1 tokens
    assert (4, OUTPUTS) in calls and (4, AT) in calls  # the paths' (two rows): states deferred to the commit
    assert any(mode == FINAL and t > 4 for t, mode in calls)  # prompt prefill

    calls.clear()
    kept.clear()
    results = engine.generate_batch(PROMPTS[:3], batch_size=3, max_tokens=32, draft_tokens=3)
    for prompt, result in zip(PROMPTS[:3], results):
        want = wants[prompt]
        assert result.tokens == want[: len(result.tokens)], prompt
        assert len(result.tokens) == 32 or want[len(result.tokens)] in engine.eos_token_ids, prompt
    assert (4, OUTPUTS) in calls and (4, AT) in calls
    assert any(len(set(rows)) > 1 for rows in kept), "no commit kept its rows at different tokens"
