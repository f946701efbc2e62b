"""The gated-delta recurrence over T tokens as one MLX CPU primitive.

On MLX's CPU backend, mlx-lm runs the recurrence as a step of about twenty
primitives per token and layer, and each primitive costs a fixed dispatch
far above its arithmetic (a state is 64 x 64 per head). A verify forward over
T tokens pays that T times in every gated-delta layer: it was the term that
held speculative decoding back on the CPU (README, Benchmarks).

``_mtp_gdn`` (``native/gdn_tokens.cpp``, built into the environment by
``make install``) is an MLX C++ extension with one primitive that runs all T
tokens in a single dispatch and writes the state after each. It computes
what mlx-lm's ``_gated_delta_step_ops`` computes, element for element, in
the same order (tests check the outputs and states bit for bit against it).
The engine runs it for every gated-delta forward of its own on the CPU:
decode, verify and prompt prefill.

Set ``MTP_CPU_RECURRENCE=0`` to run mlx-lm's ops instead.
"""

from __future__ import annotations

import mlx.core as mx

from mtp_engine.backend import load_extension


def _works(module) -> bool:
    x = mx.ones((1, 1, 1, 2))
    gate = mx.ones((1, 1, 1))
    y, s = module.gated_delta_tokens(x, x, x, gate, gate, mx.zeros((1, 1, 2, 2)), True)
    mx.eval(y, s)
    return y.tolist() == [[[[2.0, 2.0]]]]


def extension():
    """The ``_mtp_gdn`` module, or None when it is not built, is disabled, or
    does not work with this MLX (checked once with a tiny call: a nanobind
    ABI mismatch shows up as a TypeError there)."""
    return load_extension("_mtp_gdn", "MTP_CPU_RECURRENCE", _works)


def serves(layer) -> bool:
    """Whether the primitive runs this gated-delta layer's recurrence: on
    MLX's CPU backend, float32 weights, the extension present."""
    return (
        mx.default_device() == mx.cpu
        and not layer.training
        and layer.A_log.dtype == mx.float32
        and extension() is not None
    )


def gated_delta_tokens(q, k, v, g, beta, state, keep_states: bool) -> tuple[mx.array, mx.array]:
    """Outputs ``[B, T, H, Dv]`` and states ``[T or 1, B, H, Dv, Dk]`` (after
    every token, or after the last only) for ``q, k [B, T, H, Dk]`` (heads
    already repeated to the value heads), ``v [B, T, H, Dv]``, gates and
    betas ``[B, T, H]`` and the state before the first token."""
    return extension().gated_delta_tokens(q, k, v, g, beta, state, keep_states)
