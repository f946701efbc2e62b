"""Per-token recurrent checkpoints for verify forwards.

Gated-delta (linear attention) caches hold ``[conv_state, ssm_state]`` and
cannot be trimmed. To commit a verified prefix without replaying it, the verify
forward records, for every token, the conv window and the recurrent state
after it; commit is then a lookup.

Nothing here patches mlx-lm. `install_checkpointing` swaps each loaded
``Qwen3NextGatedDeltaNet`` instance of one model for a
`CheckpointingGatedDeltaNet` that shares its weights; the swapped layer
behaves exactly like the original unless its cache is a
`CheckpointArraysCache` with ``capture`` set. The per-token states come from
calling mlx-lm's own ``gated_delta_update`` once per token, so they are
computed by the same arithmetic (the same kernel on Metal, the same ops on CPU
and CUDA) as one-token decoding and stay bit-identical to it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet


class CheckpointArraysCache(ArraysCache):
    """An ``ArraysCache`` that can record per-token states during a forward.

    Attributes:
        capture: When True, the next forward through a checkpointing layer
            records ``checkpoints`` (it resets ``capture`` afterwards).
        checkpoints: ``checkpoints[i]`` is ``[conv_state, ssm_state]`` after
            token ``i`` of the last captured forward, or None.
    """

    def __init__(self, size: int = 2):
        super().__init__(size)
        self.capture: bool = False
        self.checkpoints: list[list[mx.array]] | None = None

    def begin_capture(self) -> None:
        self.capture = True
        self.checkpoints = None

    def clear_checkpoints(self) -> None:
        self.capture = False
        self.checkpoints = None


class CheckpointingGatedDeltaNet(Qwen3NextGatedDeltaNet):
    """Qwen3-Next gated-delta layer that can record per-token checkpoints."""

    @classmethod
    def from_layer(cls, layer: Qwen3NextGatedDeltaNet) -> "CheckpointingGatedDeltaNet":
        """A checkpointing layer sharing ``layer``'s parameters and settings."""
        new = cls.__new__(cls)
        dict.update(new, layer)  # parameters and submodules (shared, not copied)
        new.__dict__.update(layer.__dict__)  # shapes, eps, training flag
        return new

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        if not (isinstance(cache, CheckpointArraysCache) and cache.capture):
            return super().__call__(inputs, mask=mask, cache=cache)
        return self._call_capturing(inputs, mask, cache)

    def _call_capturing(
        self, inputs: mx.array, mask, cache: CheckpointArraysCache
    ) -> mx.array:
        # Mirrors Qwen3NextGatedDeltaNet.__call__ (mlx-lm 0.32), keeping every
        # per-token conv window and recurrent state.
        B, S, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        )
        n_keep = self.conv_kernel_size - 1
        if cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = mx.zeros((B, n_keep, self.conv_dim), dtype=inputs.dtype)
        mixed_qkv = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
        )
        if mask is not None:
            mixed_qkv = mx.where(mask[..., None], mixed_qkv, 0)
        conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)  # [B, n_keep+S, C]
        conv_states = [
            mx.contiguous(conv_input[:, t + 1 : t + 1 + n_keep, :]) for t in range(S)
        ]
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)

        state = cache[1]
        ys, ssm_states = [], []
        for t in range(S):
            y, state = gated_delta_update(
                q[:, t : t + 1],
                k[:, t : t + 1],
                v[:, t : t + 1],
                a[:, t : t + 1],
                b[:, t : t + 1],
                self.A_log,
                self.dt_bias,
                state,
                None if mask is None else mask[:, t : t + 1],
                use_kernel=not self.training,
            )
            ys.append(y)
            ssm_states.append(state)
        out = ys[0] if S == 1 else mx.concatenate(ys, axis=1)  # [B, S, Hv, Dv]

        cache[0] = conv_states[-1]
        cache[1] = state
        cache.advance(S)
        cache.checkpoints = [[c, s] for c, s in zip(conv_states, ssm_states)]
        cache.capture = False

        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


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


def make_main_cache(model: nn.Module) -> list:
    """Fresh caches for the main model: KV for attention, checkpointable arrays
    for gated-delta layers."""
    return [CheckpointArraysCache(2) if layer.is_linear else KVCache() for layer in model.layers]
