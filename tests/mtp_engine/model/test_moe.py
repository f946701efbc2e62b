"""The engine's MoE block equals mlx-lm's bit for bit, and loaders install it;
its grouped expert products (CUDA prefill) give the same values."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextSparseMoeBlock

from mtp_engine.io.tiny import tiny_config
from mtp_engine.model.moe import EngineSparseMoeBlock, install_moe_blocks
from mtp_engine.model.swap import share_weights
from mtp_engine.model.moe import GPU_MOE_GROUP_MIN
from mtp_engine.options import MAX_VERIFY_WIDTH
from mtp_engine.backend import is_cuda_backend


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


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tokens", [5, 37])
def test_grouped_expert_products_give_the_blocks_values(quantized, tokens):
    """Each expert's tokens in blocks of rows (`grouped_moe`; 16 experts:
    at 5 tokens some get none, at 37 some fill two blocks): the same values
    as mlx-lm's block, 4-bit experts too (the H200's gave the same bits)."""
    mx.random.seed(tokens)
    args = ModelArgs.from_dict(tiny_config(num_experts=16))
    block = Qwen3NextSparseMoeBlock(args)
    if quantized:
        nn.quantize(block, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % 32 == 0)
    ours = share_weights(EngineSparseMoeBlock, block)
    ours.group_min = 1
    x = mx.random.normal((3, tokens, args.hidden_size))
    assert mx.allclose(ours(x), block(x), atol=1e-5, rtol=1e-5).item()


def test_grouped_expert_products_are_a_reported_fast_path(tiny_path):
    """The block layout stays on the device, so compiled layers (the CPU's
    default) and the head's compiled draft forwards group too."""
    from mtp_engine import MTPEngine

    for compiled in (False, True):
        engine = MTPEngine.load(tiny_path, grouped_moe=True, compile_layers=compiled)
        blocks = [layer.mlp for layer in engine.model.layers] + [layer.mlp for layer in engine.checkpoint.head.layers]
        assert {block.group_min for block in blocks} == {GPU_MOE_GROUP_MIN}
        assert next(s for s in engine.fast_paths if s.name == "grouped_moe").state == "on"


def test_grouped_expert_products_compile():
    """`grouped_switch_glu` under ``mx.compile`` (no read-back) gives the
    eager values."""
    mx.random.seed(3)
    args = ModelArgs.from_dict(tiny_config(num_experts=16))
    ours = share_weights(EngineSparseMoeBlock, Qwen3NextSparseMoeBlock(args))
    ours.group_min = 1
    x = mx.random.normal((2, 21, args.hidden_size))
    assert mx.array_equal(mx.compile(ours)(x), ours(x)).item()


def test_the_expert_kernel_is_reported_where_it_cannot_run(tiny_path):
    from mtp_engine import MTPEngine

    status = next(s for s in MTPEngine.load(tiny_path).fast_paths if s.name == "moe_kernel")
    assert (status.state, status.detail) == ("off", "the default on this backend")
    forced = MTPEngine.load(tiny_path, moe_kernel=True)
    status = next(s for s in forced.fast_paths if s.name == "moe_kernel")
    assert (status.state, status.detail) == ("unavailable", "not MLX's CUDA backend")
    assert not any(layer.mlp.expert_kernel for layer in forced.model.layers)
    forced = MTPEngine.load(tiny_path, prefill_moe_kernel=True)
    status = next(s for s in forced.fast_paths if s.name == "prefill_moe_kernel")
    assert (status.state, status.detail) == ("unavailable", "not MLX's CUDA backend")
    assert not any(layer.mlp.prefill_kernel for layer in forced.model.layers)


@pytest.mark.skipif(is_cuda_backend(), reason="checks the routing on a backend without the kernels")
def test_only_wide_bfloat16_forwards_take_the_prefill_kernel():
    """A block given the prefill kernel keeps MLX's products (the same bits as
    without it) for decoding and verify widths, and for wide forwards of other
    dtypes; a wide bfloat16 forward goes to the kernel, which only MLX's CUDA
    backend can build."""
    mx.random.seed(4)
    args = ModelArgs.from_dict(tiny_config(num_experts=16))
    narrow = mx.random.normal((2, MAX_VERIFY_WIDTH, args.hidden_size))
    wide = mx.random.normal((1, MAX_VERIFY_WIDTH + 1, args.hidden_size))
    for dtype in (mx.float32, mx.bfloat16):
        plain = share_weights(EngineSparseMoeBlock, Qwen3NextSparseMoeBlock(args))
        nn.quantize(plain, group_size=32, bits=4,
                    class_predicate=lambda p, m: p.startswith("switch_mlp.") and hasattr(m, "to_quantized"))
        plain.set_dtype(dtype)
        given = share_weights(EngineSparseMoeBlock, plain)
        given.prefill_kernel = True
        assert mx.array_equal(given(narrow.astype(dtype)), plain(narrow.astype(dtype))).item()
        if dtype == mx.float32:
            assert mx.array_equal(given(wide), plain(wide)).item()
    with pytest.raises(RuntimeError, match="No CUDA back-end"):
        mx.eval(given(wide.astype(mx.bfloat16)))
