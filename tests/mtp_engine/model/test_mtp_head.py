"""The MTP head follows the checkpoint's conventions: its logits equal an
independent float64 NumPy computation from the raw Hub-layout tensors, for
Qwen3-Next (per-expert MoE) and Qwen3.5 (dense MLP; fused MoE experts; the
vision-language layout; linear-scaled RoPE)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mtp_engine import MTPEngine
from mtp_engine.io.tiny import tiny_config, tiny_qwen35_config


def raw_tensors(folder) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            out[k] = np.array(v.astype(mx.float32), dtype=np.float64)
    return out


def rms_norm(x, w_zero_centred, eps):
    """Qwen3-Next RMSNorm: weights stored zero-centred, applied as (1 + w)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w_zero_centred)


def rope(x, positions, rotary_dims, base):
    """Non-interleaved RoPE on the first ``rotary_dims`` features. x: [L, h, d]."""
    half = rotary_dims // 2
    inv = base ** (-np.arange(half) * 2.0 / rotary_dims)
    angles = positions[:, None] * inv[None]  # [L, half]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:rotary_dims]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dims] = x2 * cos + x1 * sin
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def text_settings(config: dict) -> dict:
    """The text model's keys of a Hub config, read here independently of the
    engine: Qwen3.5 nests them in ``text_config`` and its RoPE settings in
    ``rope_parameters``."""
    cfg = dict(config.get("text_config", config))
    rope_params = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = rope_params.get("rope_theta", cfg.get("rope_theta"))
    cfg["partial_rotary_factor"] = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    kind = rope_params.get("rope_type", rope_params.get("type", "default"))
    cfg["rope_factor"] = rope_params["factor"] if kind == "linear" else 1.0
    cfg.setdefault("norm_topk_prob", True)
    return cfg


def expert(w, p: str, e: int, name: str):
    """One expert's projection, stored per expert or fused (Qwen3.5)."""
    if p + f"mlp.experts.{e}.{name}.weight" in w:
        return w[p + f"mlp.experts.{e}.{name}.weight"]
    if name == "down_proj":
        return w[p + "mlp.experts.down_proj"][e]
    gate_up = w[p + "mlp.experts.gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if name == "gate_proj" else gate_up[half:]


def mtp_reference(w, cfg, hidden, tokens):
    """Logits of the MTP head for pairs (hidden[i], tokens[i]) at positions 0..L-1."""
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    embed_key = next(k for k in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight") if k in w)
    emb = w[embed_key][tokens]
    x = np.concatenate(
        [rms_norm(emb, w["mtp.pre_fc_norm_embedding.weight"], eps),
         rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)],
        axis=-1,
    ) @ w["mtp.fc.weight"].T
    L = len(tokens)
    positions = np.arange(L, dtype=np.float64) / cfg["rope_factor"]
    for j in range(cfg["mtp_num_hidden_layers"]):
        p = f"mtp.layers.{j}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        qg = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(L, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(L, nkv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(L, nkv, hd)
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        rot = int(hd * cfg["partial_rotary_factor"])
        q, k = rope(q, positions, rot, cfg["rope_theta"]), rope(k, positions, rot, cfg["rope_theta"])
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(np.tril(np.ones((L, L), bool))[None], scores, -np.inf)
        attn = np.einsum("hqk,khd->qhd", softmax(scores), v).reshape(L, nh * hd)
        x = x + (attn * (1.0 / (1.0 + np.exp(-gate)))) @ w[p + "self_attn.o_proj.weight"].T

        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if p + "mlp.gate.weight" not in w:  # a dense MLP (dense Qwen3.5)
            mp = p + "mlp."
            x = x + (silu(h @ w[mp + "gate_proj.weight"].T) * (h @ w[mp + "up_proj.weight"].T)) @ w[mp + "down_proj.weight"].T
            continue
        probs = softmax(h @ w[p + "mlp.gate.weight"].T)
        top = np.argsort(-probs, axis=-1)[:, : cfg["num_experts_per_tok"]]
        moe = np.zeros_like(h)
        for i in range(L):
            scores_i = probs[i, top[i]]
            if cfg["norm_topk_prob"]:
                scores_i = scores_i / scores_i.sum()
            for e, s in zip(top[i], scores_i):
                inner = silu(h[i] @ expert(w, p, e, "gate_proj").T) * (h[i] @ expert(w, p, e, "up_proj").T)
                moe[i] += s * (inner @ expert(w, p, e, "down_proj").T)
        sp = p + "mlp.shared_expert."
        shared = (silu(h @ w[sp + "gate_proj.weight"].T) * (h @ w[sp + "up_proj.weight"].T)) @ w[sp + "down_proj.weight"].T
        shared_gate = 1.0 / (1.0 + np.exp(-(h @ w[p + "mlp.shared_expert_gate.weight"].T)))
        x = x + moe + shared_gate * shared
    out = rms_norm(x, w["mtp.norm.weight"], eps)
    return out @ w["lm_head.weight" if "lm_head.weight" in w else embed_key].T


@pytest.mark.parametrize(
    "name, config",
    [
        ("head_default", tiny_config()),
        ("head_two_layers", tiny_config(mtp_num_hidden_layers=2, num_experts=8, num_experts_per_tok=3,
                                        norm_topk_prob=False)),
        ("head_qwen35_dense", tiny_qwen35_config()),
        ("head_qwen35_moe_tied_linear_rope", tiny_qwen35_config(
            moe=True, tie_word_embeddings=True, norm_topk_prob=False,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
    ],
)
def test_mtp_head_matches_float64_numpy(checkpoint_factory, name, config):
    path = checkpoint_factory(name, config, seed=7)
    cfg = text_settings(json.loads((path / "config.json").read_text()))
    engine = MTPEngine.load(path)
    w = raw_tensors(path)
    # The stored norms are zero-centred: the loaded head applies 1 + w.
    head = engine.checkpoint.head
    np.testing.assert_allclose(
        np.array(head.pre_fc_norm_hidden.weight), 1.0 + w["mtp.pre_fc_norm_hidden.weight"], atol=1e-6
    )

    rng = np.random.default_rng(0)
    L = 6
    hidden = rng.standard_normal((L, cfg["hidden_size"]))
    tokens = rng.integers(0, cfg["vocab_size"], L)
    expected = mtp_reference(w, cfg, hidden, tokens)

    cache = head.make_cache()
    m = head(
        mx.array(hidden[None], dtype=mx.float32),
        engine.model.model.embed_tokens(mx.array(tokens[None])),
        cache,
    )
    logits = np.array(engine.lm_head(m)[0], dtype=np.float64)
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=1e-4)
    assert cache[0].offset == L

    # Same logits when the pairs arrive one at a time (cache positions).
    cache = head.make_cache()
    for i in range(L):
        m = head(
            mx.array(hidden[None, i : i + 1], dtype=mx.float32),
            engine.model.model.embed_tokens(mx.array(tokens[None, i : i + 1])),
            cache,
        )
        step = np.array(engine.lm_head(m)[0, 0], dtype=np.float64)
        np.testing.assert_allclose(step, expected[i], atol=2e-4, rtol=1e-4)
