"""The CUDA gated-delta kernel: the same recurrence as mlx-lm's ops, and the
same arithmetic per token whether tokens come alone or together (these need
a CUDA device with MLX's CUDA build and are skipped elsewhere); and the
engine's use of it, which runs on every backend."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_update

from mtp_engine.kernels import cuda_recurrence, recurrence

needs_cuda = pytest.mark.skipif(
    not (mx.default_device() == mx.gpu and mx.cuda.is_available()), reason="needs MLX on a CUDA GPU"
)


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
    assert y.dtype == dtype and states.shape == (1, B, 4, 32, 64)
    assert mx.allclose(y.astype(mx.float32), y_ref.astype(mx.float32), atol=tol, rtol=tol)
    assert mx.allclose(states[0], s_ref, atol=1e-5, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_every_token_equals_one_token_launches(dtype):
    B, T = 2, 5
    q, k, v, a, b, A_log, dt_bias, state = _inputs(B, T, 2, 4, 64, 32, dtype, seed=3)
    y, states = cuda_recurrence.gated_delta_tokens(q, k, v, a, b, A_log, dt_bias, state, keep_states=True)
    assert states.shape == (T, B, 4, 32, 64)
    s = state
    for t in range(T):
        sl = slice(t, t + 1)
        y1, s1 = cuda_recurrence.gated_delta_tokens(
            q[:, sl], k[:, sl], v[:, sl], a[:, sl], b[:, sl], A_log, dt_bias, s, keep_states=False
        )
        assert mx.array_equal(y[:, sl], y1), f"output of token {t}"
        assert mx.array_equal(states[t], s1[0]), f"state after token {t}"
        s = s1[0]


# -- the engine's routing through the kernel, on any backend ----------------
#
# The kernel itself needs CUDA; the engine code around it (which forwards go
# through it, per-token versus last-only states, commits from its states)
# runs here with a stand-in of the same interface that computes the
# recurrence with mlx-lm's ops, token by token. With it, every mode must
# still give mlx-lm's greedy output exactly.


def _ops_stand_in(calls):
    def gated_delta_tokens(q, k, v, a, b, A_log, dt_bias, state, keep_states):
        calls.append((q.shape[1], keep_states))
        ys, states = [], []
        for t in range(q.shape[1]):
            sl = slice(t, t + 1)
            y, state = gated_delta_update(q[:, sl], k[:, sl], v[:, sl], a[:, sl], b[:, sl], A_log, dt_bias, state)
            ys.append(y)
            states.append(state)
        return mx.concatenate(ys, axis=1), mx.stack(states) if keep_states else state[None]

    return gated_delta_tokens


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the stand-in stands in for the kernel off CUDA")
def test_engine_forwards_take_the_kernel_path_and_stay_lossless(tiny_path, reference_factory, monkeypatch):
    from mtp_engine import MTPEngine
    from tests.conftest import PROMPTS

    calls: list[tuple[int, bool]] = []
    monkeypatch.setattr(recurrence, "select", lambda layer, cuda, cpu: (recurrence.CUDA_KERNEL, None))
    monkeypatch.setattr(cuda_recurrence, "gated_delta_tokens", _ops_stand_in(calls))
    engine = MTPEngine.load(tiny_path, compile_layers=False)
    reference = reference_factory(tiny_path)
    for prompt in PROMPTS[:3]:
        ids = engine.encode(prompt)
        want, _ = reference.greedy(ids, 32)
        for mode, kwargs in [("baseline", {}), ("chain", {"draft_tokens": 3}), ("tree", {"draft_tokens": 3}),
                             ("paths", {"draft_tokens": 3, "paths": 2})]:
            got = engine.generate(ids, max_tokens=32, mode=mode, **kwargs).tokens
            # The engine stops at EOS, which it leaves out; mlx-lm goes on.
            assert got == want[: len(got)], (prompt, mode)
            assert len(got) == 32 or want[len(got)] in engine.eos_token_ids, (prompt, mode)
    widths = {(t, keep) for t, keep in calls}
    assert (1, False) in widths  # one-token decoding
    assert any(keep and t == 4 for t, keep in widths)  # verify forwards of K+1 tokens
    assert any(not keep and t > 4 for t, keep in widths)  # prompt prefill
