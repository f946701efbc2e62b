"""Loading checkpoints: Hub layout (single file or sharded), mlx_lm.convert
outputs (quantized or not) with the head beside them, and clear errors."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.convert import convert

from mtp_engine import (
    CheckpointError,
    MissingMTPHeadError,
    MTPEngine,
    PromptTooLongError,
)
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_config
from mtp_engine.weights import MTP_FILE, MTP_LAYOUT_KEY, files_with_prefix
from tests.conftest import PROMPTS
from tests.mtp_engine.test_lossless import check_against_reference


def test_missing_folder_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        MTPEngine.load(missing)


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        MTPEngine.load(tmp_path)


def test_other_architecture_is_refused(tmp_path, tiny_path):
    folder = tmp_path / "llama"
    shutil.copytree(tiny_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'llama'.*qwen3_next"):
        MTPEngine.load(folder)


@pytest.mark.parametrize("damage,match", [
    ("config-list", r"config.json holds a JSON list, not an object"),
    ("truncated", r"has unreadable weights: .*load_safetensors"),
    ("no-tokenizer", r"has no tokenizer"),
])
def test_a_damaged_checkpoint_is_a_checkpoint_error_naming_the_damage(tmp_path, tiny_path, damage, match):
    """What a half-copied or hand-edited model folder looks like: each is a
    CheckpointError (one ``error:`` line in a job), not a traceback."""
    folder = tmp_path / "damaged"
    shutil.copytree(tiny_path, folder)
    if damage == "config-list":
        (folder / "config.json").write_text("[]")
    elif damage == "truncated":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=match):
        MTPEngine.load(folder)


def test_checkpoint_without_head_names_the_head_and_the_fix(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "headless", with_mtp=False)
    with pytest.raises(MissingMTPHeadError, match=r"no MTP head.*mtp\.\*.*--add-mtp-from"):
        MTPEngine.load(folder)


def test_head_of_another_shape_is_refused(tmp_path, tiny_path):
    other = make_tiny_checkpoint(tmp_path / "other", tiny_config(hidden_size=96, linear_key_head_dim=24))
    folder = tmp_path / "mixed"
    shutil.copytree(tiny_path, folder)
    heads = {k: v for f in files_with_prefix(other, "mtp.") for k, v in mx.load(str(f)).items() if k.startswith("mtp.")}
    mx.save_safetensors(str(folder / MTP_FILE), heads)
    trunk = {k: v for k, v in mx.load(str(folder / "model.safetensors")).items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(folder / "model.safetensors"), trunk)
    with pytest.raises(CheckpointError, match="MTP head does not match"):
        MTPEngine.load(folder)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a limit of MLX's CPU backend")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_the_cpu_backend_is_refused_by_name(tiny_path, dtype):
    with pytest.raises(ValueError, match=f"{dtype}.*float32"):
        MTPEngine.load(tiny_path, dtype=dtype)


def test_prompt_longer_than_context(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "short", tiny_config(max_position_embeddings=32))
    engine = MTPEngine.load(folder)
    with pytest.raises(PromptTooLongError, match="40 tokens.*context is 32"):
        engine.generate(list(range(3, 43)))
    # Near the end of the context the generation stops at the context.
    result = engine.generate(list(range(3, 30)), max_tokens=50)
    assert len(result.tokens) <= 32 - 27


def test_sharded_checkpoint_equals_single_file(tmp_path):
    single = make_tiny_checkpoint(tmp_path / "single", seed=5, predictability=0.4)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", seed=5, predictability=0.4, max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert any(k.startswith("mtp.") for k in index["weight_map"])
    a, b = MTPEngine.load(single), MTPEngine.load(sharded)
    for prompt in PROMPTS[:4]:
        ra, rb = a.generate(prompt, max_tokens=32), b.generate(prompt, max_tokens=32)
        assert ra.tokens == rb.tokens and ra.stats.accepted == rb.stats.accepted


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory):
    # Dimensions divisible by 32 so every linear layer quantizes.
    config = tiny_config(moe_intermediate_size=64, shared_expert_intermediate_size=64)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "m", config, seed=6, predictability=0.4)


def copy_head(src, dst, *, quantize_bits: int | None = None):
    """Put src's MTP head into dst/mtp.safetensors: Hub layout as is, or
    quantized in MLX layout."""
    if quantize_bits is None:
        tensors = {}
        for f, keys in files_with_prefix(src, "mtp.").items():
            arrays = mx.load(str(f))
            tensors.update({k: arrays[k] for k in keys})
        mx.save_safetensors(str(dst / MTP_FILE), tensors)
        return
    head = MTPEngine.load(src).checkpoint.head
    nn.quantize(head, group_size=32, bits=quantize_bits)
    tensors = {"mtp." + k: v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(dst / MTP_FILE), tensors, metadata={MTP_LAYOUT_KEY: "mlx"})


@pytest.mark.parametrize("quantize", [False, True])
def test_mlx_lm_convert_output_needs_the_head_and_then_is_lossless(
    tmp_path, hub_folder, reference_factory, quantize
):
    out = tmp_path / "converted"
    convert(str(hub_folder), str(out), quantize=quantize, q_group_size=32, q_bits=4)
    with pytest.raises(MissingMTPHeadError):
        MTPEngine.load(out)
    copy_head(hub_folder, out, quantize_bits=8 if quantize else None)
    engine = MTPEngine.load(out)
    if quantize:
        assert isinstance(engine.checkpoint.head.fc, nn.QuantizedLinear)
        assert engine.checkpoint.head.fc.bits == 8
    reference = reference_factory(out)
    accepted, near_ties = 0, 0
    for prompt in PROMPTS[:6]:
        ids = engine.encode(prompt)
        ref_tokens, gaps = reference.greedy(ids, 48)
        for mode in ("chain", "paths"):
            result = engine.generate(ids, max_tokens=48, mode=mode)
            outcome = check_against_reference(result, ref_tokens, gaps, engine.eos_token_ids, 48)
            near_ties += outcome == "near_tie"
            accepted += result.stats.accepted
    print(f"near ties: {near_ties}")
    assert accepted > 0
