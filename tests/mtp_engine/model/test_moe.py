"""The engine's MoE block equals mlx-lm's bit for bit, and loaders install it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextSparseMoeBlock

from mtp_engine.io.tiny import tiny_config
from mtp_engine.model.moe import EngineSparseMoeBlock, install_moe_blocks
from mtp_engine.model.swap import share_weights


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_engine_block_equals_mlx_lm_block(tokens, norm_topk_prob):
    mx.random.seed(tokens)
    args = ModelArgs.from_dict(tiny_config(norm_topk_prob=norm_topk_prob))
    block = Qwen3NextSparseMoeBlock(args)
    ours = share_weights(EngineSparseMoeBlock, block)
    x = mx.random.normal((2, tokens, args.hidden_size))
    want, got = block(x), ours(x)
    assert mx.array_equal(got, want).item()


def test_loaded_models_run_the_engine_block(tiny_engine):
    trunk = [layer.mlp for layer in tiny_engine.model.layers]
    head = [layer.mlp for layer in tiny_engine.checkpoint.head.layers]
    assert all(type(m) is EngineSparseMoeBlock for m in trunk + head)
    # Installing again finds nothing left to swap.
    assert install_moe_blocks(tiny_engine.model, tiny_engine.checkpoint.head) == 0


@pytest.mark.parametrize("tokens", [3, 40])
def test_the_sort_threshold_changes_the_kernels_not_the_values(tokens):
    """Sorted (grouped) and unsorted expert products give the same values
    to float rounding, whatever threshold picks between them; mlx-lm's
    threshold keeps mlx-lm's bits (above)."""
    mx.random.seed(tokens)
    args = ModelArgs.from_dict(tiny_config())
    block = Qwen3NextSparseMoeBlock(args)
    x = mx.random.normal((2, tokens, args.hidden_size))
    outputs = []
    for sort_min in (1, 10**9):
        ours = share_weights(EngineSparseMoeBlock, block)
        ours.sort_min = sort_min
        outputs.append(ours(x))
    assert mx.allclose(*outputs, atol=1e-5, rtol=1e-5).item()


def test_the_engine_reports_its_sort_threshold(tiny_path):
    from mtp_engine import MTPEngine

    engine = MTPEngine.load(tiny_path, moe_sort_min=256)
    assert {m.sort_min for m in (layer.mlp for layer in engine.model.layers)} == {256}
    status = next(s for s in engine.fast_paths if s.name == "contiguous_moe")
    assert "sorted by expert from 256 selections" in status.detail
