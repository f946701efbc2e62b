"""Write a Qwen3-Next or Qwen3.5 checkpoint folder in the Hugging Face Hub layout.

Used by the tiny-checkpoint factory (tests, benchmarks) and by the training
script that makes the shipped model. The folder loads with ``mlx_lm.load``
and with `MTPEngine.load`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtp_engine.weights import MTP_PREFIX, mlx_to_hub, save_sharded
from mtp_engine.model.family import is_qwen3_5, text_config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (``tokenizers``) with ChatML specials.

    Args:
        texts: Training text.
        vocab_size: Target vocabulary size, specials and the 256 byte symbols
            included.

    Returns:
        A ``tokenizers.Tokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer(folder: Path, tokenizer, *, model_max_length: int) -> dict[str, int]:
    """Save ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML template).

    Returns:
        Ids of the special tokens by name.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in ids.items()
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def module_weights(module: nn.Module, prefix: str = "") -> dict[str, mx.array]:
    """Flat ``{name: array}`` of a module's parameters, names prefixed."""
    return {prefix + k: v for k, v in tree_flatten(module.parameters())}


def hub_weights(config: dict, model: nn.Module, head: nn.Module | None, *, per_expert: bool = False) -> dict[str, mx.array]:
    """The trunk's and head's tensors under the Hub's names and layout.

    Qwen3-Next: ``model.*``, ``lm_head.weight``, one tensor per expert.
    Qwen3.5: ``model.language_model.*`` when the config has a
    ``text_config`` (the vision-language layout), else ``model.*``;
    ``lm_head.weight`` at the top; MoE experts fused
    (``experts.gate_up_proj``, ``experts.down_proj``) unless ``per_expert``.
    """
    weights = module_weights(model)
    if head is not None:
        weights.update(module_weights(head, MTP_PREFIX))
    fused = False
    if is_qwen3_5(config):
        inner = "model.language_model." if "text_config" in config else "model."
        renamed = {}
        for key, value in weights.items():
            if key.startswith("language_model.model."):
                key = inner + key[len("language_model.model."):]
            elif key.startswith("language_model."):
                key = key[len("language_model."):]
            renamed[key] = value
        weights = renamed
        fused = text_config(config).get("num_experts", 0) > 0 and not per_expert
    return mlx_to_hub(weights, fused_experts=fused)


def vision_tower(config: dict, seed: int = 0) -> dict[str, mx.array]:
    """Small random ``model.visual.*`` tensors for a vision-language config
    (the engine and mlx-lm ignore them; they make a tiny folder look like
    the Hub's)."""
    vision = config.get("vision_config")
    if not vision:
        return {}
    dim = int(vision.get("hidden_size", 16))
    key = mx.random.key(seed)
    return {
        "model.visual.patch_embed.proj.weight": mx.random.normal((dim, 3, 2, 2, 2), key=key),
        "model.visual.blocks.0.norm1.weight": mx.ones((dim,)),
        "model.visual.merger.linear_fc2.weight": mx.random.normal((text_config(config)["hidden_size"], dim), key=key),
    }


def write_checkpoint(
    folder: Path,
    config: dict,
    model: nn.Module,
    head: nn.Module | None,
    tokenizer,
    *,
    dtype: mx.Dtype | None = None,
    max_shard_bytes: int | None = None,
    per_expert: bool = False,
) -> Path:
    """Write model, MTP head, config and tokenizer in the Hub layout.

    Args:
        folder: Destination (created).
        config: Hub ``config.json`` contents (a supported ``model_type``).
        model: The mlx-lm model holding the trunk's weights.
        head: The `MTPHead`, or None to write a checkpoint without one.
        tokenizer: A ``tokenizers.Tokenizer`` with the ChatML specials.
        dtype: Cast floating weights to this dtype (default: keep).
        max_shard_bytes: Shard the weights with an index file.
        per_expert: Qwen3.5 MoE: one tensor per expert instead of the fused
            form (see `hub_weights`).

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {**hub_weights(config, model, head, per_expert=per_expert), **vision_tower(config)}
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    mx.eval(weights)
    save_sharded(folder, weights, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"})
    ids = write_tokenizer(folder, tokenizer, model_max_length=text_config(config)["max_position_embeddings"])
    config = dict(config)
    config.setdefault("eos_token_id", ids[EOS_TOKEN])
    config.setdefault("bos_token_id", ids[PAD_TOKEN])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder
