"""`flat_quantized`: batched rows of quantized products run as one matrix,
with the bits of the unflattened product; a quantized engine with it decodes
exactly as without it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtp_engine import MTPEngine
from mtp_engine.io.convert import main as convert_main
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_qwen35_config
from mtp_engine.model.quantized import FlatQuantizedLinear, install_flat_quantized
from mtp_engine.options import is_cuda_backend
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
    on = MTPEngine.load(quantized_folder, flat_quantized=True)
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
