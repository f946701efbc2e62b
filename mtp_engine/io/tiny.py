"""Tiny Qwen3-Next and Qwen3.5 checkpoints in the Hub layout, for tests and benchmarks.

`tiny_config` is a Qwen3-Next config, `tiny_qwen35_config` a Qwen3.5 one
(dense or MoE; the vision-language layout or the text-only one).
`make_tiny_checkpoint` builds a random trunk with mlx-lm's own model class and
a random MTP head from a config and a seed, and writes them with a small
byte-level BPE tokenizer, exactly as a downloaded checkpoint is laid out
(per-expert tensors, zero-centred norms, ``mtp.*`` keys).

Random weights make every draft a coin toss, which leaves the commit of long
accepted prefixes untested. ``predictability > 0`` plants a structure the
head can follow: the trunk's LM head is built so that greedy decoding tends
to follow a fixed permutation of the vocabulary, the head's ``fc`` passes the
next token's embedding through, and the layers' output projections are
damped by ``1 - predictability``. About 0.4 gives a mix of accepted lengths.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mtp_engine.io.hub_writer import train_bpe_tokenizer, write_checkpoint
from mtp_engine.model.family import language_model, text_config
from mtp_engine.model.mtp_head import MTPHead, build_models

# Text the tiny tokenizers learn their merges from: enough variety for merges,
# small enough to train in milliseconds. Deterministic by construction.
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Write a function that returns the sum of a list of numbers.",
    "Hello, world! How are you today? I am fine, thank you.",
]


# The small shapes both families' tiny configs share: 4 layers (3 gated-delta,
# 1 full attention), hidden 64, one MTP layer, a 384-token vocabulary.
_SHAPES = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "vocab_size": 384,
    "max_position_embeddings": 2048,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mtp_num_hidden_layers": 1,
}
# 4 experts top-2 with a shared expert.
_EXPERTS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
}


def tiny_config(**overrides) -> dict:
    """A small Qwen3-Next ``config.json`` (Hub keys), with overrides.

    Defaults: 4 layers (3 gated-delta, 1 full attention), hidden 64, 4 experts
    top-2 with a shared expert, one MTP layer, a 384-token vocabulary.
    """
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        **_SHAPES,
        **_EXPERTS,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "rope_scaling": None,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def tiny_qwen35_config(moe: bool = False, layout: str = "vl", **overrides) -> dict:
    """A small Qwen3.5 ``config.json`` (Hub keys), with overrides of the text
    model's keys.

    Args:
        moe: ``qwen3_5_moe`` (4 experts top-2 with a shared expert, every
            layer) instead of dense ``qwen3_5``.
        layout: "vl", as the Hub ships Qwen3.5 (``text_config`` and a
            ``vision_config``; weights under ``model.language_model.*`` beside
            a vision tower), or "text" (text keys at the top, weights under
            ``model.*``).
    """
    if layout not in ("vl", "text"):
        raise ValueError(f"layout must be 'vl' or 'text', got {layout!r}")
    text = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        **_SHAPES,
        **(_EXPERTS if moe else {}),
        "attn_output_gate": True,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    }
    text.update(overrides)
    interval, layers = text["full_attention_interval"], text["num_hidden_layers"]
    text["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    kind = "Moe" if moe else ""
    if layout == "text":
        return {**text, "model_type": model_type, "architectures": [f"Qwen3_5{kind}ForCausalLM"],
                "torch_dtype": "float32"}
    return {
        "architectures": [f"Qwen3_5{kind}ForConditionalGeneration"],
        "model_type": model_type,
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16, "num_heads": 2,
                          "out_hidden_size": text["hidden_size"], "patch_size": 2, "temporal_patch_size": 2},
        "image_token_id": 0,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "torch_dtype": "float32",
    }


@lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    return train_bpe_tokenizer(_CORPUS, vocab_size).to_str()


def tiny_tokenizer(vocab_size: int):
    """The tiny byte-level BPE tokenizer with at most ``vocab_size`` tokens."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(vocab_size))


def build_tiny_models(config: dict, seed: int = 0) -> tuple[nn.Module, MTPHead]:
    """Random trunk (mlx-lm's model for the config) and MTP head for ``config``."""
    mx.random.seed(seed)
    model, head = build_models(config)
    # Norm weights away from 1, so a swapped or unshifted norm shows in tests.
    for module in (model, head):
        module.load_weights(
            [
                (k, v * (1.0 + 0.2 * mx.random.normal(v.shape)))
                for k, v in tree_flatten(module.parameters())
                if k.endswith(".weight") and "norm" in k.split(".")[-2]
            ],
            strict=False,
        )
    mx.eval(model.parameters(), head.parameters())
    return model, head


# Gated-delta output gain of structured checkpoints: large enough that the
# recurrent state moves the logits (tests must notice a wrong committed state),
# small enough that the planted permutation still drives most tokens.
LINEAR_ATTN_GAIN = 8.0


def plant_structure(
    model: nn.Module, head: MTPHead, predictability: float, seed: int, reserved: list[int]
) -> None:
    """Make greedy decoding follow a hidden permutation (see module docs).

    Args:
        reserved: Token ids (specials) the permutation keeps fixed, so plain
            tokens rarely lead to them.
    """
    if not 0.0 <= predictability <= 1.0:
        raise ValueError(f"predictability must be in [0, 1], got {predictability}")
    rng = np.random.default_rng(seed)
    text = language_model(model)
    if text.args.tie_word_embeddings:
        raise ValueError("a planted structure needs an untied LM head (tie_word_embeddings is true)")
    vocab, dim = model.model.embed_tokens.weight.shape
    embed = rng.standard_normal((vocab, dim)).astype(np.float32)
    movable = np.array([t for t in range(vocab) if t not in set(reserved)])
    perm = np.arange(vocab)
    perm[movable] = rng.permutation(movable)  # next token tends to be perm[t]
    dtype = model.model.embed_tokens.weight.dtype
    model.model.embed_tokens.weight = mx.array(embed, dtype=dtype)
    # logits_j = embed[perm^-1(j)] . h peaks at j = perm[t] when h ~ embed[t].
    text.lm_head.weight = mx.array(0.5 * embed[np.argsort(perm)], dtype=dtype)
    damp = 1.0 - predictability
    damped = ("o_proj.weight", "down_proj.weight")
    for module in (model, head):
        updates = []
        for k, v in tree_flatten(module.parameters()):
            if k.endswith("A_log"):
                # Slow decay: the recurrent state carries tokens far enough
                # back that committing a wrong state changes the output.
                a = rng.uniform(0.02, 0.3, v.shape).astype(np.float32)
                updates.append((k, mx.array(np.log(a), dtype=v.dtype)))
            elif k.endswith("linear_attn.out_proj.weight"):
                updates.append((k, v * LINEAR_ATTN_GAIN))
            elif k.endswith(damped):
                updates.append((k, v * damp))
        module.load_weights(updates, strict=False)
    passthrough = np.zeros((dim, 2 * dim), np.float32)
    passthrough[:, :dim] = np.eye(dim)
    noise = rng.standard_normal((dim, 2 * dim)).astype(np.float32) / np.sqrt(2 * dim)
    head.fc.weight = mx.array(predictability * passthrough + damp * noise, dtype=dtype)
    mx.eval(model.parameters(), head.parameters())


def make_tiny_checkpoint(
    folder: str | Path,
    config: dict | None = None,
    *,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    with_mtp: bool = True,
    max_shard_bytes: int | None = None,
    predictability: float = 0.0,
    per_expert: bool = False,
) -> Path:
    """Write a random tiny checkpoint in the Hub layout.

    Args:
        folder: Destination folder.
        config: Hub config (default `tiny_config()`).
        seed: Seed of the random weights.
        dtype: Weight dtype on disk.
        with_mtp: Include the ``mtp.*`` head.
        max_shard_bytes: Write sharded files plus ``model.safetensors.index.json``.
        predictability: Plant a structure the MTP head can follow (0 = none).
        per_expert: Qwen3.5 MoE: one tensor per expert, not the fused form.

    Returns:
        The folder.
    """
    config = dict(config or tiny_config())
    model, head = build_tiny_models(config, seed)
    vocab_size = text_config(config)["vocab_size"]
    tokenizer = tiny_tokenizer(vocab_size)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError("tokenizer is larger than the model's vocabulary")
    if predictability > 0:
        specials = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
        plant_structure(model, head, predictability, seed, specials)
    config["torch_dtype"] = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}[dtype]
    return write_checkpoint(
        Path(folder),
        config,
        model,
        head if with_mtp else None,
        tokenizer,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        per_expert=per_expert,
    )
