"""Load a Qwen3-Next or Qwen3.5 checkpoint and its MTP head.

The trunk is mlx-lm's own model (``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``,
through ``mlx_lm.utils.load_model``; `mtp_engine.model.family` says what
differs between the families);
the MTP head, which mlx-lm's ``sanitize`` drops, is read from the ``mtp.*``
tensors wherever they are in the folder: the Hub's shards, or an
``mtp.safetensors`` written beside an ``mlx_lm.convert`` output by
``python -m mtp_engine.convert``. Then it installs the engine's layers
(`mtp_engine.model.install`) as an `EngineOptions` says.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import infer_quant_config, load_model, load_tokenizer

from mtp_engine.weights import MTP_LAYOUT_KEY, MTP_PREFIX, hub_to_mlx, load_prefixed
from mtp_engine.model.family import (
    SUPPORTED_MODEL_TYPES,
    load_overrides,
    model_classes,
    text_args,
    text_config,
)
from mtp_engine.model.hub import resolve_model
from mtp_engine.model.install import install_engine_layers
from mtp_engine.model.mtp_head import MTPHead
from mtp_engine.options import EngineOptions, FastPathStatus


class CheckpointError(ValueError):
    """A checkpoint folder that the engine cannot use, with the reason."""


class MissingMTPHeadError(CheckpointError):
    """The checkpoint has no ``mtp.*`` tensors."""


@dataclass
class LoadedCheckpoint:
    """What `load_checkpoint` returns.

    Attributes:
        model: mlx-lm's ``Model`` (`mtp_engine.model.family`) with the
            engine's layers installed.
        head: The `MTPHead`.
        tokenizer: mlx-lm ``TokenizerWrapper``.
        config: The folder's ``config.json`` (as mlx-lm read it).
        path: Resolved folder.
        options: The fast-path switches the layers were installed with.
        fast_paths: What each layer-level fast path ended up as.
    """

    model: nn.Module
    head: MTPHead
    tokenizer: TokenizerWrapper
    config: dict
    path: Path
    options: EngineOptions = field(default_factory=EngineOptions)
    fast_paths: list[FastPathStatus] = field(default_factory=list)

    @property
    def context_length(self) -> int:
        return int(text_config(self.config).get("max_position_embeddings", 0)) or 2**31


def read_config(path: str | Path) -> tuple[Path, dict]:
    """Check a checkpoint folder (or a Hub id, `resolve_model`) and read its
    ``config.json``.

    Raises:
        FileNotFoundError: The folder or its config does not exist.
        CheckpointError: The config is not one of a supported family.
    """
    folder = resolve_model(path)
    if not folder.exists():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a folder")
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(
            f"{str(path)!r} has no config.json; expected a Hugging Face or mlx_lm checkpoint folder"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} holds a JSON {type(config).__name__}, not an object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{str(path)!r} holds a {model_type!r} model; the engine needs a Qwen3-Next or Qwen3.5 "
            f"checkpoint (model_type one of {', '.join(SUPPORTED_MODEL_TYPES)}) with its MTP head"
        )
    if text_config(config).get("mtp_use_dedicated_embeddings"):
        raise CheckpointError(
            f"{str(path)!r}: mtp_use_dedicated_embeddings is true; the engine's MTP head shares the "
            "trunk's embedding (as every published Qwen3-Next and Qwen3.5 checkpoint does)"
        )
    return folder.resolve(), config


def load_mtp_head(folder: Path, config: dict) -> MTPHead:
    """Build the MTP head from the folder's ``mtp.*`` tensors.

    Raises:
        MissingMTPHeadError: No ``mtp.*`` tensor in any safetensors file.
        CheckpointError: The head's tensors do not fit the trunk's config.
    """
    weights, metadata = load_prefixed(folder, MTP_PREFIX)
    if not weights:
        raise MissingMTPHeadError(
            f"{folder} has no MTP head: no 'mtp.*' tensors in its safetensors files. "
            "mlx_lm.convert drops them. Load the original Hugging Face folder, or graft the "
            "head onto this one with `python -m mtp_engine.convert --add-mtp-from HF_DIR "
            f"--mlx-path {folder}`"
        )
    if metadata.get(MTP_LAYOUT_KEY) != "mlx":
        weights = hub_to_mlx(weights)
    layer_ids = {int(m[1]) for k in weights if (m := re.match(r"layers\.(\d+)\.", k))}
    num_layers = max(layer_ids) + 1 if layer_ids else 0
    declared = int(text_config(config).get("mtp_num_hidden_layers", 1))
    if num_layers != declared:
        raise CheckpointError(
            f"{folder}: config says mtp_num_hidden_layers={declared} but the checkpoint "
            f"holds {num_layers} MTP layer(s)"
        )
    sparse = any(".mlp.switch_mlp." in k for k in weights)
    head = MTPHead(text_args(config), num_layers=num_layers, sparse=sparse)

    if any(k.endswith(".scales") for k in weights):

        def predicate(path: str, module: nn.Module):
            if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
                return False
            return infer_quant_config(path, module, weights)

        nn.quantize(head, class_predicate=predicate)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(
            f"{folder}: the MTP head does not match the model's config ({e})"
        ) from None
    mx.eval(head.parameters())
    head.eval()
    return head


DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _check_tokenizer_files(folder: Path, path) -> None:
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tiktoken.model")):
        raise CheckpointError(f"{str(path)!r} has no tokenizer (tokenizer.json or tokenizer.model)")


def load_checkpoint_tokenizer(path: str | Path) -> TokenizerWrapper:
    """The checkpoint's tokenizer alone, as `load_checkpoint` loads it (no
    weights are read): for what needs only the text, such as a job's
    fingerprint.

    Raises:
        FileNotFoundError, CheckpointError.
    """
    folder, config = read_config(path)
    _check_tokenizer_files(folder, path)
    return load_tokenizer(folder, eos_token_ids=text_config(config).get("eos_token_id"))


def load_checkpoint(path: str | Path, dtype: str | None = None, options: EngineOptions | None = None) -> LoadedCheckpoint:
    """Load trunk, MTP head and tokenizer, and install the engine's layers.

    Args:
        path: A local folder in the Hub layout (single or sharded safetensors)
            or one converted by ``mlx_lm.convert`` (quantized or not) that
            also holds the ``mtp.*`` tensors.
        dtype: Cast floating weights to "float32", "bfloat16" or "float16".
            Default: as stored, except on MLX's CPU backend, where half
            precision weights become float32 (its MoE kernel, gather_mm, only
            runs in float32 there).
        options: Fast-path switches (default: `EngineOptions.from_env`).

    Raises:
        FileNotFoundError, CheckpointError, MissingMTPHeadError.
    """
    options = options if options is not None else EngineOptions.from_env()
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype in ("bfloat16", "float16") and mx.default_device() == mx.cpu:
        # MLX's CPU backend runs the MoE expert matmuls (GatherMM) in float32 only.
        raise ValueError(f"dtype {dtype!r} cannot run on MLX's CPU backend (its MoE matmuls are "
                         "float32-only); use 'float32' or leave dtype unset")
    folder, config = read_config(path)
    _check_tokenizer_files(folder, path)
    # The head first: a folder without one fails before the trunk is read.
    try:
        head = load_mtp_head(folder, config)
        model, config = load_model(folder, model_config=load_overrides(config), get_model_classes=model_classes)
    except RuntimeError as e:  # MLX's safetensors reader: a truncated or corrupt file
        raise CheckpointError(f"{str(path)!r} has unreadable weights: {e}") from None
    if dtype is None and mx.default_device() == mx.cpu:
        half = (mx.bfloat16, mx.float16)
        if any(v.dtype in half for m in (model, head) for _, v in tree_flatten(m.parameters())):
            dtype = "float32"
    if dtype is not None:
        for module in (model, head):
            module.set_dtype(DTYPES[dtype])
        mx.eval(model.parameters(), head.parameters())
    tokenizer = load_tokenizer(folder, eos_token_ids=text_config(config).get("eos_token_id"))
    statuses = install_engine_layers(model, head, options)
    return LoadedCheckpoint(model=model, head=head, tokenizer=tokenizer, config=config, path=folder,
                            options=options, fast_paths=statuses)
