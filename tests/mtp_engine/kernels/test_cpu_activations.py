"""The vectorized SiLU primitive (`mtp_engine.cpu_activations`): bit for bit
MLX's own ``mx.sigmoid`` and ``nn.silu``, and a prefill through the swapped
layers equal to one through mlx-lm's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextMLP,
    Qwen3NextRMSNormGated,
)
from mlx_lm.models.switch_layers import SwiGLU

from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_config
from mtp_engine.kernels import cpu_activations
from mtp_engine.model import activations
from mtp_engine.model.compiled import CompiledDecoderLayer
from mtp_engine.model.loader import load_checkpoint
from mtp_engine.model.swap import share_weights
from mtp_engine.options import EngineOptions

pytestmark = pytest.mark.skipif(
    cpu_activations.extension() is None or mx.default_device() != mx.cpu,
    reason="needs the _mtp_cpu_activations extension (make install) on MLX's CPU backend",
)


def _bits_equal(a: mx.array, b: mx.array) -> np.ndarray:
    a, b = np.array(a), np.array(b)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


@pytest.fixture(scope="module")
def floats() -> mx.array:
    """Every 4099th float32 bit pattern (all signs, exponents, NaNs and
    infinities among them), the edges of exp's range, and signed zeros."""
    patterns = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.0, -88.0, np.nextafter(88.0, 89.0),
                      np.nextafter(-88.0, -89.0), 1e-45, -1e-45, 0.5, -0.5], dtype=np.float32)
    dense = np.linspace(-20.0, 20.0, 200_001, dtype=np.float32)  # where activations live
    return mx.array(np.concatenate([patterns, edges, dense]))


def test_sigmoid_and_silu_equal_mlx_bit_for_bit(floats):
    ext = cpu_activations.extension()
    assert _bits_equal(ext.sigmoid(floats), mx.sigmoid(floats)).all()
    assert _bits_equal(ext.silu(floats), nn.silu(floats)).all()
    shaped = floats[: 3 * 5 * 4099].reshape(3, 5, 4099)  # any shape, any layout
    assert _bits_equal(ext.silu(shaped.transpose(2, 0, 1)), nn.silu(shaped.transpose(2, 0, 1))).all()


def test_softmax_equals_mlx_bit_for_bit():
    ext = cpu_activations.extension()
    x = mx.random.normal((4, 150, 150), key=mx.random.key(6)) * 10
    lowest = mx.array(mx.finfo(mx.float32).min)
    masked = mx.where(mx.random.uniform(shape=x.shape, key=mx.random.key(7)) < 0.3, lowest, x)
    special = mx.array([[1.0, float("nan"), 2.0], [float("inf"), 1.0, 0.0], [-float("inf"), -float("inf"), 0.0]])
    for a in (x, masked, x[:, :, :1], x.transpose(1, 0, 2), special):
        assert _bits_equal(ext.softmax(a), mx.softmax(a, axis=-1, precise=True)).all()


@pytest.mark.parametrize("heads, kv_heads, q_len, k_len, dim", [
    (4, 2, 150, 150, 64), (4, 2, 5, 200, 64), (4, 2, 1, 37, 64), (8, 8, 7, 7, 32), (16, 2, 3, 100, 256)])
def test_attention_equals_mlx_fast_sdpa_bit_for_bit(heads, kv_heads, q_len, k_len, dim):
    keys = mx.random.split(mx.random.key(q_len), 5)
    q = mx.random.normal((2, heads, q_len, dim), key=keys[0])
    k, v = (mx.random.normal((2, kv_heads, k_len, dim), key=keys[i]) for i in (1, 2))
    bool_mask = mx.random.uniform(shape=(2, 1, q_len, k_len), key=keys[3]) < 0.8
    add_mask = mx.random.normal((2, heads, q_len, k_len), key=keys[4])
    for mask in (None, "causal", bool_mask, add_mask):
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
        assert mx.array_equal(cpu_activations.attention(q, k, v, None, dim**-0.5, mask), ref), str(mask)


def test_gradients_and_vmap_follow_mlx():
    """Training (distill) runs through the swapped layers: derivatives come
    from MLX's ops, close to autodiff of nn.silu."""
    ext = cpu_activations.extension()
    x = mx.random.normal((64, 33), key=mx.random.key(1)) * 4
    for ours, ref in ((ext.silu, nn.silu), (ext.sigmoid, mx.sigmoid)):
        g, g_ref = (mx.grad(lambda a, f=f: (f(a) * a).sum())(x) for f in (ours, ref))
        assert mx.allclose(g, g_ref, rtol=1e-4, atol=1e-5)
        tangent = mx.random.normal(x.shape, key=mx.random.key(2))
        assert mx.allclose(mx.jvp(ours, [x], [tangent])[1][0], mx.jvp(ref, [x], [tangent])[1][0], atol=1e-5)
        assert mx.array_equal(mx.vmap(ours, in_axes=1)(x), mx.vmap(ref, in_axes=1)(x))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gated_norm_equals_mlx_lm_in_any_dtype(dtype):
    """The gated norm takes SiLU in float32 whatever the model's dtype, as
    mlx-lm's precise_swiglu does."""
    norm = Qwen3NextRMSNormGated(64)
    norm.weight = mx.random.uniform(shape=(64,), key=mx.random.key(3)) + 0.5
    fast = share_weights(activations.FastGatedNorm, norm)
    h, gate = (mx.random.normal((3, 50, 4, 64), key=mx.random.key(i)) * 3 for i in (4, 5))
    h, gate = h.astype(dtype), gate.astype(dtype)
    assert mx.array_equal(fast(h, gate), norm(h, gate))
    assert mx.array_equal(fast(h), norm(h))


def test_only_float32_takes_the_primitive():
    x = mx.random.normal((3, 7))
    assert cpu_activations.takes(x)
    assert not cpu_activations.takes(x.astype(mx.float16))
    swiglu = activations.FastSwiGLU()
    half = x.astype(mx.float16)
    assert mx.array_equal(swiglu(half, half), SwiGLU()(half, half))
    with pytest.raises(ValueError, match="float32"):
        cpu_activations.extension().silu(x.astype(mx.bfloat16))


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("act")
    make_tiny_checkpoint(folder, tiny_config(hidden_size=128, moe_intermediate_size=128,
                                              shared_expert_intermediate_size=128), seed=5)
    return folder


def test_forwards_through_swapped_layers_equal_mlx_lm_layers(checkpoint_dir):
    fast = load_checkpoint(checkpoint_dir, options=EngineOptions())
    assert isinstance(fast.model.model.layers[0], CompiledDecoderLayer)
    kinds = {type(m) for _, m in fast.model.named_modules()}
    assert {activations.FastSwiGLU, activations.FastMLP, activations.FastGatedNorm,
            activations.FastAttention} <= kinds
    assert not {SwiGLU, Qwen3NextMLP, Qwen3NextRMSNormGated, Qwen3NextAttention} & kinds

    plain = load_checkpoint(checkpoint_dir, options=EngineOptions(cpu_activations=False))
    assert activations.FastSwiGLU not in {type(m) for _, m in plain.model.named_modules()}
    assert [s.line() for s in plain.fast_paths if s.name == "cpu_activations"] == [
        "fast path cpu_activations: off (by choice)"]

    prompt = mx.array([[(37 * i) % 380 + 2 for i in range(300)]])
    outputs = []
    for checkpoint in (fast, plain):
        caches = make_main_cache(checkpoint.model)
        logits = [checkpoint.model(prompt, cache=caches)]  # prefill (eager)
        for width in (5, 1):  # a verify forward capturing states, then a decode step (compiled layers)
            for c in caches:
                if isinstance(c, StateCaptureCache):
                    c.begin_capture()
            logits.append(checkpoint.model(prompt[:, :width], cache=caches))
        mx.eval(logits, [c.state for c in caches])
        outputs.append((logits, [c.state for c in caches]))
    for a, b in zip(outputs[0][0], outputs[1][0]):
        assert mx.array_equal(a, b)
    states = [[x for _, x in tree_flatten(out[1])] for out in outputs]
    assert len(states[0]) == len(states[1]) > 0
    for x, y in zip(*states):
        assert (x is None and y is None) or mx.array_equal(x, y)
