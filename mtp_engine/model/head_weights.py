"""The head's weights by name, for the native drafters (the C++ head and
the CUDA chain kernel), which read them in place."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock

from mtp_engine.model.mtp_head import MTPHead
from mtp_engine.model.rope import is_plain_rope

FLOATS = (mx.float32, mx.bfloat16, mx.float16)


class UnsupportedHead(ValueError):
    """A head whose layout a native drafter cannot run (the reason says why)."""


def _weight(name: str, module: nn.Module, dtypes) -> mx.array:
    """A Linear / SwitchLinear / RMSNorm / Embedding weight a native drafter
    can read: unquantized, unbiased, of ``dtypes``."""
    if "scales" in module:
        raise UnsupportedHead(f"{name} is quantized")
    if "bias" in module:
        raise UnsupportedHead(f"{name} has a bias")
    w = module.weight
    if w.dtype not in dtypes:
        raise UnsupportedHead(f"{name} is {w.dtype}, not {' or '.join(map(str, dtypes))}")
    return w


def head_weights(
    head: MTPHead, embed: nn.Module, lm_head: nn.Module, dtypes=(mx.float32,)
) -> tuple[dict, dict]:
    """The head's weights (by the native drafters' names) and configuration.

    Raises:
        UnsupportedHead: quantized weights or weights not of ``dtypes``,
            biases, a RoPE other than mlx-lm's plain one, a dense MLP instead
            of the MoE block.
    """
    named = {
        "embed": embed,
        "lm_head": lm_head,
        "pre_fc_norm_embedding": head.pre_fc_norm_embedding,
        "pre_fc_norm_hidden": head.pre_fc_norm_hidden,
        "fc": head.fc,
        "norm": head.norm,
    }
    first = head.layers[0]
    attn = first.self_attn
    if not isinstance(attn, Qwen3NextAttention) or not is_plain_rope(attn.rope) or attn.rope.traditional:
        raise UnsupportedHead("its attention is not Qwen3-Next's with mlx's plain RoPE")
    if not all(isinstance(layer.mlp, Qwen3NextSparseMoeBlock) for layer in head.layers):
        raise UnsupportedHead("its layers use a dense MLP, not the MoE block")
    weights = {}
    for i, layer in enumerate(head.layers):
        p = f"layers.{i}."
        a = layer.self_attn
        named.update({
            p + "input_layernorm": layer.input_layernorm,
            p + "post_attention_layernorm": layer.post_attention_layernorm,
            p + "q_proj": a.q_proj,
            p + "k_proj": a.k_proj,
            p + "v_proj": a.v_proj,
            p + "o_proj": a.o_proj,
            p + "q_norm": a.q_norm,
            p + "k_norm": a.k_norm,
        })
        mlp = layer.mlp
        named.update({
            p + "router": mlp.gate,
            p + "shared.gate_proj": mlp.shared_expert.gate_proj,
            p + "shared.up_proj": mlp.shared_expert.up_proj,
            p + "shared.down_proj": mlp.shared_expert.down_proj,
            p + "shared_gate": mlp.shared_expert_gate,
        })
        for n in ("gate_proj", "up_proj", "down_proj"):
            named[p + "experts." + n] = getattr(mlp.switch_mlp, n)
    for name, module in named.items():
        weights[name] = _weight(name, module, dtypes)
    rope = attn.rope
    config = {
        "dim": head.fc.weight.shape[0],
        "layers": len(head.layers),
        "heads": attn.num_attention_heads,
        "kv_heads": attn.num_key_value_heads,
        "head_dim": attn.head_dim,
        "rope_dims": rope.dims,
        "rope_base": float(rope.base),
        "rope_scale": float(rope.scale),
        "eps": float(first.input_layernorm.eps),
        "vocab": weights["embed"].shape[0],
        "experts": mlp.num_experts,
        "top_k": mlp.top_k,
        "expert_dim": weights["layers.0.experts.gate_proj"].shape[1],
        "shared_dim": mlp.shared_expert.gate_proj.weight.shape[0],
        "norm_topk": bool(mlp.norm_topk_prob),
    }
    return weights, config
