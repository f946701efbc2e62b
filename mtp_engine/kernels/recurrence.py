"""The one place that picks how the gated-delta recurrence over T tokens
runs in the engine's forwards (as mlx-lm's ``gated_delta_update`` picks its
Metal kernel or its ops):

- `CUDA_KERNEL`: `mtp_engine.kernels.cuda_recurrence`, all tokens in one
  launch (the engine decodes single tokens through it too);
- `CPU_PRIMITIVE`: `mtp_engine.kernels.cpu_recurrence`, one MLX primitive;
- `MLX_OPS`: mlx-lm's own step once per token (Metal, bfloat16 on the CPU,
  a switch turned off, a model left training, a padding mask).

Each token gets the arithmetic of one-token decoding on that path, so the
states captured for every token of a verify forward are the states plain
decoding would reach.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.gated_delta import (  # the step is private: mlx-lm is pinned to 0.32.x
    _gated_delta_step_ops,
    compute_g,
    gated_delta_update,
)

from mtp_engine.cache.capture import StackedStates
from mtp_engine.kernels import cpu_recurrence

CUDA_KERNEL, CPU_PRIMITIVE, MLX_OPS = "cuda kernel", "cpu primitive", "mlx-lm ops"


def select(layer, want_cuda: bool, want_cpu: bool) -> tuple[str, str | None]:
    """The path for a gated-delta layer with its final weights, and, when a
    wanted fast path cannot run, why."""
    if mx.default_device() == mx.gpu:
        from mtp_engine.kernels import cuda_recurrence as cuda  # CUDA only
        if not want_cuda:
            return MLX_OPS, None
        why = cuda.availability() or (None if cuda.fits(layer) else "head dimensions do not fit its launch shape")
        return (MLX_OPS, why) if why else (CUDA_KERNEL, None)
    if not want_cpu:
        return MLX_OPS, None
    why = cpu_recurrence.availability() or (None if layer.A_log.dtype == mx.float32 else "weights are not float32")
    return (MLX_OPS, why) if why else (CPU_PRIMITIVE, None)


def gated_delta_tokens(
    path: str, layer, q, k, v, a, b, state: mx.array, mask: mx.array | None, keep_states: bool
) -> tuple[mx.array, Sequence]:
    """Outputs ``[B, S, Hv, Dv]`` and states (after every token, or the last
    only) of a gated-delta layer's recurrence over ``S`` tokens.

    Args:
        path: What `select` chose for the layer.
        layer: The layer (gate parameters, training flag).
        q, k: Normalized queries and keys ``[B, S, Hk, Dk]``.
        v: Values ``[B, S, Hv, Dv]``; a, b: gate inputs ``[B, S, Hv]``.
        state: The state before the first token ``[B, Hv, Dv, Dk]``.
        mask: Optional ``[B, S]`` padding mask (takes mlx-lm's path).
        keep_states: Return the state after every token.
    """
    if layer.training or mask is not None:
        path = MLX_OPS
    if path == CUDA_KERNEL:
        from mtp_engine.kernels import cuda_recurrence  # CUDA only

        return cuda_recurrence.gated_delta_tokens(q, k, v, a, b, layer.A_log, layer.dt_bias, state, keep_states)
    if path == CPU_PRIMITIVE or (path == MLX_OPS and mx.default_device() == mx.cpu and mask is None):
        # mlx-lm's ops path as ``gated_delta_ops`` runs it: gates, betas and
        # grouped heads for all tokens at once, then one step per token.
        beta = mx.sigmoid(b)
        g = compute_g(layer.A_log, a, layer.dt_bias)
        if (repeat := v.shape[-2] // q.shape[-2]) > 1:
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        if path == CPU_PRIMITIVE:
            out, states = cpu_recurrence.gated_delta_tokens(q, k, v, g, beta, state, keep_states)
            return out, StackedStates(states)

        def step(t: int, state: mx.array) -> tuple[mx.array, mx.array]:
            y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
            return mx.expand_dims(y, 1), state

    else:

        def step(t: int, state: mx.array) -> tuple[mx.array, mx.array]:
            return gated_delta_update(
                q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], a[:, t : t + 1], b[:, t : t + 1],
                layer.A_log, layer.dt_bias, state, None if mask is None else mask[:, t : t + 1],
                use_kernel=not layer.training,
            )

    S = q.shape[1]
    ys, ssm_states = [], []
    for t in range(S):
        y, state = step(t, state)
        ys.append(y)
        if keep_states or t == S - 1:
            ssm_states.append(state)
    return (ys[0] if S == 1 else mx.concatenate(ys, axis=1)), ssm_states
