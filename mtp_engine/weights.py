"""Reading and writing Qwen3-Next and Qwen3.5 weights in the Hub and MLX layouts.

Hub layout (as ``Qwen/Qwen3-Next-80B-A3B-Instruct`` ships): one tensor per
expert (``mlp.experts.{e}.{gate,up,down}_proj``; Qwen3.5's MoE models fuse
them as ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``), zero-centred RMSNorm weights
(the model multiplies by ``1 + w``), ``conv1d`` weights as ``[C, 1, K]`` and
the MTP head under ``mtp.``. MLX layout (what mlx-lm's ``sanitize`` makes):
stacked ``switch_mlp`` experts, norms shifted by +1, ``conv1d`` as ``[C, K, 1]``.

The layout conversions work on MLX arrays and on numpy arrays alike (the
training tools read a model folder on machines without MLX); MLX is imported
only where a file is read or written with it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

MTP_PREFIX = "mtp."
# A head saved by our converter carries this metadata and is in MLX layout.
MTP_LAYOUT_KEY = "mtp_layout"
MTP_FILE = "mtp.safetensors"

# Norms stored zero-centred in the Hub layout (Qwen3NextRMSNorm). The gated
# norm inside linear attention (`linear_attn.norm`) is not among them.
_ZERO_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)
# The head's final norm (as stored, and without its prefix) by name; the
# trunk's by suffix: "model.norm.weight", Qwen3.5's "model.language_model.norm.weight".
_HEAD_FINAL_NORMS = ("mtp.norm.weight", "norm.weight")
_TRUNK_FINAL_NORM = "model.norm.weight"
_FUSED_KEY = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_KEY = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
_SWITCH_KEY = re.compile(r"^(.*\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def _is_zero_centred(key: str) -> bool:
    return key.endswith((*_ZERO_CENTRED, _TRUNK_FINAL_NORM)) or key in _HEAD_FINAL_NORMS


def read_safetensors_header(path: Path) -> dict:
    """Tensor names, dtypes and shapes of a safetensors file, without its data.

    Returns:
        The header dict; ``__metadata__`` holds the file's string metadata.
    """
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def weight_files(folder: Path) -> list[Path]:
    """All safetensors files of a checkpoint folder, sorted."""
    return sorted(folder.glob("*.safetensors"))


def files_with_prefix(folder: Path, prefix: str) -> dict[Path, list[str]]:
    """Which safetensors files hold tensors whose names start with ``prefix``.

    Uses ``model.safetensors.index.json`` when it exists (so only the headers
    of the shards that matter are read), else every file's header.
    """
    index = folder / "model.safetensors.index.json"
    found: dict[Path, list[str]] = {}
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        for key, name in weight_map.items():
            if key.startswith(prefix):
                found.setdefault(folder / name, []).append(key)
    for path in weight_files(folder):
        if path in found:
            continue
        keys = [k for k in read_safetensors_header(path) if k.startswith(prefix)]
        if keys:
            found[path] = keys
    return found


def _xp(value):
    """The array module of ``value``: numpy for numpy arrays, else MLX."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return np
    import mlx.core as mx

    return mx


def load_prefixed(folder: Path, prefix: str) -> tuple[dict[str, "mx.array"], dict[str, str]]:
    """Load every tensor under ``prefix`` from a checkpoint folder.

    Returns:
        ``(weights, metadata)``: tensors keyed without the prefix, and the
        merged string metadata of the files they came from.
    """
    import mlx.core as mx

    weights: dict[str, mx.array] = {}
    metadata: dict[str, str] = {}
    for path, keys in files_with_prefix(folder, prefix).items():
        arrays, meta = mx.load(str(path), return_metadata=True)
        metadata.update(meta or {})
        for key in keys:
            if key in arrays:
                weights[key[len(prefix):]] = arrays[key]
    return weights, metadata


def stack_experts(weights: dict) -> dict:
    """Stack one-tensor-per-expert keys (``mlp.experts.{e}.gate_proj.weight``)
    into mlx-lm's ``mlp.switch_mlp.gate_proj.weight``; other keys pass."""
    out: dict = {}
    experts: dict[tuple[str, str, str], dict[int, object]] = {}
    for key, value in weights.items():
        m = _EXPERT_KEY.match(key)
        if m:
            experts.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = value
        else:
            out[key] = value
    for (mlp, proj, kind), by_index in experts.items():
        n = len(by_index)
        if sorted(by_index) != list(range(n)):
            raise ValueError(f"{mlp}: expert indices are not 0..{n - 1}")
        out[f"{mlp}.switch_mlp.{proj}.{kind}"] = _xp(by_index[0]).stack([by_index[e] for e in range(n)])
    return out


def split_fused_experts(weights: dict) -> dict:
    """Qwen3.5's fused experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    gate rows first, and ``mlp.experts.down_proj`` ``[E, H, I]``) as
    mlx-lm's ``switch_mlp`` projections; other keys pass."""
    out: dict = {}
    for key, value in weights.items():
        m = _FUSED_KEY.match(key)
        if not m:
            out[key] = value
        elif m[2] == "gate_up_proj":
            mid = value.shape[-2] // 2
            out[f"{m[1]}.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out[f"{m[1]}.switch_mlp.up_proj.weight"] = value[..., mid:, :]
        else:
            out[f"{m[1]}.switch_mlp.down_proj.weight"] = value
    return out


def hub_to_mlx(weights: dict) -> dict:
    """Convert Hub-layout tensors to the MLX layout (any key prefix).

    Stacks per-expert tensors (quantized ones too) or splits fused ones,
    shifts zero-centred norms by +1 and moves the conv1d kernel axis.
    """
    out: dict = {}
    for key, value in split_fused_experts(stack_experts(weights)).items():
        if "conv1d.weight" in key and value.ndim == 3 and value.shape[-1] != 1:
            value = value.swapaxes(1, 2)
        if _is_zero_centred(key) and value.ndim == 1:
            value = value + 1.0
        out[key] = value
    return out


def mlx_to_hub(weights: dict, fused_experts: bool = False) -> dict:
    """Inverse of `hub_to_mlx`: per-expert tensors (or Qwen3.5's fused
    ``experts.gate_up_proj`` / ``experts.down_proj``), zero-centred norms."""
    out: dict = {}
    for key, value in weights.items():
        m = _SWITCH_KEY.match(key)
        if m and fused_experts and m[3] == "weight":
            if m[2] == "gate_proj":
                up = weights[f"{m[1]}.switch_mlp.up_proj.weight"]
                out[f"{m[1]}.experts.gate_up_proj"] = _xp(value).concatenate([value, up], axis=-2)
            elif m[2] == "down_proj":
                out[f"{m[1]}.experts.down_proj"] = value
            continue
        if m:
            for e in range(value.shape[0]):
                out[f"{m[1]}.experts.{e}.{m[2]}.{m[3]}"] = value[e]
            continue
        if "conv1d.weight" in key and value.ndim == 3 and value.shape[-1] == 1:
            value = value.swapaxes(1, 2)
        if _is_zero_centred(key) and value.ndim == 1:
            value = value - 1.0
        out[key] = value
    return out


def save_sharded(
    folder: Path,
    weights: dict[str, "mx.array"],
    *,
    max_shard_bytes: int | None = None,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write weights as ``model.safetensors`` or Hub-style shards with an index.

    Args:
        folder: Destination folder (must exist).
        weights: Tensors by name.
        max_shard_bytes: Split into ``model-0000i-of-0000n.safetensors`` files
            of at most this size and write ``model.safetensors.index.json``.
        metadata: String metadata stored in every file.
    """
    import mlx.core as mx

    metadata = {"format": "mlx", **(metadata or {})}
    keys = sorted(weights)
    if max_shard_bytes is None:
        path = folder / "model.safetensors"
        mx.save_safetensors(str(path), {k: weights[k] for k in keys}, metadata=metadata)
        return [path]
    shards: list[list[str]] = [[]]
    size = 0
    for key in keys:
        nbytes = weights[key].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    n = len(shards)
    weight_map, paths = {}, []
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(folder / name), {k: weights[k] for k in shard}, metadata=metadata)
        weight_map.update({k: name for k in shard})
        paths.append(folder / name)
    total = sum(w.nbytes for w in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths
