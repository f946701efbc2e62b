"""Per-token recurrent checkpoints for verify forwards.

Gated-delta (linear attention) caches hold ``[conv_state, ssm_state]`` and
cannot be trimmed. To commit a verified prefix without replaying it, the verify
forward records, for every token, the conv window and the recurrent state
after it; commit is then a lookup.

Nothing here patches mlx-lm. `install_checkpointing` swaps each loaded
``Qwen3NextGatedDeltaNet`` instance of one model for a
`CheckpointingGatedDeltaNet` that shares its weights; the swapped layer
behaves exactly like the original unless its cache is a
`CheckpointArraysCache` with ``capture`` set (or, on CUDA, any
`CheckpointArraysCache`). The per-token states come from calling mlx-lm's own
``gated_delta_update`` once per token (the same kernel on Metal, the same ops
on the CPU), or on CUDA from `mtp_engine.cuda_recurrence`, which the engine
also uses for one-token decoding there; either way each token's recurrence
runs the same arithmetic as in one-token decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import (  # the step is private: mlx-lm is pinned to 0.32.x
    _gated_delta_step_ops,
    compute_g,
    gated_delta_update,
    normalize_qk,
)
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from mtp_engine import cpu_activations, cpu_recurrence, cuda_recurrence


class CheckpointArraysCache(ArraysCache):
    """An ``ArraysCache`` that can record per-token states during a forward.

    Attributes:
        capture: When True, the next forward through a checkpointing layer
            records ``checkpoints`` (it resets ``capture`` afterwards).
        checkpoints: ``checkpoints[i]`` is ``[conv_state, ssm_state]`` after
            token ``i`` of the last captured forward (a `Checkpoints`
            sequence, which builds only the items asked for), or None.
    """

    def __init__(self, size: int = 2):
        super().__init__(size)
        self.capture: bool = False
        self.checkpoints: Checkpoints | None = None

    def begin_capture(self) -> None:
        self.capture = True
        self.checkpoints = None

    def clear_checkpoints(self) -> None:
        self.capture = False
        self.checkpoints = None


class ConvWindows(Sequence):
    """The conv window after each token of a forward, sliced only when
    asked for: item ``t`` is the ``n_keep`` conv inputs ending at token ``t``
    of ``conv_input`` (which starts with the ``n_keep`` inputs before the
    forward). A verify forward keeps every token's window but commits one,
    so building the others (two operations per token and layer) is waste."""

    def __init__(self, conv_input: mx.array, n_keep: int):
        self.conv_input = conv_input
        self.n_keep = n_keep

    def __len__(self) -> int:
        return self.conv_input.shape[1] - self.n_keep

    def __getitem__(self, t: int) -> mx.array:
        t = range(len(self))[t]  # negative indices; IndexError past the end
        return mx.contiguous(self.conv_input[:, t + 1 : t + 1 + self.n_keep, :])


class StackedStates(Sequence):
    """Rows of a ``[T, ...]`` array of per-token recurrent states, taken
    only when asked for."""

    def __init__(self, states: mx.array):
        self.states = states

    def __len__(self) -> int:
        return self.states.shape[0]

    def __getitem__(self, t: int) -> mx.array:
        return self.states[range(len(self))[t]]


class Checkpoints(Sequence):
    """``[conv_state, ssm_state]`` after each token of a captured forward."""

    def __init__(self, conv_states: Sequence, ssm_states: Sequence):
        if len(conv_states) != len(ssm_states):
            raise ValueError(f"{len(conv_states)} conv windows for {len(ssm_states)} recurrent states")
        self.conv_states = conv_states
        self.ssm_states = ssm_states

    def __len__(self) -> int:
        return len(self.ssm_states)

    def __getitem__(self, t: int) -> list[mx.array]:
        return [self.conv_states[t], self.ssm_states[t]]


def share_weights(cls: type, layer: nn.Module) -> nn.Module:
    """An instance of ``cls`` (a subclass of ``type(layer)``) that shares
    ``layer``'s parameters, submodules and settings, copying nothing."""
    new = cls.__new__(cls)
    dict.update(new, layer)  # parameters and submodules
    new.__dict__.update(layer.__dict__)  # shapes, eps, training flag
    return new


def swap_modules(modules, swaps: dict) -> int:
    """Replace every submodule under ``modules`` whose type is exactly a key
    of ``swaps`` with ``swaps[type](child)`` (a None answer keeps the child).
    Returns how many were replaced."""
    swapped = 0
    for module in modules:
        for _, parent in module.named_modules():
            for key, child in parent.children().items():
                make = swaps.get(type(child)) if isinstance(child, nn.Module) else None
                new = make(child) if make else None
                if new is not None:
                    parent[key] = new
                    swapped += 1
    return swapped


class EngineKVCache(KVCache):
    """A ``KVCache`` made by the engine (`make_main_cache`); full-attention
    layers take their compiled path only with one (see `mtp_engine.compiled`)."""


class CheckpointingGatedDeltaNet(Qwen3NextGatedDeltaNet):
    """Qwen3-Next gated-delta layer that can record per-token checkpoints."""

    @classmethod
    def from_layer(cls, layer: Qwen3NextGatedDeltaNet) -> "CheckpointingGatedDeltaNet":
        """A checkpointing layer sharing ``layer``'s parameters and settings."""
        return share_weights(cls, layer)

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        # The engine's caches take the engine's path when they capture, and
        # always where the CUDA kernel runs the recurrence (so one-token
        # decoding and verify forwards share its arithmetic).
        if isinstance(cache, CheckpointArraysCache) and (
            cache.capture
            or (mask is None and (cuda_recurrence.serves(self) or cpu_recurrence.serves(self)))
        ):
            return self._call_engine(inputs, mask, cache)
        return super().__call__(inputs, mask=mask, cache=cache)

    def _call_engine(self, inputs: mx.array, mask, cache: CheckpointArraysCache) -> mx.array:
        B, S, _ = inputs.shape
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
        out, conv_states, ssm_states = mix_tokens(
            self, inputs, conv_state, cache[1], mask, keep_states=cache.capture
        )
        record_checkpoints(cache, S, conv_states, ssm_states)
        return out


def mix_tokens(
    layer: Qwen3NextGatedDeltaNet,
    inputs: mx.array,
    conv_state: mx.array,
    state: mx.array | None,
    mask: mx.array | None = None,
    keep_states: bool = True,
) -> tuple[mx.array, Sequence, Sequence]:
    """A gated-delta layer's forward over ``S`` tokens, with its states.

    Mirrors ``Qwen3NextGatedDeltaNet.__call__`` (mlx-lm 0.32) but runs the
    recurrence one token at a time, as one-token decoding does (see
    `_recurrence`).

    Args:
        layer: The gated-delta layer (its weights and shapes).
        inputs: Normed hiddens ``[B, S, dim]``.
        conv_state: The last ``conv_kernel_size - 1`` conv inputs ``[B, n, C]``.
        state: The recurrent state ``[B, Hv, Dv, Dk]``, or None for zeros.
        mask: Optional ``[B, S]`` padding mask.
        keep_states: Return the states after every token; False returns
            the last ones only (prefill, plain decoding).

    Returns:
        ``(out, conv_states, ssm_states)``: the layer output ``[B, S, dim]``
        and, for every token ``t`` (the last only, unless ``keep_states``),
        the conv window and recurrent state after it (sequences whose items
        are built when read: a verify forward commits one of them).
    """
    B, S, _ = inputs.shape
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(inputs), layer.in_proj_ba(inputs)
    )
    n_keep = layer.conv_kernel_size - 1
    mixed_qkv = mx.concatenate(
        [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
    )
    if mask is not None:
        mixed_qkv = mx.where(mask[..., None], mixed_qkv, 0)
    conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)  # [B, n_keep+S, C]
    windows = ConvWindows(conv_input, n_keep)
    conv_states = windows if keep_states else [windows[-1]]
    conv_out = cpu_activations.silu(layer.conv1d(conv_input))  # nn.silu, vectorized on the CPU
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
    out, ssm_states = _recurrence(layer, q, k, v, a, b, state, mask, keep_states)
    out = layer.norm(out, z)
    return layer.out_proj(out.reshape(B, S, -1)), conv_states, ssm_states


def _recurrence(layer, q, k, v, a, b, state, mask, keep_states) -> tuple[mx.array, Sequence]:
    """Outputs ``[B, S, Hv, Dv]`` and states (after every token, or the last
    only) of the gated-delta recurrence, each token with the arithmetic of
    one-token decoding on this backend:

    - CUDA: `mtp_engine.cuda_recurrence`, all tokens in one launch (the
      engine decodes single tokens through it too);
    - CPU: mlx-lm's ops path as ``gated_delta_ops`` runs it (gates, betas
      and grouped heads for all tokens at once, then its compiled step per
      token), without the set-up that calling ``gated_delta_update`` per
      token repeats: about 14 fewer operations per token and layer;
    - otherwise (Metal, or a padding mask): ``gated_delta_update`` per token.
    """
    S = q.shape[1]
    if mask is None and cuda_recurrence.serves(layer):
        out, states = cuda_recurrence.gated_delta_tokens(
            q, k, v, a, b, layer.A_log, layer.dt_bias, state, keep_states
        )
        return out, StackedStates(states)

    if mask is None and mx.default_device() == mx.cpu:
        beta = mx.sigmoid(b)
        g = compute_g(layer.A_log, a, layer.dt_bias)
        if (repeat := v.shape[-2] // q.shape[-2]) > 1:
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        if cpu_recurrence.serves(layer):
            out, states = cpu_recurrence.gated_delta_tokens(q, k, v, g, beta, state, keep_states)
            return out, StackedStates(states)

        def step(t: int, state: mx.array) -> tuple[mx.array, mx.array]:
            y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
            return mx.expand_dims(y, 1), state

    else:

        def step(t: int, state: mx.array) -> tuple[mx.array, mx.array]:
            return gated_delta_update(
                q[:, t : t + 1],
                k[:, t : t + 1],
                v[:, t : t + 1],
                a[:, t : t + 1],
                b[:, t : t + 1],
                layer.A_log,
                layer.dt_bias,
                state,
                None if mask is None else mask[:, t : t + 1],
                use_kernel=not layer.training,
            )

    ys, ssm_states = [], []
    for t in range(S):
        y, state = step(t, state)
        ys.append(y)
        if keep_states or t == S - 1:
            ssm_states.append(state)
    return (ys[0] if S == 1 else mx.concatenate(ys, axis=1)), ssm_states


def record_checkpoints(
    cache: CheckpointArraysCache, tokens: int, conv_states: Sequence, ssm_states: Sequence
) -> None:
    """Advance ``cache`` past the ``tokens`` of ``mix_tokens`` and, when it
    is capturing, keep their per-token states as its checkpoints."""
    cache[0] = conv_states[-1]
    cache[1] = ssm_states[-1]
    cache.advance(tokens)
    if cache.capture:
        cache.checkpoints = Checkpoints(conv_states, ssm_states)
        cache.capture = False


def install_checkpointing(model: nn.Module) -> int:
    """Swap every gated-delta layer of a loaded Qwen3-Next model in place.

    Args:
        model: An mlx-lm ``qwen3_next.Model`` instance.

    Returns:
        The number of layers swapped (already swapped layers count too).
    """
    count = 0
    for layer in model.layers:
        if not getattr(layer, "is_linear", False):
            continue
        attn = layer.linear_attn
        if not isinstance(attn, CheckpointingGatedDeltaNet):
            layer.linear_attn = CheckpointingGatedDeltaNet.from_layer(attn)
        count += 1
    return count


def recurrence_path(model: nn.Module) -> str:
    """Which code runs the gated-delta recurrence in ``model``'s engine
    forwards: "cuda kernel" (`mtp_engine.cuda_recurrence`), "cpu primitive"
    (`mtp_engine.cpu_recurrence`), "mlx-lm ops" (one step of mlx-lm's ops or
    kernel per token: Metal, bfloat16 on the CPU, a model left in training
    mode) or "none" (no gated-delta layers). Benchmarks report it: the same
    model times very differently on the first two and the third."""
    layers = [layer.linear_attn for layer in model.layers if getattr(layer, "is_linear", False)]
    if not layers:
        return "none"
    if cuda_recurrence.serves(layers[0]):
        return "cuda kernel"
    if cpu_recurrence.serves(layers[0]):
        return "cpu primitive"
    return "mlx-lm ops"


def make_main_cache(model: nn.Module) -> list:
    """Fresh caches for the main model: KV for attention, checkpointable arrays
    for gated-delta layers."""
    return [CheckpointArraysCache(2) if layer.is_linear else EngineKVCache() for layer in model.layers]
