"""Qwen3-Next layers that take the vectorized CPU activations
(`mtp_engine.kernels.cpu_activations`): the MoE blocks' SwiGLU (routed
experts and shared expert), the gated-delta layers' gated norms and the
gated attention layers. Each computes what mlx-lm's layer computes, bit for
bit, and falls back to it off the CPU or for other dtypes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextMLP,
    Qwen3NextRMSNormGated,
)
from mlx_lm.models.switch_layers import SwiGLU

from mtp_engine.kernels import cpu_activations as act
from mtp_engine.model.mtp_head import gated_attention_inputs, gated_attention_output
from mtp_engine.model.swap import share_weights, swap_modules


class FastAttention(Qwen3NextAttention):
    """Qwen3-Next's gated attention with the extension's attention softmax
    and sigmoid: mlx-lm 0.32's ``Qwen3NextAttention.__call__`` (as
    `gated_attention_inputs` and `gated_attention_output` mirror it)."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if not act.takes(x):
            return super().__call__(x, mask=mask, cache=cache)
        queries, keys, values, gate = gated_attention_inputs(self, x, cache.offset if cache is not None else 0)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = act.attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return gated_attention_output(self, output, gate, act.sigmoid)


class FastSwiGLU(SwiGLU):
    """mlx-lm's ``SwiGLU`` (``silu(gate) * x``)."""

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return act.silu(gate) * x if act.takes(gate) else super().__call__(x, gate)


class FastMLP(Qwen3NextMLP):
    """Qwen3-Next's dense MLP (the shared expert)."""

    def __call__(self, x: mx.array) -> mx.array:
        if not act.takes(x):
            return super().__call__(x)
        return self.down_proj(act.silu(self.gate_proj(x)) * self.up_proj(x))


class FastGatedNorm(Qwen3NextRMSNormGated):
    """Qwen3-Next's gated RMS norm (``precise_swiglu``)."""

    def __call__(self, hidden_states: mx.array, gate: mx.array | None = None) -> mx.array:
        if gate is None or mx.default_device() != mx.cpu:
            return super().__call__(hidden_states, gate)
        # precise_swiglu: SiLU of the gate in float32, whatever the model's dtype.
        x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
        return (act.silu(gate.astype(mx.float32)) * x.astype(mx.float32)).astype(hidden_states.dtype)


def install_fast_activations(*modules: nn.Module) -> int:
    """Swap those layers under ``modules`` (a trunk, an MTP head) for the
    versions above, sharing their weights; returns how many. The caller
    checks `cpu_activations.availability` first."""
    return swap_modules(modules, {
        SwiGLU: lambda m: share_weights(FastSwiGLU, m),
        Qwen3NextMLP: lambda m: share_weights(FastMLP, m),
        Qwen3NextRMSNormGated: lambda m: share_weights(FastGatedNorm, m),
        Qwen3NextAttention: lambda m: share_weights(FastAttention, m),
    })
