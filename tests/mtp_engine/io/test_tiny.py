"""The tiny-checkpoint factory writes the Hub layout that real checkpoints use."""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.utils import load as mlx_lm_load

from mtp_engine.io.tiny import build_tiny_models, make_tiny_checkpoint, tiny_config
from mtp_engine.weights import read_safetensors_header


def test_hub_layout_keys_and_shapes(tmp_path):
    config = tiny_config()
    folder = make_tiny_checkpoint(tmp_path / "m", config, seed=3)
    header = read_safetensors_header(folder / "model.safetensors")
    keys = set(header) - {"__metadata__"}
    e = config["num_experts"]
    assert {f"model.layers.0.mlp.experts.{i}.up_proj.weight" for i in range(e)} <= keys
    assert {f"mtp.layers.0.mlp.experts.{i}.down_proj.weight" for i in range(e)} <= keys
    assert not any("switch_mlp" in k for k in keys)
    for k in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        assert k in keys
    h = config["hidden_size"]
    assert header["mtp.fc.weight"]["shape"] == [h, 2 * h]
    conv = header["model.layers.0.linear_attn.conv1d.weight"]["shape"]
    assert conv[1] == 1 and conv[2] == config["linear_conv_kernel_dim"]  # [C, 1, K]
    assert header["mtp.fc.weight"]["dtype"] == "F32"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and cfg["mtp_num_hidden_layers"] == 1
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / name).exists()


def test_norms_are_stored_zero_centred(tmp_path):
    model, head = build_tiny_models(tiny_config(), seed=3)
    folder = make_tiny_checkpoint(tmp_path / "m", tiny_config(), seed=3)
    stored = mx.load(str(folder / "model.safetensors"))
    assert mx.allclose(stored["model.norm.weight"] + 1.0, model.model.norm.weight)
    assert mx.allclose(stored["mtp.pre_fc_norm_hidden.weight"] + 1.0, head.pre_fc_norm_hidden.weight)
    # The gated norm inside linear attention is not zero-centred.
    assert mx.allclose(
        stored["model.layers.0.linear_attn.norm.weight"], model.model.layers[0].linear_attn.norm.weight
    )


def test_round_trip_through_mlx_lm_loader(tmp_path):
    config = tiny_config()
    model, _ = build_tiny_models(config, seed=8)
    folder = make_tiny_checkpoint(tmp_path / "m", config, seed=8)
    loaded, tokenizer = mlx_lm_load(str(folder))
    tokens = mx.array([[3, 50, 7, 200, 11]])
    assert mx.allclose(model(tokens), loaded(tokens), atol=1e-5)
    assert tokenizer.decode(tokenizer.encode("def add(a, b):")) == "def add(a, b):"


def test_same_seed_same_files(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=2, predictability=0.4)
    b = make_tiny_checkpoint(tmp_path / "b", seed=2, predictability=0.4)
    c = make_tiny_checkpoint(tmp_path / "c", seed=3, predictability=0.4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
