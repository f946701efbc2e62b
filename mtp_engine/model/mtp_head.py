"""The multi-token-prediction head of Qwen3-Next and Qwen3.5.

Index convention: at position ``i`` the head consumes ``(H_i, t_{i+1})``, the
main model's final-normed hidden state and the next token, and predicts
``t_{i+2}``. It returns its own final-normed hidden ``M_i``, which the next
draft step uses in place of a main hidden.

Checkpoint layout (keys under ``mtp.``): ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``fc`` (2H -> H, input ``[norm_emb(e), norm_hid(h)]``,
embedding first), ``layers.{j}`` (full-attention decoder layers with the MoE
block, or the dense MLP of a dense Qwen3.5) and ``norm``. The embedding and
LM head are the main model's. With ``mtp_num_hidden_layers > 1`` the layers
are applied one after another. Qwen3.5's head has the same structure and
blocks (mlx-lm's ``qwen3_5`` imports Qwen3-Next's attention, MLP and MoE
classes); it is built from the text model's arguments.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_next import (
    ModelArgs,
    Qwen3NextAttention,
    Qwen3NextMLP,
    Qwen3NextSparseMoeBlock,
)

from mtp_engine.model.family import build_trunk, text_args, text_config


def mlp_residual(layer: nn.Module, h: mx.array) -> mx.array:
    """The second half of a Qwen3-Next decoder layer (trunk or MTP head):
    ``h`` plus its MoE block (or dense MLP) over the post-attention norm."""
    return h + layer.mlp(layer.post_attention_layernorm(h))


def gated_attention_inputs(attn: Qwen3NextAttention, x: mx.array, offset: int | mx.array = 0):
    """Queries and keys (normed, RoPE at ``offset``), values and the output
    gate of a Qwen3-Next gated attention block over ``x`` ``[B, L, dim]``,
    as mlx-lm 0.32's ``Qwen3NextAttention.__call__`` computes them before
    the KV cache (mlx-lm is pinned to 0.32.x)."""
    B, L, _ = x.shape
    queries, gate = mx.split(attn.q_proj(x).reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
    keys = attn.k_proj(x).reshape(B, L, attn.num_key_value_heads, -1)
    values = attn.v_proj(x).reshape(B, L, attn.num_key_value_heads, -1)
    queries = attn.rope(attn.q_norm(queries).transpose(0, 2, 1, 3), offset=offset)
    keys = attn.rope(attn.k_norm(keys).transpose(0, 2, 1, 3), offset=offset)
    return queries, keys, values.transpose(0, 2, 1, 3), gate.reshape(B, L, -1)


def gated_attention_output(
    attn: Qwen3NextAttention, attended: mx.array, gate: mx.array, sigmoid=mx.sigmoid
) -> mx.array:
    """The block's output projection of the attention result
    ``[B, heads, L, head_dim]``, gated by ``sigmoid(gate)``."""
    B, _, L, _ = attended.shape
    return attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(B, L, -1) * sigmoid(gate))


class MTPDecoderLayer(nn.Module):
    """Full-attention decoder layer, the same blocks as the main model's."""

    def __init__(self, args: ModelArgs, sparse: bool):
        super().__init__()
        self.self_attn = Qwen3NextAttention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )
        if sparse:
            self.mlp = Qwen3NextSparseMoeBlock(args)
        else:
            self.mlp = Qwen3NextMLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        return mlp_residual(self, x + self.self_attn(self.input_layernorm(x), mask, cache))


class MTPHead(nn.Module):
    """MTP head of a Qwen3-Next or Qwen3.5 checkpoint.

    Args:
        args: The text model's arguments (shapes, norms, attention, experts):
            ``qwen3_next.ModelArgs`` or ``qwen3_5.TextModelArgs``.
        num_layers: ``mtp_num_hidden_layers`` of the checkpoint.
        sparse: Whether the head's layers use the MoE block (as the released
            checkpoints do) or a dense MLP.
    """

    def __init__(self, args: ModelArgs, num_layers: int = 1, sparse: bool = True):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"mtp_num_hidden_layers must be >= 1, got {num_layers}")
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(dim, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(dim, eps=eps)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.layers = [MTPDecoderLayer(args, sparse) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(dim, eps=eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(
        self, hidden: mx.array, embeddings: mx.array, cache: list[KVCache] | None
    ) -> mx.array:
        """Run the head.

        Args:
            hidden: Final-normed hiddens ``H_i`` (or ``M_i``), ``[B, L, dim]``.
            embeddings: Embeddings of the tokens ``t_{i+1}``, ``[B, L, dim]``.
            cache: One KV cache per layer; its offset is the position ``i``.

        Returns:
            The head's final-normed hidden ``M``, ``[B, L, dim]``; the main
            model's LM head turns it into logits for ``t_{i+2}``.
        """
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)],
            axis=-1,
        )
        x = self.fc(x)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        return self.norm(x)


def build_models(config: dict) -> tuple[nn.Module, MTPHead]:
    """A fresh trunk (mlx-lm's model for the config's family) and MTP head
    for a Hub config, with MLX's default initialization (lazy until
    evaluated)."""
    model = build_trunk(config)  # trunk first: the seeded random init depends on the order
    args = text_args(config)
    head = MTPHead(
        args,
        num_layers=text_config(config).get("mtp_num_hidden_layers", 1),
        sparse=args.num_experts > 0,
    )
    return model, head
