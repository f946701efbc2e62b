"""MLX's float32 SiLU, sigmoid and CPU attention softmax, vectorized.

On Linux x86-64, MLX's CPU backend computes ``exp`` one element at a time,
with a libm call for each of its polynomial's fused multiply-adds: ``mx.sigmoid``,
``nn.silu`` and the precise softmax of its CPU attention cost about 11 ns an
element, compiled or not, and a prompt's prefill applies them to every layer.

``_mtp_cpu_activations`` (``native/cpu_activations.cpp``, built by ``make
install``) computes the same functions, operation for operation, in
vectorized loops: bit for bit what ``mx.sigmoid``, ``nn.silu`` and
``mx.softmax(..., precise=True)`` give (the tests compare them over millions
of float32 values). `attention` runs the ops MLX's CPU
``scaled_dot_product_attention`` runs (its fallback) with that softmax, so it
too is bit for bit MLX's. The layers that use these functions are in
`mtp_engine.model.activations`; callers check `takes` first.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from mtp_engine.kernels.extensions import load_extension, unavailable_reason

MODULE = "_mtp_cpu_activations"


def _works(module) -> bool:
    x = mx.array([-1.0, 0.0, 2.0])
    return mx.array_equal(module.silu(x), nn.silu(x)).item()


def extension():
    """The extension module, or None (see `availability`)."""
    return load_extension(MODULE, _works)


def availability() -> str | None:
    """None when the functions can run here, else why not."""
    if mx.default_device() != mx.cpu:
        return "not MLX's CPU backend"
    if extension() is None:
        return unavailable_reason(MODULE)
    return None


def takes(x: mx.array) -> bool:
    """Whether ``x`` goes through the extension: float32 on the CPU backend."""
    return x.dtype == mx.float32 and mx.default_device() == mx.cpu


def silu(x: mx.array) -> mx.array:
    """``nn.silu(x)`` for a float32 ``x`` on the CPU."""
    return extension().silu(x)


def sigmoid(x: mx.array) -> mx.array:
    """``mx.sigmoid(x)`` for a float32 ``x`` on the CPU."""
    return extension().sigmoid(x)


def attention(queries, keys, values, cache, scale: float, mask) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``. For float32 on the CPU
    (not a quantized cache) it runs what ``mx.fast.scaled_dot_product_attention``
    runs there (scaled queries, grouped heads, scores, the mask, a precise
    softmax, the values) with the extension's softmax."""
    if not takes(queries) or hasattr(cache, "bits"):
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
