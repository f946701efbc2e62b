"""The shipped model: Hub layout, loadable by mlx-lm and the engine, lossless,
and its MTP head drafts tokens that land."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import orjson
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from mtp_engine import MTPEngine
from mtp_engine.weights import files_with_prefix

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "qwen3-next-tiny-stdlib"


@pytest.fixture(scope="module")
def engine():
    return MTPEngine.load(SHIPPED)


def test_hub_layout_and_size():
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["mtp_num_hidden_layers"] == 1
    assert files_with_prefix(SHIPPED, "mtp.")
    size = sum(p.stat().st_size for p in SHIPPED.glob("*.safetensors"))
    assert size <= 40_000_000
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md", "model.safetensors.index.json"):
        assert (SHIPPED / name).exists()


def test_lossless_against_mlx_lm_and_drafts_land(engine):
    model, _ = mlx_lm_load(str(SHIPPED))
    model.set_dtype(mx.float32)  # as the engine does on the CPU backend
    rows = [orjson.loads(l) for l in (ROOT / "examples" / "prompts.jsonl").read_bytes().splitlines()[:3]]
    accepted = 0
    for row in rows:
        ids = engine.encode(row["prompt"])
        reference = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=32)]
        for mode in ("chain", "tree"):
            result = engine.generate(ids, max_tokens=32, mode=mode)
            assert result.tokens == reference[: len(result.tokens)]
            accepted += result.stats.accepted
    assert accepted > 0
