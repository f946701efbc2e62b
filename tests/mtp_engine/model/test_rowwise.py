"""Few-row dense products row by row (`mtp_engine.rowwise`): the same
values as the GEMM, the route taken only where it pays, and an engine that
uses it stays lossless."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtp_engine import MTPEngine
from mtp_engine.model.rowwise import (
    MAX_EXTRA_READ_BYTES,
    MAX_ROWWISE_ROWS,
    RowwiseLinear,
    install_rowwise_linears,
    takes_rowwise_route,
)
from mtp_engine.model.swap import share_weights
from mtp_engine.backend import is_cuda_backend
from tests.conftest import PROMPTS

ON_GPU = mx.default_device() != mx.cpu
ON_CUDA = is_cuda_backend()


@pytest.mark.parametrize("outputs", [48, 1])
@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 7, 64), (3, 4, 64), (1, 40, 64), (64,)])
def test_rowwise_linear_equals_linear(shape, outputs):
    mx.random.seed(0)
    layer = nn.Linear(64, outputs, bias=False)
    rowwise = share_weights(RowwiseLinear, layer)
    x = mx.random.normal(shape)
    want, got = layer(x), rowwise(x)
    assert got.shape == want.shape
    # On a GPU the GEMM it replaces may round through TF32.
    tolerance = 2e-3 if ON_GPU else 1e-5
    assert mx.allclose(got, want, rtol=tolerance, atol=tolerance).item()


def test_route_is_taken_for_few_multi_token_rows_and_small_weights():
    small = 256 * 3072 * 2  # the shipped model's LM head in bfloat16
    assert not takes_rowwise_route((1, 1, 256), small)
    assert takes_rowwise_route((1, 2, 256), small)
    assert takes_rowwise_route((1, MAX_ROWWISE_ROWS, 256), small)
    assert takes_rowwise_route((3, 5, 256), small)  # paths: P rows of K+1 tokens
    assert not takes_rowwise_route((1, MAX_ROWWISE_ROWS + 1, 256), small)
    # A batch of one-token decodes keeps its GEMM.
    assert not takes_rowwise_route((8, 1, 256), small)
    assert not takes_rowwise_route((256,), small)
    big = MAX_EXTRA_READ_BYTES // 4 + 1
    assert takes_rowwise_route((1, 4, 256), big // 2) and not takes_rowwise_route((1, 5, 256), big)


def test_install_swaps_bias_free_dense_linears_only():
    model = nn.Module()
    model.plain = nn.Linear(8, 8, bias=False)
    model.biased = nn.Linear(8, 8)
    model.quantized = nn.QuantizedLinear(64, 64, bias=False)
    assert install_rowwise_linears(model) == 1
    assert type(model.plain) is RowwiseLinear
    assert type(model.biased) is nn.Linear and type(model.quantized) is nn.QuantizedLinear
    assert install_rowwise_linears(model) == 0


def test_loaders_install_it_on_cuda_only(tiny_engine):
    status = next(s for s in tiny_engine.fast_paths if s.name == "rowwise_linears")
    assert (status.state == "on") == ON_CUDA
    found = any(isinstance(m, RowwiseLinear) for _, m in tiny_engine.model.named_modules())
    assert found == ON_CUDA


def test_engine_with_rowwise_products_is_lossless(tiny_path):
    engine = MTPEngine.load(tiny_path, rowwise_linears=True)
    trunk = engine.model
    assert isinstance(trunk.lm_head, RowwiseLinear)
    assert isinstance(trunk.model.layers[0].linear_attn.in_proj_qkvz, RowwiseLinear)
    assert isinstance(engine.checkpoint.head.fc, RowwiseLinear)
    for prompt in PROMPTS[:4]:
        base = engine.generate(prompt, max_tokens=32, mode="baseline").tokens
        for mode in (dict(mode="chain", draft_tokens=4), dict(mode="paths", draft_tokens=3, paths=2)):
            assert engine.generate(prompt, max_tokens=32, **mode).tokens == base


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend (its matrix-vector route)")
def test_rows_equal_one_row_products_bit_for_bit_on_the_gpu():
    """On CUDA each row goes through the one-row kernel: the same bits as a
    one-token product, where a GEMM over the rows rounds differently."""
    mx.random.seed(1)
    for outputs in (3072, 1):
        layer = nn.Linear(256, outputs, bias=False)
        layer.set_dtype(mx.bfloat16)
        rowwise = share_weights(RowwiseLinear, layer)
        x = mx.random.normal((1, 7, 256)).astype(mx.bfloat16)
        got = rowwise(x)
        for t in range(7):
            assert mx.array_equal(got[:, t], layer(x[:, t : t + 1])[:, 0]).item(), (outputs, t)
