"""The gated-delta recurrence over T tokens as one MLX CPU primitive.

On MLX's CPU backend, mlx-lm runs the recurrence as a step of about twenty
primitives per token and layer, and each primitive costs a fixed dispatch
far above its arithmetic (a state is 64 x 64 per head). A verify forward over
T tokens pays that T times in every gated-delta layer.

``_mtp_cpu_recurrence`` (``native/cpu_recurrence.cpp``, built by ``make
install``) is an MLX C++ extension with one primitive that runs all T tokens
in a single dispatch and writes the state after each. It computes what
mlx-lm's ``_gated_delta_step_ops`` computes, element for element, in the same
order (tests check outputs and states bit for bit against it).
"""

from __future__ import annotations

import mlx.core as mx

from mtp_engine.kernels.extensions import load_extension, unavailable_reason

MODULE = "_mtp_cpu_recurrence"


def _works(module) -> bool:
    x = mx.ones((1, 1, 1, 2))
    gate = mx.ones((1, 1, 1))
    y, s = module.gated_delta_tokens(x, x, x, gate, gate, mx.zeros((1, 1, 2, 2)), True)
    mx.eval(y, s)
    return y.tolist() == [[[[2.0, 2.0]]]]


def extension():
    """The extension module, or None (see `availability`)."""
    return load_extension(MODULE, _works)


def availability() -> str | None:
    """None when the primitive can run here, else why not."""
    if mx.default_device() != mx.cpu:
        return "not MLX's CPU backend"
    if extension() is None:
        return unavailable_reason(MODULE)
    return None


def gated_delta_tokens(q, k, v, g, beta, state, keep_states: bool) -> tuple[mx.array, mx.array]:
    """Outputs ``[B, T, H, Dv]`` and states ``[T or 1, B, H, Dv, Dk]`` (after
    every token, or after the last only) for ``q, k [B, T, H, Dk]`` (heads
    already repeated to the value heads), ``v [B, T, H, Dv]``, gates and
    betas ``[B, T, H]`` and the state before the first token."""
    return extension().gated_delta_tokens(q, k, v, g, beta, state, keep_states)
