"""Quantized folders that keep their MTP head.

``mlx_lm.convert`` drops every ``mtp.*`` tensor. This command runs mlx-lm's
own conversion for the trunk and writes the MTP head beside it as
``mtp.safetensors`` (MLX layout, its own precision), so ``mlx_lm.load(OUT)``
works unchanged and ``MTPEngine.load(OUT)`` finds both parts.

    python -m mtp_engine.convert --hf-path HF_DIR --mlx-path OUT -q [--q-bits 4] [--mtp-bits 8]
    python -m mtp_engine.convert --add-mtp-from HF_DIR --mlx-path EXISTING [--mtp-bits 8]

The second form grafts the head onto an existing ``mlx_lm.convert`` output,
reading only the shards of HF_DIR that hold ``mtp.*`` tensors (per its
``model.safetensors.index.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtp_engine.weights import MTP_FILE, MTP_LAYOUT_KEY, files_with_prefix
from mtp_engine.model.family import text_config
from mtp_engine.model.loader import CheckpointError, load_mtp_head, read_config

# Config keys that fix the head's shapes and meaning; a graft must agree on all.
MATCH_KEYS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "partial_rotary_factor",
    "rope_parameters",
    "num_hidden_layers",
    "mtp_num_hidden_layers",
)
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def check_head_matches(hf_config: dict, mlx_config: dict, hf_dir: Path, mlx_dir: Path) -> None:
    """Refuse a head whose model differs from the trunk's (the text
    model's keys: a Qwen3.5 config holds them in ``text_config``)."""
    hf_text, mlx_text = text_config(hf_config), text_config(mlx_config)
    mismatches = [
        f"{k}: {a.get(k)!r} in {hf_dir} vs {b.get(k)!r} in {mlx_dir}"
        for k, a, b in [("model_type", hf_config, mlx_config)] + [(k, hf_text, mlx_text) for k in MATCH_KEYS]
        if _comparable(a.get(k)) != _comparable(b.get(k))
    ]
    if mismatches:
        raise CheckpointError(
            "the MTP head comes from a different model than the trunk:\n  " + "\n  ".join(mismatches)
        )


def _comparable(value):
    # mlx-lm saves Qwen3.5's rope_parameters with "rope_type" renamed "type".
    if isinstance(value, dict) and "rope_type" in value:
        value = {("type" if k == "rope_type" else k): v for k, v in value.items()}
    return value


def head_tensors(hf_dir: Path, config: dict, *, bits: int | None, group_size: int, dtype) -> dict[str, mx.array]:
    """The head of ``hf_dir`` in MLX layout, cast and optionally quantized."""
    head = load_mtp_head(hf_dir, config)
    head.set_dtype(dtype)
    if bits is not None:

        def predicate(path: str, module: nn.Module):
            if not hasattr(module, "to_quantized"):
                return False
            if module.weight.shape[-1] % group_size:
                return False
            if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
                return {"group_size": 64, "bits": 8} if module.weight.shape[-1] % 64 == 0 else False
            return True

        nn.quantize(head, group_size=group_size, bits=bits, class_predicate=predicate)
    tensors = {"mtp." + k: v for k, v in tree_flatten(head.parameters())}
    mx.eval(tensors)
    return tensors


def write_head(mlx_dir: Path, tensors: dict[str, mx.array], *, bits: int | None, group_size: int, source: Path) -> Path:
    path = mlx_dir / MTP_FILE
    metadata = {
        MTP_LAYOUT_KEY: "mlx",
        "format": "mlx",
        "mtp_bits": str(bits) if bits is not None else "none",
        "mtp_group_size": str(group_size),
        "source": str(source),
    }
    mx.save_safetensors(str(path), tensors, metadata=metadata)
    config_path = mlx_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_quantization"] = {"bits": bits, "group_size": group_size} if bits else None
    config_path.write_text(json.dumps(config, indent=4))
    return path


def graft(hf_dir: Path, mlx_dir: Path, *, mtp_bits: int | None, group_size: int, dtype: str | None) -> Path:
    """Add (or replace) the MTP head of ``hf_dir`` in an mlx_lm folder."""
    hf_dir, hf_config = read_config(hf_dir)
    mlx_dir, mlx_config = read_config(mlx_dir)
    check_head_matches(hf_config, mlx_config, hf_dir, mlx_dir)
    shards = files_with_prefix(hf_dir, "mtp.")
    if not shards:
        raise CheckpointError(f"{hf_dir} has no 'mtp.*' tensors to graft")
    hf_text = text_config(hf_config)
    target = DTYPES[dtype or hf_text.get("torch_dtype") or hf_text.get("dtype") or "bfloat16"]
    tensors = head_tensors(hf_dir, hf_config, bits=mtp_bits, group_size=group_size, dtype=target)
    path = write_head(mlx_dir, tensors, bits=mtp_bits, group_size=group_size, source=hf_dir)
    names = ", ".join(sorted(p.name for p in shards))
    print(f"[mtp] head from {names} -> {path} ({_size(path)})")
    return path


def convert(
    hf_dir: Path,
    mlx_dir: Path,
    *,
    quantize: bool,
    q_bits: int,
    q_group_size: int,
    mtp_bits: int | None,
    dtype: str | None,
) -> Path:
    """mlx-lm's conversion of the trunk, then the head beside it."""
    from mlx_lm.convert import convert as mlx_lm_convert

    read_config(hf_dir)  # clear errors before mlx-lm starts
    if not files_with_prefix(Path(hf_dir), "mtp."):
        raise CheckpointError(f"{hf_dir} has no 'mtp.*' tensors; nothing to keep")
    mlx_lm_convert(
        str(hf_dir), str(mlx_dir), quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype
    )
    return graft(Path(hf_dir), Path(mlx_dir), mtp_bits=mtp_bits, group_size=q_group_size, dtype=dtype)


def _size(path: Path) -> str:
    return f"{path.stat().st_size / 2**20:.1f} MiB"


def _bits(value: str) -> int | None:
    if value.lower() in ("none", "bf16", "bfloat16", "16", "float"):
        return None
    bits = int(value)
    if bits not in (2, 3, 4, 5, 6, 8):
        raise argparse.ArgumentTypeError(f"--mtp-bits must be 2, 3, 4, 5, 6, 8 or 'none', got {value}")
    return bits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_engine.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-path", help="Hugging Face checkpoint folder (with mtp.* tensors)")
    parser.add_argument("--add-mtp-from", help="graft the head of this Hugging Face folder onto --mlx-path")
    parser.add_argument("--mlx-path", required=True, help="output folder (or the existing one to graft onto)")
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize the trunk (mlx-lm)")
    parser.add_argument("--q-bits", type=int, default=4)
    parser.add_argument("--q-group-size", type=int, default=64)
    parser.add_argument("--mtp-bits", type=_bits, default=8,
                        help="bits of the MTP head, or 'none' to keep it unquantized (default: 8)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="dtype of unquantized weights")
    args = parser.parse_args(argv)
    if bool(args.hf_path) == bool(args.add_mtp_from):
        parser.error("give exactly one of --hf-path (convert) or --add-mtp-from (graft)")
    try:
        if args.hf_path:
            convert(Path(args.hf_path), Path(args.mlx_path), quantize=args.quantize, q_bits=args.q_bits,
                    q_group_size=args.q_group_size, mtp_bits=args.mtp_bits, dtype=args.dtype)
        else:
            graft(Path(args.add_mtp_from), Path(args.mlx_path), mtp_bits=args.mtp_bits,
                  group_size=args.q_group_size, dtype=args.dtype)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
