"""`flat_quantized`: batched rows of quantized products run as one matrix,
with the bits of the unflattened product; a quantized engine with it decodes
exactly as without it. `prefill_dequantized`: only forwards wider than any
verify forward (prompt prefill) take dense products of the dequantized
weights, and every mode still decodes alike."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtp_engine import MTPEngine
from mtp_engine.cache.capture import make_main_cache
from mtp_engine.io.convert import main as convert_main
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_qwen35_config
from mtp_engine.model.quantized import (
    DENSE_MIN_WEIGHTS,
    FlatQuantizedLinear,
    install_flat_quantized,
)
from mtp_engine.options import MAX_VERIFY_WIDTH
from mtp_engine.backend import is_cuda_backend
from tests.conftest import PROMPTS

ON_CUDA = is_cuda_backend()


ONE_D = pytest.param((64,), marks=pytest.mark.skipif(
    ON_CUDA, reason="MLX 0.32's CUDA quantized_matmul fails on 1-D inputs (docs/BACKENDS.md)"))


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 5, 64), (8, 1, 64), (4, 3, 64), (2, 2, 2, 64), ONE_D, (6, 64)])
def test_flat_product_equals_the_batched_one(shape):
    layer = nn.QuantizedLinear(64, 96, bias=False, group_size=32, bits=4)
    flat = FlatQuantizedLinear.__new__(FlatQuantizedLinear)
    dict.update(flat, layer)
    flat.__dict__.update(layer.__dict__)
    x = mx.random.normal(shape, key=mx.random.key(1))
    ours, theirs = flat(x), layer(x)
    assert ours.shape == theirs.shape and mx.array_equal(ours, theirs)


@pytest.mark.parametrize("bias", [False, True])
def test_only_wide_forwards_take_the_dequantized_product(bias):
    layer = nn.QuantizedLinear(128, 96, bias=bias, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    model = nn.Module()
    model.proj = layer
    install_flat_quantized(model, dequantize_wide=True)
    ours = model.proj
    assert not ours.dequantize_wide  # too small a product to gain (DENSE_MIN_WEIGHTS)
    ours.dequantize_wide = True
    w = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=64, bits=4)
    for shape in ((1, 1, 128), (4, 4, 128), (1, MAX_VERIFY_WIDTH, 128), (2, MAX_VERIFY_WIDTH + 1, 128), (1, 64, 128)):
        x = mx.random.normal(shape, key=mx.random.key(shape[1])).astype(mx.bfloat16)
        y = ours(x)
        if shape[1] <= MAX_VERIFY_WIDTH:  # decoding and verify widths: the quantized product's bits
            assert mx.array_equal(y, layer(x)), shape
        else:
            dense = x @ w.T + (layer.bias if bias else 0)
            assert mx.array_equal(y, dense), shape
            if not ON_CUDA:  # a different product here (so the check above can fail); MLX's CUDA one may agree
                assert not mx.array_equal(y, layer(x))
            # Within bfloat16 rounding of the product in float32 (on the CPU closer than MLX's 4-bit one).
            exact = x.astype(mx.float32) @ w.astype(mx.float32).T + (layer.bias.astype(mx.float32) if bias else 0)
            assert mx.abs(y.astype(mx.float32) - exact).max().item() < 0.01 * mx.abs(exact).max().item()
    # An input in another dtype than the weights' scales keeps the quantized product.
    x = mx.random.normal((1, 64, 128), key=mx.random.key(9))
    assert mx.array_equal(ours(x), layer(x))


def test_only_large_products_are_made_dense():
    model = nn.Module()
    model.large = nn.QuantizedLinear(2048, DENSE_MIN_WEIGHTS // 2048, group_size=64, bits=4)
    model.small = nn.QuantizedLinear(2048, DENSE_MIN_WEIGHTS // 2048 - 64, group_size=64, bits=4)
    model.eight = nn.QuantizedLinear(1024, DENSE_MIN_WEIGHTS // 1024, group_size=64, bits=8)
    model.fp4 = nn.QuantizedLinear(2048, DENSE_MIN_WEIGHTS // 2048, group_size=32, bits=4, mode="mxfp4")  # not affine
    install_flat_quantized(model, dequantize_wide=True)
    assert (model.large.dequantize_wide, model.small.dequantize_wide, model.eight.dequantize_wide,
            model.fp4.dequantize_wide) == (True, False, True, False)
    install_flat_quantized(model)  # already swapped: left as they are
    other = nn.Module()
    other.large = nn.QuantizedLinear(2048, DENSE_MIN_WEIGHTS // 2048, group_size=64, bits=4)
    install_flat_quantized(other)
    assert not other.large.dequantize_wide


def test_install_swaps_quantized_linears_only():
    model = nn.Module()
    model.a, model.b = nn.QuantizedLinear(64, 64, group_size=32), nn.Linear(64, 64)
    model.c = nn.QuantizedLinear(64, 8, group_size=32)
    assert install_flat_quantized(model) == 2
    assert [type(m) for m in (model.a, model.b, model.c)] == [FlatQuantizedLinear, nn.Linear, FlatQuantizedLinear]


@pytest.fixture(scope="module")
def quantized_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("flat")
    # Every quantized layer's input wider than one group (32, the router gates' 64): MLX 0.32's
    # CUDA quantized_matmul gets products over several rows wrong where the input is exactly one
    # group (docs/BACKENDS.md).
    config = tiny_qwen35_config(moe=True, hidden_size=128, moe_intermediate_size=64,
                                shared_expert_intermediate_size=64)
    hub = make_tiny_checkpoint(root / "hub", config, seed=5, predictability=0.4)
    out = root / "q4"
    assert convert_main(["--hf-path", str(hub), "--mlx-path", str(out), "-q", "--q-group-size", "32"]) == 0
    return out


def test_the_default_follows_the_backend_and_batched_decoding_is_unchanged(quantized_folder):
    on = MTPEngine.load(quantized_folder, flat_quantized=True, prefill_dequantized=False)
    off = MTPEngine.load(quantized_folder, flat_quantized=False)
    default = MTPEngine.load(quantized_folder)
    state = {s.name: s.state for s in default.fast_paths}["flat_quantized"]
    assert state == ("on" if ON_CUDA else "off")
    assert any(isinstance(m, FlatQuantizedLinear) for _, m in on.model.named_modules())
    assert not any(isinstance(m, FlatQuantizedLinear) for _, m in off.model.named_modules())
    for mode, k in (("baseline", 0), ("chain", 3)):
        a = on.generate_batch(PROMPTS[:6], batch_size=4, max_tokens=24, mode=mode, draft_tokens=k or 1)
        b = off.generate_batch(PROMPTS[:6], batch_size=4, max_tokens=24, mode=mode, draft_tokens=k or 1)
        assert [r.tokens for r in a] == [r.tokens for r in b]


def test_dequantized_prefill_is_shared_by_every_mode(quantized_folder):
    default = MTPEngine.load(quantized_folder)
    assert {s.name: s.state for s in default.fast_paths}["prefill_dequantized"] == ("on" if ON_CUDA else "off")
    unflat = MTPEngine.load(quantized_folder, flat_quantized=False, prefill_dequantized=True)
    status = {s.name: s for s in unflat.fast_paths}["prefill_dequantized"]
    assert (status.state, status.detail) == ("unavailable", "needs flat_quantized")
    engine = MTPEngine.load(quantized_folder, flat_quantized=True, prefill_dequantized=True)
    linears = [m for _, m in engine.model.named_modules() if isinstance(m, FlatQuantizedLinear)]
    assert linears and not any(m.dequantize_wide for m in linears)  # the tiny model's products are all small
    for m in linears:  # as a large model's would be
        m.dequantize_wide = True
    # Prompts of 30-60 tokens: their prefill takes the dense products.
    prompts = [" ".join([p] * (6 + 3 * i)) for i, p in enumerate(PROMPTS[:5])]
    assert all(len(engine.tokenizer.encode(p)) > MAX_VERIFY_WIDTH + 1 for p in prompts)
    plain = [engine.generate(p, max_tokens=20, mode="baseline").tokens for p in prompts]
    assert [engine.generate(p, max_tokens=20, mode="chain", draft_tokens=3).tokens for p in prompts] == plain
    batched = engine.generate_batch(prompts, batch_size=3, max_tokens=20, mode="chain", draft_tokens=2)
    assert [r.tokens for r in batched] == plain
    # The prefill did take the other product: its logits differ in the last bits from the quantized one's.
    off = MTPEngine.load(quantized_folder, flat_quantized=True, prefill_dequantized=False)
    ids = engine.tokenizer.encode(prompts[0])
    logits = [e.prefill(ids, make_main_cache(e.model), False)[1] for e in (engine, off)]
    assert not mx.array_equal(*logits)
    assert mx.allclose(*logits, atol=1e-2 * mx.abs(logits[1]).max().item())
