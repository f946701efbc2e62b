"""The trunk's gated-delta layers, able to capture per-token states.

`install_state_capture` swaps each loaded gated-delta layer of one model
(``Qwen3NextGatedDeltaNet``, or Qwen3.5's ``GatedDeltaNet``) for a capturing
subclass that shares its weights. The two differ only in their input
projections (`projections`): Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``
hold q, k, v, z and b, a interleaved per key-head group; Qwen3.5 has four
plain projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``). The swapped
layer behaves exactly like mlx-lm's unless its cache is a
`StateCaptureCache` that captures, or the engine's recurrence path (chosen
once, at install, by `mtp_engine.kernels.recurrence.select`) is a fast one;
then it runs `mix_tokens`, whose recurrence gives each token the arithmetic
of one-token decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet as Qwen35GatedDeltaNet
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from mtp_engine.cache.capture import ConvWindows, StateCaptureCache
from mtp_engine.kernels import cpu_activations
from mtp_engine.kernels import recurrence as rec
from mtp_engine.model.swap import share_weights


class StateCapture:
    """What a capturing gated-delta layer adds to mlx-lm's (either family).

    Attributes (set at install):
        recurrence: The path of its recurrence (`mtp_engine.kernels.recurrence`).
        fast_silu: Whether its conv output's SiLU takes the vectorized CPU
            activation (`mtp_engine.kernels.cpu_activations`).
    """

    recurrence: str = rec.MLX_OPS
    fast_silu: bool = False

    @classmethod
    def from_layer(cls, layer: nn.Module, path: str = rec.MLX_OPS, fast_silu: bool = False) -> "StateCapture":
        """A capturing layer sharing ``layer``'s parameters and settings."""
        new = share_weights(cls, layer)
        new.recurrence = path
        new.fast_silu = fast_silu
        return new

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        # The engine's caches take the engine's path when they capture, and
        # always where a fast recurrence runs (so one-token decoding and
        # verify forwards share its arithmetic).
        if isinstance(cache, StateCaptureCache) and (
            cache.capture or (mask is None and self.recurrence != rec.MLX_OPS)
        ):
            return self._call_engine(inputs, mask, cache)
        return super().__call__(inputs, mask=mask, cache=cache)

    def _call_engine(self, inputs: mx.array, mask, cache: StateCaptureCache) -> mx.array:
        B, S, _ = inputs.shape
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
        out, conv_states, ssm_states = mix_tokens(self, inputs, conv_state, cache[1], mask, keep_states=cache.capture)
        cache.record(S, conv_states, ssm_states)
        return out


class CapturingGatedDeltaNet(StateCapture, Qwen3NextGatedDeltaNet):
    """Qwen3-Next's gated-delta layer, able to record per-token states."""


class CapturingQwen35GatedDeltaNet(StateCapture, Qwen35GatedDeltaNet):
    """Qwen3.5's gated-delta layer, able to record per-token states."""


# mlx-lm's layer class -> its capturing subclass.
CAPTURING = {Qwen3NextGatedDeltaNet: CapturingGatedDeltaNet, Qwen35GatedDeltaNet: CapturingQwen35GatedDeltaNet}


def projections(layer: nn.Module, inputs: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A gated-delta layer's input projections of ``inputs`` ``[B, S, dim]``:
    ``(qkv [B, S, 2*key_dim + value_dim], z [B, S, Hv, Dv], b [B, S, Hv],
    a [B, S, Hv])`` in each family's layout, as mlx-lm 0.32 computes them."""
    B, S, _ = inputs.shape
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(inputs), layer.in_proj_ba(inputs))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a
    z = layer.in_proj_z(inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return layer.in_proj_qkv(inputs), z, layer.in_proj_b(inputs), layer.in_proj_a(inputs)


def mix_tokens(
    layer: StateCapture,
    inputs: mx.array,
    conv_state: mx.array,
    state: mx.array | None,
    mask: mx.array | None = None,
    keep_states: bool = True,
) -> tuple[mx.array, Sequence, Sequence]:
    """A gated-delta layer's forward over ``S`` tokens, with its states.

    Mirrors ``Qwen3NextGatedDeltaNet.__call__`` and Qwen3.5's
    ``GatedDeltaNet.__call__`` (mlx-lm 0.32) with the recurrence of
    `mtp_engine.kernels.recurrence`.

    Args:
        layer: The gated-delta layer (its weights, shapes and paths).
        inputs: Normed hiddens ``[B, S, dim]``.
        conv_state: The last ``conv_kernel_size - 1`` conv inputs ``[B, n, C]``.
        state: The recurrent state ``[B, Hv, Dv, Dk]``, or None for zeros.
        mask: Optional ``[B, S]`` padding mask.
        keep_states: Return the states after every token; False returns
            the last ones only (prefill, plain decoding).

    Returns:
        ``(out, conv_states, ssm_states)``: the layer output ``[B, S, dim]``
        and, for every token (the last only, unless ``keep_states``), the
        conv window and recurrent state after it (sequences whose items are
        built when read: a verify forward commits one of them).
    """
    B, S, _ = inputs.shape
    mixed_qkv, z, b, a = projections(layer, inputs)
    n_keep = layer.conv_kernel_size - 1
    if mask is not None:
        mixed_qkv = mx.where(mask[..., None], mixed_qkv, 0)
    conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)  # [B, n_keep+S, C]
    windows = ConvWindows(conv_input, n_keep)
    conv_states = windows if keep_states else [windows[-1]]
    conv_out = layer.conv1d(conv_input)
    if layer.fast_silu and conv_out.dtype == mx.float32:

        conv_out = cpu_activations.silu(conv_out)
    else:
        conv_out = nn.silu(conv_out)
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    if state is None:  # as gated_delta_update starts
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), dtype=mx.float32)
    out, ssm_states = rec.gated_delta_tokens(layer.recurrence, layer, q, k, v, a, b, state, mask, keep_states)
    out = layer.norm(out, z)
    return layer.out_proj(out.reshape(B, S, -1)), conv_states, ssm_states


def gated_delta_layers(model: nn.Module) -> list:
    """The gated-delta mixers of a trunk, in layer order."""
    return [layer.linear_attn for layer in model.layers if getattr(layer, "is_linear", False)]


def install_state_capture(model: nn.Module, path: str = rec.MLX_OPS, fast_silu: bool = False) -> int:
    """Swap every gated-delta layer of a loaded model in place (a layer
    swapped before is re-configured). Returns how many.

    Raises:
        TypeError: A gated-delta layer of a class the engine does not know.
    """
    count = 0
    for layer in model.layers:
        if not getattr(layer, "is_linear", False):
            continue
        attn = layer.linear_attn
        if isinstance(attn, StateCapture):
            attn.recurrence, attn.fast_silu = path, fast_silu
        elif type(attn) in CAPTURING:
            layer.linear_attn = CAPTURING[type(attn)].from_layer(attn, path, fast_silu)
        else:
            raise TypeError(f"no state capture for gated-delta layers of type {type(attn).__name__}")
        count += 1
    return count


def recurrence_path(model: nn.Module) -> str:
    """Which code runs the gated-delta recurrence in ``model``'s engine
    forwards (a `mtp_engine.kernels.recurrence` path), or "none"."""
    layers = gated_delta_layers(model)
    if not layers:
        return "none"
    return getattr(layers[0], "recurrence", rec.MLX_OPS)
