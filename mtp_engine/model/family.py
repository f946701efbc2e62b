"""The checkpoint families the engine runs, and what differs between them.

- Qwen3-Next (``model_type: qwen3_next``): a flat config; the trunk is
  mlx-lm's ``qwen3_next.Model``, whose ``.args``, ``.model`` and ``.lm_head``
  are the text model's.
- Qwen3.5, dense and MoE (``qwen3_5``, ``qwen3_5_moe``): the Hub ships the
  vision-language layout (a ``text_config`` inside ``config.json``, weights
  under ``model.language_model.*``, a vision tower the engine ignores); a
  text-only layout has the text keys at the top and weights under
  ``model.*`` (``model_type`` may then be ``qwen3_5_text`` or
  ``qwen3_5_moe_text``). The trunk is mlx-lm's ``qwen3_5`` / ``qwen3_5_moe``
  ``Model``, whose text model is ``.language_model``.

Both families put the MTP head under ``mtp.`` with the same structure
(docs/ARCHITECTURE.md, "Model families"): everything else asks this module.
"""

from __future__ import annotations

import copy
import importlib

import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_5_moe

from mtp_engine.weights import stack_experts

# model_type -> the mlx-lm module that runs it.
MODULES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
SUPPORTED_MODEL_TYPES = tuple(MODULES)


class Qwen35MoeModel(qwen3_5_moe.Model):
    """mlx-lm's ``qwen3_5_moe.Model`` that also reads one tensor per expert
    (``experts.{e}.gate_proj``...), as some exports store them; mlx-lm's
    ``sanitize`` reads only the fused ``experts.gate_up_proj`` form."""

    def sanitize(self, weights):
        return super().sanitize(stack_experts(weights))


def is_qwen3_5(config: dict) -> bool:
    return MODULES.get(config.get("model_type")) in ("qwen3_5", "qwen3_5_moe")


def text_config(config: dict) -> dict:
    """The text model's config: ``text_config`` where there is one (the
    vision-language layout), else the config itself. Keys the Hub keeps at
    the top only (``tie_word_embeddings``, ``eos_token_id``, ``torch_dtype``)
    are filled in from there."""
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        return config
    merged = dict(inner)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        if key not in merged and key in config:
            merged[key] = config[key]
    return merged


def model_classes(config: dict):
    """``(Model, ModelArgs)`` of mlx-lm for a config (``load_model``'s
    ``get_model_classes``)."""
    name = MODULES[config["model_type"]]
    if name == "qwen3_5_moe":
        return Qwen35MoeModel, qwen3_5_moe.ModelArgs
    module = importlib.import_module(f"mlx_lm.models.{name}")
    return module.Model, module.ModelArgs


def load_overrides(config: dict) -> dict | None:
    """Config changes that make mlx-lm read a Qwen3.5 folder as the Hub
    means it: a ``tie_word_embeddings`` stated only at the top of a
    vision-language config reaches the text model (mlx-lm reads only
    ``text_config``)."""
    inner = config.get("text_config")
    if is_qwen3_5(config) and isinstance(inner, dict) and "tie_word_embeddings" not in inner \
            and "tie_word_embeddings" in config:
        return {"text_config": {**inner, "tie_word_embeddings": config["tie_word_embeddings"]}}
    return None


def _mlx_lm_args(config: dict):
    """``(Model class, its arguments)`` as mlx-lm builds them for a config
    (with `load_overrides`). A copy: mlx-lm's argument classes rewrite the
    rope dict they are given."""
    config = copy.deepcopy({**config, **(load_overrides(config) or {})})
    model_class, args_class = model_classes(config)
    return model_class, args_class.from_dict(config)


def text_args(config: dict):
    """The text model's arguments as mlx-lm builds them (the MTP head is
    built from the same ones, so both agree on shapes and RoPE)."""
    _, args = _mlx_lm_args(config)
    return qwen3_5.TextModelArgs.from_dict(args.text_config) if is_qwen3_5(config) else args


def build_trunk(config: dict) -> nn.Module:
    """A fresh mlx-lm model for a Hub config (lazy random weights)."""
    model_class, args = _mlx_lm_args(config)
    return model_class(args)


def language_model(model: nn.Module) -> nn.Module:
    """The text model of a trunk: the module with ``.args``, ``.model``
    (embedding, layers, final norm) and, when untied, ``.lm_head``."""
    return getattr(model, "language_model", model)


def lm_head_module(model: nn.Module) -> nn.Module:
    """The module whose weight maps hiddens to logits (the embedding when
    tied)."""
    text = language_model(model)
    return text.model.embed_tokens if text.args.tie_word_embeddings else text.lm_head
