"""The MTP head's chain drafts on the CPU, in C++.

A draft step (the head's fc, one full-attention decoder layer with its MoE
block, the final norm and the LM head, for one token) is about two hundred
MLX primitives. On MLX's CPU backend each costs a fixed dispatch far above
its arithmetic, so a step cost a fifth of a trunk forward and four of them
most of what a chain of four drafts saves (README, Benchmarks).
``_mtp_draft`` (``native/draft_head.cpp``, built into the environment by
``make install``) runs the same arithmetic as plain loops over the same
float32 weights, which the MLX model keeps (nothing is copied).

Drafts only propose: the verify forward decides every emitted token, so the
C++ arithmetic need not match MLX's bit for bit, only closely enough to
draft the same tokens (tests compare its logits with the MLX head's).

The engine uses it for chain and adaptive drafts when the model runs on the
CPU in float32 (not quantized) and the head has the layout it knows; the
tree modes keep the MLX drafter (they fork the head's cache). Set
``MTP_NATIVE_DRAFT=0`` to always draft with MLX. On a GPU it is opt-in
(``host_drafts=True``): the head then drafts on the host CPU from float32
copies while the GPU verifies, which pays only for small heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock

from mtp_engine.backend import load_extension
from mtp_engine.mtp_head import MTPHead


def extension():
    """The ``_mtp_draft`` module, or None when it is not built or is
    disabled (``MTP_NATIVE_DRAFT=0``)."""
    return load_extension("_mtp_draft", "MTP_NATIVE_DRAFT")


FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def _weight(module: nn.Module, dtypes=(mx.float32,)) -> mx.array | None:
    """A Linear / SwitchLinear / RMSNorm / Embedding weight the C++ head can
    read, or None (quantized: it has ``scales``; biased; not of ``dtypes``)."""
    if "scales" in module or "bias" in module:
        return None
    w = module.weight
    return w if w.dtype in dtypes else None


def head_weights(
    head: MTPHead, embed: nn.Module, lm_head: nn.Module, dtypes=(mx.float32,)
) -> tuple[dict, dict] | None:
    """The C++ head's weights (by its names) and configuration, or None when
    the head is not one it can run: quantized weights or weights not of
    ``dtypes``, biases, a RoPE other than mlx-lm's plain one, a dense MLP
    instead of the MoE block."""
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
    if not isinstance(attn, Qwen3NextAttention) or type(attn.rope) is not nn.RoPE or attn.rope.traditional:
        return None
    if not all(isinstance(layer.mlp, Qwen3NextSparseMoeBlock) for layer in head.layers):
        return None
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
        w = _weight(module, dtypes)
        if w is None:
            return None
        weights[name] = w
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


def native_head(head: MTPHead, embed: nn.Module, lm_head: nn.Module, on_gpu: bool = False):
    """A ``_mtp_draft.DraftHead``, or None when the extension is missing or
    cannot run this head (see `head_weights`).

    On the CPU backend it reads the head's own float32 weights. On a GPU it
    is used only when ``on_gpu`` asks for it (host drafts, see
    `MTPEngine`): it then keeps float32 copies of the head, embedding and
    LM head in host memory, drafts on the CPU, and the GPU verifies.
    """
    ext = extension()
    if ext is None:
        return None
    gpu = mx.default_device() != mx.cpu
    if gpu and not on_gpu:
        return None
    found = head_weights(head, embed, lm_head, FLOATS if gpu else (mx.float32,))
    if found is None:
        return None
    weights, values = found
    with mx.stream(mx.cpu):
        weights = {k: mx.contiguous(w.astype(mx.float32)) for k, w in weights.items()}
        mx.eval(list(weights.values()))
    config = ext.HeadConfig()
    for k, v in values.items():
        setattr(config, k, v)
    return ext.DraftHead(weights, config)


@dataclass
class NativeDraftState:
    """One generation's C++ head session and the pairs it has not consumed."""

    session: object
    pending_hidden: mx.array | None = None
    pending_row: int = 0
    pending_tokens: list[int] = field(default_factory=list)
    base: int = 0


class NativeDrafter:
    """Chain and adaptive drafts with the C++ head; the same calls as
    `MTPDrafter` for those modes."""

    def __init__(self, head):
        self.head = head

    def new_state(self) -> NativeDraftState:
        return NativeDraftState(session=self.head.session())

    def set_pending(self, state: NativeDraftState, hidden: mx.array, tokens: list[int], row: int = 0) -> None:
        """Queue pairs ``(hidden[row, j], tokens[j])``; the C++ head reads
        them straight from ``hidden`` (``[rows, >= len(tokens), dim]``)."""
        if hidden.shape[1] < len(tokens):
            raise ValueError(f"{hidden.shape[1]} hiddens for {len(tokens)} tokens")
        state.pending_hidden, state.pending_row = hidden, row
        state.pending_tokens = list(tokens)

    def commit(self, state: NativeDraftState, hidden: mx.array, tokens: list[int], row: int = 0) -> None:
        """Drop the drafted cache entries and queue the accepted pairs."""
        state.session.rewind(state.base)
        self.set_pending(state, hidden, tokens, row)

    def _pending(self, state: NativeDraftState) -> tuple[mx.array, int, list[int]]:
        """Take the pending pairs (they are consumed by the next draft)."""
        hidden, row, tokens = state.pending_hidden, state.pending_row, state.pending_tokens
        if hidden is None or not tokens:
            raise RuntimeError("drafting needs pending pairs (set_pending/commit)")
        state.base += len(tokens)
        state.pending_hidden, state.pending_tokens = None, []
        return hidden, row, tokens

    def draft(self, state: NativeDraftState, k: int) -> mx.array | list[list[int]]:
        """K greedy draft tokens. On the CPU backend a ``[1, k]`` int32
        array, not read back: like the MLX drafter's chains, it is evaluated
        on MLX's CPU stream (the C++ head runs there) while the host builds
        the verify forward on top of it, and its tokens come back with the
        verify's targets. For a GPU model (host drafts), one path as a list."""
        hidden, row, tokens = self._pending(state)
        if mx.default_device() != mx.cpu:
            # Host drafts for a GPU model are drafted at once: with the lazy
            # primitive, a verify on the GPU waiting on an array of the CPU
            # stream hung on MLX 0.32.4's CUDA backend (README, H200).
            return [state.session.draft(hidden, tokens, k, 0.0, row)[0]]
        drafts = state.session.draft_lazy(hidden, tokens, k, row)
        mx.async_eval(drafts)
        return drafts

    def draft_adaptive(self, state: NativeDraftState, depth_max: int, tau: float) -> list[int]:
        """Greedy chain that stops once the running product of top-1
        probabilities falls below ``tau``; 1..depth_max tokens."""
        hidden, row, tokens = self._pending(state)
        drafts, _ = state.session.draft(hidden, tokens, depth_max, tau, row)  # evaluates ``hidden``
        return drafts
