"""Training checkpoints (PyTorch, `checkpoint`) into MLX modules and a Hub-layout folder."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mtp_engine.io.hub_writer import write_checkpoint
from mtp_engine.model.mtp_head import build_models


def load_into_mlx(config: dict, tensors: dict[str, np.ndarray | mx.array], dtype=mx.float32) -> tuple:
    """mlx-lm's trunk and an `MTPHead` holding ``tensors`` (names
    ``trunk.*`` and ``head.*``, as `torch_model.Trainee` names them).

    Raises:
        ValueError: A tensor is missing, extra, or of another shape.
    """
    model, head = build_models(config)
    for part, module in (("trunk", model), ("head", head)):
        prefix = part + "."
        given = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        expected = dict(tree_flatten(module.parameters()))
        missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
        if missing or extra:
            raise ValueError(f"{part} tensors do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, value in given.items():
            if tuple(value.shape) != tuple(expected[name].shape):
                raise ValueError(f"{part}.{name}: shape {tuple(value.shape)}, the config wants {tuple(expected[name].shape)}")
        module.load_weights([(k, mx.array(v).astype(dtype)) for k, v in given.items()])
    mx.eval(model.parameters(), head.parameters())
    return model, head


def parameter_count(config: dict) -> int:
    """Parameters of the trunk and head a config describes."""
    model, head = build_models(config)
    return sum(v.size for module in (model, head) for _, v in tree_flatten(module.parameters()))


def export_checkpoint(checkpoint: Path, out: Path, tokenizer_path: Path, extra: dict[str, dict] | None = None) -> Path:
    """Write the Hub folder of a training checkpoint (bfloat16 weights, the
    tokenizer, ``training.json`` from the checkpoint's progress)."""
    from tokenizers import Tokenizer

    from mtp_engine.tools.train.checkpoint import read_checkpoint

    config, tensors, progress = read_checkpoint(Path(checkpoint), with_optimizer=False)
    model, head = load_into_mlx(config, tensors)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    write_checkpoint(Path(out), config, model, head, tokenizer, dtype=mx.bfloat16, max_shard_bytes=15 * 2**20)
    progress = {k: v for k, v in progress.items() if k not in ("files", "portable", "optimizer_state")}
    record = {"parameters": sum(int(v.size) for v in tensors.values()), **progress, **(extra or {})}
    (Path(out) / "training.json").write_text(json.dumps(record, indent=2))
    return Path(out)
