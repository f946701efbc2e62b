"""MLX's float32 SiLU, softmax and CPU attention, vectorized, for the
engine's forwards on the CPU backend.

On Linux x86-64, MLX's CPU backend computes ``exp`` one element at a time,
with a libm call for each of its polynomial's six fused multiply-adds: about
11 ns an element for ``mx.sigmoid``, ``nn.silu`` and the precise softmax of
its CPU attention, compiled or not. A prompt's prefill applies SiLU to every
gated-delta layer's conv output and gated norm and to every MoE block's
experts, and a softmax over every attention layer's scores; on the shipped
model that was 40% of the prefill.

``_mtp_act`` (``native/activations.cpp``, built by ``make install``) computes
the same functions, operation for operation, in vectorized loops: bit for
bit what ``mx.sigmoid``, ``nn.silu`` and ``mx.softmax(..., precise=True)``
give (the tests compare them over millions of float32 values).

`install_fast_activations` swaps, on loaded model instances, the MoE blocks'
SwiGLU (routed experts and shared expert), the gated-delta layers' gated
norms and the gated attention layers for versions that use it; `mix_tokens`
uses `silu` for the conv output. `attention` runs the ops MLX's CPU
``scaled_dot_product_attention`` runs (its fallback) with the primitive's
softmax, so it too is bit for bit MLX's. Float32 arrays on the CPU take it
at every width. Measured side by side on the shipped model: prefill of a
150-token prompt 55.8 -> 31.0 ms, a verify forward over 5 tokens 4.7-5.4 ->
4.3-4.6 ms, one token level. Its derivatives are MLX ops, so training (the
head's distillation) runs through it too. Set ``MTP_CPU_ACTIVATIONS=0`` to
turn it off.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP, Qwen3NextRMSNormGated
from mlx_lm.models.switch_layers import SwiGLU

from mtp_engine.backend import load_extension
from mtp_engine.mtp_head import gated_attention_inputs, gated_attention_output


def _works(module) -> bool:
    x = mx.array([-1.0, 0.0, 2.0])
    return mx.array_equal(module.silu(x), nn.silu(x)).item()


def extension():
    """The ``_mtp_act`` module, or None when it is not built, is disabled, or
    does not work with this MLX (checked once with a tiny call)."""
    return load_extension("_mtp_act", "MTP_CPU_ACTIVATIONS", _works)


def _available() -> bool:
    return mx.default_device() == mx.cpu and extension() is not None


def _takes(x: mx.array) -> bool:
    return x.dtype == mx.float32 and _available()


def silu(x: mx.array) -> mx.array:
    """``nn.silu(x)``, through the primitive where `_takes` says so."""
    return extension().silu(x) if _takes(x) else nn.silu(x)


def sigmoid(x: mx.array) -> mx.array:
    """``mx.sigmoid(x)``, through the primitive where `_takes` says so."""
    return extension().sigmoid(x) if _takes(x) else mx.sigmoid(x)


def attention(queries, keys, values, cache, scale: float, mask) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``. For float32 on the CPU
    (not a quantized cache) it runs what ``mx.fast.scaled_dot_product_attention``
    runs there (MLX's fallback: scaled queries, grouped heads, scores, the
    mask, a precise softmax, the values) with the primitive's softmax, so the
    result is the same bit for bit (tested against it)."""
    if not _takes(queries) or hasattr(cache, "bits"):
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask)
    n_q, n_kv = queries.shape[1], keys.shape[1]
    repeats = n_q // n_kv
    q = mx.array(scale, queries.dtype) * queries
    k, v = keys, values
    if repeats > 1:
        q = mx.unflatten(q, 1, (n_kv, repeats))
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    lowest = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
    if isinstance(mask, str):  # "causal", the queries at the end of the keys
        k_len, q_len = k.shape[-2], q.shape[-2]
        scores = mx.where(mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None], scores, lowest)
    elif mask is not None:
        if repeats > 1 and mask.ndim >= 3:
            mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 else mx.unflatten(mask, -3, (n_kv, repeats))
        scores = mx.where(mask, scores, lowest) if mask.dtype == mx.bool_ else scores + mask.astype(scores.dtype)
    out = extension().softmax(scores) @ v
    return mx.flatten(out, 1, 2) if repeats > 1 else out


class FastAttention(Qwen3NextAttention):
    """Qwen3-Next's gated attention with `attention` and `sigmoid`: mlx-lm
    0.32's ``Qwen3NextAttention.__call__`` (as `gated_attention_inputs` and
    `gated_attention_output` mirror it), the two calls swapped."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if not _takes(x):
            return super().__call__(x, mask=mask, cache=cache)
        queries, keys, values, gate = gated_attention_inputs(self, x, cache.offset if cache is not None else 0)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return gated_attention_output(self, output, gate, sigmoid)


class FastSwiGLU(SwiGLU):
    """mlx-lm's ``SwiGLU`` (``silu(gate) * x``) with `silu`."""

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return silu(gate) * x if _takes(gate) else super().__call__(x, gate)


class FastMLP(Qwen3NextMLP):
    """Qwen3-Next's dense MLP (the shared expert) with `silu`."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _takes(x):
            return super().__call__(x)
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class FastGatedNorm(Qwen3NextRMSNormGated):
    """Qwen3-Next's gated RMS norm (``precise_swiglu``) with `silu`."""

    def __call__(self, hidden_states: mx.array, gate: mx.array | None = None) -> mx.array:
        if gate is None or not _available():
            return super().__call__(hidden_states, gate)
        # precise_swiglu: SiLU of the gate in float32, whatever the model's dtype.
        x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
        return (silu(gate.astype(mx.float32)) * x.astype(mx.float32)).astype(hidden_states.dtype)


def install_fast_activations(*modules: nn.Module) -> int:
    """Swap the SwiGLU activations, shared-expert MLPs, gated norms and
    gated attention layers under
    ``modules`` (a trunk, an MTP head) for the versions above, sharing their
    weights. Does nothing unless the extension is available on the CPU
    backend. Returns how many were swapped."""
    if not _available():
        return 0
    from mtp_engine.recurrent import share_weights, swap_modules  # recurrent imports this module

    return swap_modules(modules, {
        SwiGLU: lambda m: share_weights(FastSwiGLU, m),
        Qwen3NextMLP: lambda m: share_weights(FastMLP, m),
        Qwen3NextRMSNormGated: lambda m: share_weights(FastGatedNorm, m),
        Qwen3NextAttention: lambda m: share_weights(FastAttention, m),
    })
