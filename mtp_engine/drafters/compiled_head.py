"""The MTP head's draft forward as a few compiled pieces.

Everything in a draft step has a fixed shape except the attention over the
head's KV cache, which grows every step. So the forward is cut around it:

- ``enter``: embedding, the two input norms, ``fc``, and the first layer's
  input norm and q/k/v/gate projections with RoPE (the position is an array
  input, so one trace serves every position);
- eager: the KV cache update and scaled dot-product attention;
- ``between`` (heads with several layers): one layer's output projection and
  MoE half, and the next layer's projections;
- ``finish``: the last layer's output projection and MoE half and the
  final norm.

``mx.compile`` traces each piece once per input width. Drafts only propose
tokens, so a compiled head cannot change what the engine emits.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

from mtp_engine.model.mtp_head import MTPHead, gated_attention_inputs, gated_attention_output, mlp_residual
from mtp_engine.model.rope import is_plain_rope


def can_compile_head(head: MTPHead) -> bool:
    """Whether `CompiledHead` can run this head: RoPE must take its position
    as an array (mlx's ``nn.RoPE`` does; scaled variants may not)."""
    return all(is_plain_rope(layer.self_attn.rope) for layer in head.layers)


def _layer_output(layer: nn.Module, x: mx.array, attended: mx.array, gate: mx.array) -> mx.array:
    """The rest of a decoder layer after attention."""
    return mlp_residual(layer, x + gated_attention_output(layer.self_attn, attended, gate))


class CompiledHead:
    """Runs an `MTPHead` forward with all but its KV-cache attention compiled.

    Args:
        head: The head (see `can_compile_head`).
        embed: The trunk's token embedding.

    The compiled pieces hold the weights as they are at construction, like
    the engine's compiled layers: build it after the last cast.
    """

    def __init__(self, head: MTPHead, embed: nn.Module):
        if not can_compile_head(head):
            raise ValueError("CompiledHead needs heads whose attention uses mlx's nn.RoPE")
        self.head = head
        self.embed = embed
        layers = head.layers
        self._enter = mx.compile(self._enter_impl)
        self._between = [mx.compile(partial(self._between_impl, j)) for j in range(len(layers) - 1)]
        self._finish = mx.compile(self._finish_impl)

    def _enter_impl(self, hidden: mx.array, tokens: mx.array, offset: mx.array):
        head = self.head
        x = head.fc(mx.concatenate([head.pre_fc_norm_embedding(self.embed(tokens)), head.pre_fc_norm_hidden(hidden)],
                                   axis=-1))
        layer = head.layers[0]
        return (x, *gated_attention_inputs(layer.self_attn, layer.input_layernorm(x), offset))

    def _between_impl(self, j: int, x, attended, gate, offset):
        x = _layer_output(self.head.layers[j], x, attended, gate)
        nxt = self.head.layers[j + 1]
        return (x, *gated_attention_inputs(nxt.self_attn, nxt.input_layernorm(x), offset))

    def _finish_impl(self, x, attended, gate):
        return self.head.norm(_layer_output(self.head.layers[-1], x, attended, gate))

    def hiddens(self, hidden: mx.array, tokens: mx.array, cache: list) -> mx.array:
        """The head's final-normed hiddens at every position, for ``[B, L,
        dim]`` hiddens and ``[B, L]`` tokens."""
        layers = self.head.layers
        offset = mx.array(cache[0].offset, dtype=mx.int32)
        x, queries, keys, values, gate = self._enter(hidden, tokens, offset)
        mask = create_attention_mask(x, cache[0])
        for j, (layer, c) in enumerate(zip(layers, cache)):
            keys, values = c.update_and_fetch(keys, values)
            attended = scaled_dot_product_attention(queries, keys, values, cache=c, scale=layer.self_attn.scale,
                                                    mask=mask)
            if j + 1 < len(layers):
                x, queries, keys, values, gate = self._between[j](x, attended, gate, offset)
        return self._finish(x, attended, gate)
