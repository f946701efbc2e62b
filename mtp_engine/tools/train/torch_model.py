"""Qwen3-Next and its MTP head in PyTorch, for training on a GPU.

The training machine has PyTorch and no MLX, so training runs there in
PyTorch; the engine never imports this module. The modules mirror mlx-lm
0.32's ``qwen3_next`` classes and `mtp_engine.model.mtp_head.MTPHead`
operation for operation, and their parameters carry the MLX modules' names
and shapes (``model.layers.0.linear_attn.conv1d.weight`` is ``[C, K, 1]``,
norm weights are the multipliers themselves, experts are stacked
``switch_mlp`` tensors). So a checkpoint written here loads into the MLX
modules as is (`mtp_engine.tools.train.export`), and the parity test runs
both on the same weights.

Differences that do not change the function: the gated-delta recurrence runs
in chunks (the WY form: a triangular solve per chunk, then one state update
per chunk), and a MoE block computes every expert and weights the top-k
(at 4 experts, cheaper on a GPU than gathering).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Shape:
    """The fields of a Qwen3-Next ``config.json`` this module reads."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    full_attention_interval: int = 4
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mtp_num_hidden_layers: int = 1

    @classmethod
    def from_config(cls, config: dict) -> "Shape":
        unsupported = [k for k, bad in (
            ("tie_word_embeddings", config.get("tie_word_embeddings", False)),
            ("attention_bias", config.get("attention_bias", False)),
            ("rope_scaling", config.get("rope_scaling")),
            ("mlp_only_layers", config.get("mlp_only_layers")),
        ) if bad]
        if config.get("model_type") != "qwen3_next" or unsupported:
            raise ValueError(f"training supports plain qwen3_next configs; unsupported: "
                             f"{unsupported or config.get('model_type')}")
        return cls(**{k: config[k] for k in cls.__dataclass_fields__ if k in config})


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """MLX's ``fast.rms_norm``: float32 (or wider) statistics, the input's dtype out."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dt)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    def __init__(self, fan_in: int, fan_out: int):
        super().__init__(fan_in, fan_out, bias=False)


def rope(x: torch.Tensor, dims: int, base: float, offset: int) -> torch.Tensor:
    """MLX's ``nn.RoPE(dims, traditional=False)`` on ``x`` ``[B, H, L, D]``:
    the first ``dims`` features rotated as two halves, the rest unchanged."""
    L = x.shape[-2]
    half = dims // 2
    dt = torch.promote_types(x.dtype, torch.float32)
    inv = base ** (-torch.arange(0, half, device=x.device, dtype=dt) / half)
    pos = torch.arange(offset, offset + L, device=x.device, dtype=dt)
    angles = pos[:, None] * inv[None, :]
    cos, sin = angles.cos(), angles.sin()
    xf = x.to(dt)
    x1, x2, rest = xf[..., :half], xf[..., half:dims], xf[..., dims:]
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)
    return out.to(x.dtype)


class KVCache:
    """Keys and values of one attention layer (generation), in buffers of
    ``capacity`` positions allocated at the first call."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys = self.values = None
        self.offset = 0

    def update(self, k, v):
        B, H, L, D = k.shape
        if self.keys is None:
            self.keys = k.new_zeros(B, H, self.capacity, D)
            self.values = v.new_zeros(B, H, self.capacity, v.shape[-1])
        end = self.offset + L
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions, {end} asked")
        self.keys[:, :, self.offset : end] = k
        self.values[:, :, self.offset : end] = v
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class Attention(nn.Module):
    """``Qwen3NextAttention``: gated queries, normed queries and keys,
    partial RoPE, grouped keys and values."""

    def __init__(self, s: Shape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = Linear(s.hidden_size, self.heads * self.head_dim * 2)
        self.k_proj = Linear(s.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = Linear(s.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = Linear(self.heads * self.head_dim, s.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, s.rms_norm_eps)
        self.rope_dims = int(self.head_dim * s.partial_rotary_factor)
        self.rope_base = s.rope_theta

    def forward(self, x, cache: KVCache | None = None):
        B, L, _ = x.shape
        q, gate = self.q_proj(x).view(B, L, self.heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        gate = gate.reshape(B, L, -1)
        k = self.k_proj(x).view(B, L, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        offset = cache.offset if cache is not None else 0
        q = rope(self.q_norm(q).transpose(1, 2), self.rope_dims, self.rope_base, offset)
        k = rope(self.k_norm(k).transpose(1, 2), self.rope_dims, self.rope_base, offset)
        if cache is not None:
            k, v = cache.update(k, v)
        if L == 1:
            mask = None
        else:
            S = k.shape[2]
            mask = torch.ones(L, S, dtype=torch.bool, device=x.device).tril(diagonal=S - L)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1) * torch.sigmoid(gate))


def gated_delta_steps(q, k, v, log_g, beta, state=None):
    """The gated delta rule one step at a time (shapes as
    `gated_delta_chunked`): for decoding a few tokens, and as the reference
    the chunked form is tested against."""
    B, T, H, Dk = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)
    S = q.new_zeros(B, H, Dk, v.shape[-1], dtype=dt) if state is None else state.to(dt)
    q, k, v, g, beta = q.to(dt), k.to(dt), v.to(dt), log_g.to(dt).exp(), beta.to(dt)
    outs = []
    for t in range(T):
        S = S * g[:, t, :, None, None]
        kv = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def gated_delta_chunked(q, k, v, log_g, beta, state=None, chunk: int = 64):
    """The gated delta rule over a sequence, in chunks.

    Per step ``S = g S; S += k (beta (v - S^T k))^T; o = S^T q`` with ``q``,
    ``k`` ``[B, T, H, Dk]`` (already normalized and scaled), ``v``
    ``[B, T, H, Dv]``, ``log_g`` and ``beta`` ``[B, T, H]``. Returns the
    outputs ``[B, T, H, Dv]`` and the final state ``[B, H, Dk, Dv]``
    (float32). Inside a chunk the WY form replaces the sequential loop by a
    unit lower-triangular solve; the state is carried chunk to chunk.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (t.to(dt).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    log_g, beta = log_g.to(dt).transpose(1, 2), beta.to(dt).transpose(1, 2)  # [B, H, T]
    if pad:
        # Padded steps have beta 0 and no decay: they leave the state as it is.
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        log_g, beta = F.pad(log_g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))
    log_g, beta = log_g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    G = log_g.cumsum(-1)  # decay from the chunk's start through each step
    diff = G[..., :, None] - G[..., None, :]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, diff, torch.full_like(diff, -math.inf)).exp()  # exp(G_i - G_j), i >= j
    k_beta = k * beta[..., None]
    strict = torch.where(lower.tril(-1), (k_beta @ k.transpose(-1, -2)) * decay, torch.zeros_like(decay))
    eye = torch.eye(chunk, device=q.device, dtype=q.dtype)
    # (I + N)^{-1} with N_ij = beta_i k_i.k_j exp(G_i - G_j), i > j.
    inverse = torch.linalg.solve_triangular(strict + eye, eye.expand_as(strict), upper=False, unitriangular=True)
    u = inverse @ (v * beta[..., None])  # values net of the chunk's own earlier writes
    w = inverse @ (k_beta * G.exp()[..., None])  # what the incoming state subtracts from them
    attn = torch.where(lower, (q @ k.transpose(-1, -2)) * decay, torch.zeros_like(decay))
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state.to(dt)
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append((q[:, :, i] * G[:, :, i, :, None].exp()) @ S + attn[:, :, i] @ v_new)
        tail = (G[:, :, i, -1:] - G[:, :, i]).exp()[..., None]  # decay from each step to the chunk's end
        S = S * G[:, :, i, -1, None, None].exp() + (k[:, :, i] * tail).transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, n * chunk, Dv)[:, :, :T]
    return o.transpose(1, 2), S


class GatedDeltaNet(nn.Module):
    """``Qwen3NextGatedDeltaNet``: short causal convolution, normalized
    queries and keys, the gated delta rule, a gated RMS norm."""

    def __init__(self, s: Shape):
        super().__init__()
        self.nk, self.nv = s.linear_num_key_heads, s.linear_num_value_heads
        self.dk, self.dv = s.linear_key_head_dim, s.linear_value_head_dim
        if self.nv % self.nk:
            raise ValueError(f"linear_num_value_heads {self.nv} must be a multiple of linear_num_key_heads {self.nk}")
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = s.linear_conv_kernel_dim
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel, 1))  # MLX Conv1d layout
        self.in_proj_qkvz = Linear(s.hidden_size, 2 * self.key_dim + 2 * self.value_dim)
        self.in_proj_ba = Linear(s.hidden_size, 2 * self.nv)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nv).uniform_(0, 16)))
        self.norm = RMSNorm(self.dv, s.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, s.hidden_size)
        bound = 1 / math.sqrt(self.kernel)
        nn.init.uniform_(self.conv1d.weight, -bound, bound)

    def forward(self, x, cache: list | None = None):
        """``cache``: ``[conv_state, recurrent_state]`` (None entries at the
        start), updated in place; None for a whole sequence from scratch."""
        B, S, _ = x.shape
        r = self.nv // self.nk
        q, k, v, z = self.in_proj_qkvz(x).view(B, S, self.nk, -1).split(
            [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, S, self.nk, 2 * r).split([r, r], dim=-1)
        b, a = b.reshape(B, S, self.nv), a.reshape(B, S, self.nv)
        mixed = torch.cat([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], dim=-1)
        conv_state = cache[0] if cache is not None and cache[0] is not None else mixed.new_zeros(B, self.kernel - 1, self.conv_dim)
        conv_in = torch.cat([conv_state, mixed], dim=1)
        if cache is not None:
            cache[0] = conv_in[:, -(self.kernel - 1):].detach()
        w = self.conv1d.weight[:, :, 0].unsqueeze(1).to(x.dtype)  # [C, 1, K]
        conv = F.silu(F.conv1d(conv_in.transpose(1, 2), w, groups=self.conv_dim).transpose(1, 2))
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(B, S, self.nk, self.dk), k.reshape(B, S, self.nk, self.dk), v.reshape(B, S, self.nv, self.dv)
        inv = self.dk ** -0.5
        eps = 1e-6 * inv * inv
        q = (inv * inv) * rms_norm(q, None, eps)
        k = inv * rms_norm(k, None, eps)
        if r > 1:
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        dt = torch.promote_types(x.dtype, torch.float32)
        beta = torch.sigmoid(b.to(dt))
        log_g = -torch.exp(self.A_log.to(dt)) * F.softplus(a.to(dt) + self.dt_bias.to(dt))
        recurrence = gated_delta_steps if S <= 8 else gated_delta_chunked
        with torch.autocast(x.device.type, enabled=False):  # the recurrence stays in float32
            out, state = recurrence(q, k, v, log_g, beta, None if cache is None else cache[1])
        if cache is not None:
            cache[1] = state.detach()
        out = rms_norm(out.to(x.dtype), self.norm.weight, self.norm.eps)
        out = (F.silu(z.reshape(B, S, self.nv, self.dv).to(dt)) * out.to(dt)).to(x.dtype)
        return self.out_proj(out.reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(dim, hidden), Linear(dim, hidden), Linear(hidden, dim)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SwitchGLU(nn.Module):
    """Stacked expert weights, ``[E, out, in]`` as MLX's ``SwitchGLU``."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Module(), nn.Module(), nn.Module()
        for m, shape in ((self.gate_proj, (experts, hidden, dim)), (self.up_proj, (experts, hidden, dim)),
                         (self.down_proj, (experts, dim, hidden))):
            m.weight = nn.Parameter(torch.empty(shape).uniform_(-1 / math.sqrt(shape[2]), 1 / math.sqrt(shape[2])))

    def forward(self, x, weights):
        """Every expert on ``x`` ``[N, dim]``, summed with ``weights`` ``[N, E]``."""
        dt = x.dtype
        h = torch.einsum("nd,ehd->neh", x, self.gate_proj.weight.to(dt))
        u = torch.einsum("nd,ehd->neh", x, self.up_proj.weight.to(dt))
        y = torch.einsum("neh,edh->ned", F.silu(h) * u, self.down_proj.weight.to(dt))
        return (y * weights.to(dt)[..., None]).sum(1)


class SparseMoeBlock(nn.Module):
    """``Qwen3NextSparseMoeBlock``: softmax router, top-k (renormalized),
    a shared expert behind a sigmoid gate. ``aux`` holds the last call's
    load-balancing loss (training only)."""

    def __init__(self, s: Shape):
        super().__init__()
        self.top_k, self.norm_topk = s.num_experts_per_tok, s.norm_topk_prob
        self.gate = Linear(s.hidden_size, s.num_experts)
        self.switch_mlp = SwitchGLU(s.hidden_size, s.moe_intermediate_size, s.num_experts)
        self.shared_expert = MLP(s.hidden_size, s.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(s.hidden_size, 1)
        self.aux = None

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(flat).to(torch.promote_types(x.dtype, torch.float32)), dim=-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(-1, idx, top)
        if self.training:
            chosen = torch.zeros_like(probs).scatter(-1, idx, 1.0).mean(0)
            self.aux = probs.shape[-1] * (chosen * probs.mean(0)).sum()
        y = self.switch_mlp(flat, weights)
        y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return y.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, s: Shape, index: int | None):
        """``index`` None: an MTP head layer (full attention, MoE)."""
        super().__init__()
        self.is_linear = index is not None and (index + 1) % s.full_attention_interval != 0
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(s)
        else:
            self.self_attn = Attention(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        sparse = s.num_experts > 0 and (index is None or (index + 1) % s.decoder_sparse_step == 0)
        self.mlp = SparseMoeBlock(s) if sparse else MLP(s.hidden_size, s.intermediate_size)

    def forward(self, x, cache=None):
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList([DecoderLayer(s, i) for i in range(s.num_hidden_layers)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Trunk(nn.Module):
    """mlx-lm's ``qwen3_next.Model``: parameters ``model.*`` and ``lm_head.weight``."""

    def __init__(self, s: Shape):
        super().__init__()
        self.shape = s
        self.model = Body(s)
        self.lm_head = Linear(s.hidden_size, s.vocab_size)

    def make_cache(self, capacity: int) -> list:
        """Per-layer generation state for up to ``capacity`` positions."""
        return [[None, None] if layer.is_linear else KVCache(capacity) for layer in self.model.layers]

    def hidden(self, tokens, cache: list | None = None):
        """Final-normed hidden states of ``tokens`` ``[B, L]``."""
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, None if cache is None else cache[i])
        return self.model.norm(x)

    def forward(self, tokens, cache: list | None = None):
        return self.lm_head(self.hidden(tokens, cache))


class MTPHead(nn.Module):
    """`mtp_engine.model.mtp_head.MTPHead`: ``(H_i, t_{i+1})`` -> ``M_i``,
    whose logits (the trunk's LM head) predict ``t_{i+2}``."""

    def __init__(self, s: Shape):
        super().__init__()
        dim = s.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(dim, s.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(dim, s.rms_norm_eps)
        self.fc = Linear(2 * dim, dim)
        self.layers = nn.ModuleList([DecoderLayer(s, None) for _ in range(s.mtp_num_hidden_layers)])
        self.norm = RMSNorm(dim, s.rms_norm_eps)

    def forward(self, hidden, embeddings):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Trainee(nn.Module):
    """Trunk and head, one optimizer; parameter names ``trunk.*`` and ``head.*``."""

    def __init__(self, config: dict):
        super().__init__()
        s = Shape.from_config(config)
        self.trunk = Trunk(s)
        self.head = MTPHead(s)

    def moe_aux(self) -> torch.Tensor | float:
        losses = [m.aux for m in self.modules() if isinstance(m, SparseMoeBlock) and m.aux is not None]
        return sum(losses) / len(losses) if losses else 0.0


def mlx_names(trainee: Trainee) -> dict[str, tuple[str, str]]:
    """Torch parameter name -> (part, MLX name): part is ``trunk`` or ``head``."""
    out = {}
    for name, _ in trainee.named_parameters():
        part, rest = name.split(".", 1)
        out[name] = (part, rest)
    return out
