"""Random quantized models built in memory, for benchmarks at real scale
(Qwen3-Next-80B-A3B, Qwen3.5-27B and Qwen3.5-35B-A3B shapes) without
weights on disk.

Quantized weights are drawn directly as packed random integers with scales
that give each layer unit-scale outputs; no float copy of the full model is
ever materialized. Acceptance on random weights means nothing: use these
only for costs (forward time by width, per-step overhead, memory).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import PreTrainedTokenizerFast

from mtp_engine.io.tiny import tiny_config, tiny_qwen35_config, tiny_tokenizer
from mtp_engine.model.install import install_engine_layers
from mtp_engine.model.loader import LoadedCheckpoint
from mtp_engine.model.mtp_head import build_models
from mtp_engine.options import EngineOptions


def qwen3_next_80b_config(**overrides) -> dict:
    """The shapes of Qwen3-Next-80B-A3B (48 layers, hidden 2048, 512 experts
    top-10, gated-delta 3:1 with gated attention, one MTP layer)."""
    config = tiny_config(
        hidden_size=2048,
        num_hidden_layers=48,
        intermediate_size=5120,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_value_heads=32,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        vocab_size=151936,
        max_position_embeddings=262144,
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        full_attention_interval=4,
        torch_dtype="bfloat16",
    )
    config.update(overrides)
    return config


def qwen3_5_27b_config(**overrides) -> dict:
    """The shapes of Qwen3.5-27B (dense: 64 layers, hidden 5120, MLP 17408,
    gated-delta 3:1 with 48 value and 16 key heads, gated attention with 24
    heads and 4 KV heads of 256, a 248K vocabulary, one dense MTP layer), in
    the Hub's vision-language layout."""
    shapes = dict(
        hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_value_heads=48, linear_num_key_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, max_position_embeddings=262144,
    )
    return tiny_qwen35_config(**{**shapes, **overrides})


def qwen3_5_35b_a3b_config(**overrides) -> dict:
    """The shapes of Qwen3.5-35B-A3B (40 layers, hidden 2048, 256 experts
    top-8 of 512 with a shared expert of 512, gated-delta 3:1 with 32 value
    and 16 key heads, gated attention with 16 heads and 2 KV heads of 256, a
    248K vocabulary, one MoE MTP layer)."""
    shapes = dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, vocab_size=248320, max_position_embeddings=262144,
    )
    return tiny_qwen35_config(moe=True, **{**shapes, **overrides})


# --synthetic names of the benchmark: full shapes, and small ones of the same
# structure (smoke tests of the suites).
_SMALL = dict(num_hidden_layers=4, hidden_size=512, vocab_size=4096, linear_num_key_heads=4,
              linear_num_value_heads=8, num_attention_heads=4)
SYNTHETIC = {
    "80b": lambda: qwen3_next_80b_config(),
    "80b-small": lambda: qwen3_next_80b_config(**_SMALL, num_experts=16),
    "qwen3.5-27b": lambda: qwen3_5_27b_config(),
    "qwen3.5-35b-a3b": lambda: qwen3_5_35b_a3b_config(),
    "qwen3.5-small": lambda: qwen3_5_27b_config(**_SMALL, intermediate_size=1024),
    "qwen3.5-moe-small": lambda: qwen3_5_35b_a3b_config(**_SMALL, num_experts=16),
}


def _randomize_quantized(module: nn.Module, bits: int, seed: int) -> None:
    """Replace every quantized layer's packed weights with random integers."""
    key = mx.random.key(seed)
    for _, m in module.named_modules():
        if not hasattr(m, "scales") or not hasattr(m, "bits"):
            continue
        key, k1 = mx.random.split(key)
        w = m.weight
        m.weight = mx.random.randint(0, 2**31 - 1, w.shape, dtype=mx.int32, key=k1).astype(mx.uint32)
        in_dims = w.shape[-1] * 32 // m.bits
        levels = 2**m.bits
        # Uniform integers in [0, levels) have std ~ levels / sqrt(12).
        scale = 1.0 / (math.sqrt(in_dims) * levels / math.sqrt(12))
        m.scales = mx.full(m.scales.shape, scale, dtype=m.scales.dtype)
        m.biases = mx.full(m.biases.shape, -scale * (levels - 1) / 2, dtype=m.biases.dtype)


def random_quantized_checkpoint(
    config: dict,
    *,
    bits: int = 4,
    group_size: int = 64,
    dtype=None,
    seed: int = 0,
    options: EngineOptions | None = None,
) -> LoadedCheckpoint:
    """A loaded-checkpoint stand-in with random quantized weights.

    The trunk is mlx-lm's model for the config (``qwen3_next``, ``qwen3_5``
    or ``qwen3_5_moe``) quantized like
    ``mlx_lm.convert -q`` (router gates at 8 bits), the MTP head quantized
    the same way; embeddings and norms stay in ``dtype`` (default bfloat16,
    float32 on MLX's CPU backend, where bfloat16 arithmetic is emulated).
    ``options`` are the fast-path switches (default `EngineOptions.from_env`).
    """
    if dtype is None:
        dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    mx.random.seed(seed)
    model, head = build_models(config)

    def predicate(path, m):
        if not hasattr(m, "to_quantized") or isinstance(m, nn.Embedding):
            return False
        if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return True

    for module in (model, head):
        module.set_dtype(dtype)
        nn.quantize(module, group_size=group_size, bits=bits, class_predicate=predicate)
        # Inference mode, as mlx_lm.load leaves a model (after quantizing,
        # whose new layers start in training mode): the engine's own
        # recurrence (CUDA kernel, CPU primitive) serves only layers not training.
        module.eval()
        _randomize_quantized(module, bits, seed)
    # Materialize layer by layer so no lazy float weight is ever evaluated.
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters(), head.parameters())
    options = options if options is not None else EngineOptions.from_env()
    statuses = install_engine_layers(model, head, options)


    fast = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(384), eos_token="<|im_end|>")
    tokenizer = TokenizerWrapper(fast, eos_token_ids=[])
    return LoadedCheckpoint(model=model, head=head, tokenizer=tokenizer, config=config, path=None,
                            options=options, fast_paths=statuses)
