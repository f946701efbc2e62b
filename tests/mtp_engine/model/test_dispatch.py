"""Dispatched trunk layers change when the device computes, never what: the
same tokens and gradients as layers that wait for the caller's eval."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mtp_engine import MTPEngine
from mtp_engine.model.compiled import CompiledDecoderLayer
from mtp_engine.model.dispatch import CUDA_DISPATCH_MIN_TOKENS, DISPATCHED, DispatchedLayer, dispatched, install_layer_dispatch
from mtp_engine.options import EngineOptions
from mtp_engine.backend import is_cuda_backend
from mtp_engine.tools.host_cost import primitive_counts

PROMPTS = [[12, 7, 99, 31, 5, 150, 42, 8, 77, 3], [5, 6, 7], list(range(20, 60))]


@pytest.fixture(scope="module")
def engines(tiny_path):
    return (MTPEngine.load(tiny_path, options=EngineOptions(layer_dispatch=True)),
            MTPEngine.load(tiny_path, options=EngineOptions(layer_dispatch=False)))


def test_layers_are_swapped_last_and_share_their_weights(engines):
    on, off = engines
    assert [s.state for s in on.fast_paths if s.name == "layer_dispatch"] == ["on"]
    assert [s.line() for s in off.fast_paths if s.name == "layer_dispatch"] == ["fast path layer_dispatch: off (by choice)"]
    layers = on.model.model.layers
    assert all(isinstance(l, DispatchedLayer) for l in layers)
    assert not any(isinstance(l, DispatchedLayer) for l in off.model.model.layers)
    # Compiled layers (the CPU default) keep their compiled paths under it.
    compiled = [s.state for s in on.fast_paths if s.name == "compile_layers"] == ["on"]
    assert all(isinstance(l, CompiledDecoderLayer) == compiled for l in layers)
    before = [id(v) for _, v in tree_flatten(on.model.parameters())]
    assert install_layer_dispatch(on.model) == 0  # installed once
    assert [id(v) for _, v in tree_flatten(on.model.parameters())] == before


def test_only_verify_forwards_of_enough_tokens_dispatch(engines):
    """A dispatched layer's output is already computed when the caller gets
    it (its graph is gone); one left to the caller still holds its ops. On
    CUDA one sequence's verify forwards are too small to gain from it."""
    on, _ = engines
    layer = on.model.model.layers[0]
    dim = on.model.args.hidden_size

    base = next(b for b, d in DISPATCHED.items() if type(layer) is d)
    plain = base.__new__(base)  # the layer as it was before the install
    dict.update(plain, layer)
    plain.__dict__.update(layer.__dict__)

    def pending_ops(min_tokens: int, rows: int, width: int) -> int:
        x = mx.random.normal((rows, width, dim))
        mx.eval(x)
        out = dispatched(plain, min_tokens)(x, None, None)
        mx.synchronize()
        return sum(primitive_counts(out).values())

    assert pending_ops(2, 1, 4) == 0
    assert pending_ops(2, 1, 1) > 0  # decoding steps never dispatch
    assert pending_ops(CUDA_DISPATCH_MIN_TOKENS, 1, 4) > 0
    assert pending_ops(CUDA_DISPATCH_MIN_TOKENS, CUDA_DISPATCH_MIN_TOKENS // 4, 4) == 0
    assert layer.min_tokens == (CUDA_DISPATCH_MIN_TOKENS if is_cuda_backend() else 2)
    [status] = [s for s in on.fast_paths if s.name == "layer_dispatch"]
    assert f"of {layer.min_tokens} tokens or more" in status.detail
    with pytest.raises(ValueError, match="min_tokens must be an int of at least 2, got 1"):
        install_layer_dispatch(on.model, 1)


@pytest.mark.parametrize("mode", ["baseline", "chain"])
def test_dispatched_layers_decode_the_same_tokens(engines, mode):
    on, off = engines
    single = [on.generate(p, max_tokens=24, mode=mode).tokens for p in PROMPTS]
    assert single == [off.generate(p, max_tokens=24, mode=mode).tokens for p in PROMPTS]
    batched = [r.tokens for r in on.generate_batch(PROMPTS, batch_size=2, max_tokens=24, mode=mode, draft_tokens=3)]
    assert batched == [r.tokens for r in off.generate_batch(PROMPTS, batch_size=2, max_tokens=24, mode=mode,
                                                              draft_tokens=3)]
    assert batched == single


def test_gradients_through_dispatched_layers(engines):
    """Inside ``mx.grad`` or ``mx.compile`` of a function of the weights
    (training's case), a layer's output is a tracer: a dispatched layer
    cannot dispatch and computes what a plain layer computes.

    The weights are the transformed function's inputs. A trunk that only
    closes over them is no tracer: its layers are constants of the trace,
    which a dispatched layer evaluates while it is traced (on CUDA, where
    compiled kernels fuse and round differently, the compiled sums then
    differ from a plain trunk's by float rounding)."""
    on, off = engines
    x = mx.array([PROMPTS[0], PROMPTS[0][::-1]])  # 20 tokens: a forward that dispatches on every backend
    assert x.size >= type(on.model.model.layers[0]).min_tokens

    def loss(model):
        out = model.model(x)
        with pytest.raises(ValueError, match="async_eval"):  # traced: no layer could dispatch either
            mx.async_eval(out)
        return out.sum()

    (values, grads) = zip(*(nn.value_and_grad(e.model, loss)(e.model) for e in (on, off)))
    assert mx.array_equal(*values).item()
    flat = [tree_flatten(g) for g in grads]
    assert [k for k, _ in flat[0]] == [k for k, _ in flat[1]] and len(flat[0]) > 0
    if is_cuda_backend():  # CUDA's scatter-add (a gather's gradient: embeddings, experts) adds atomically, in no
        # fixed order, so float32 sums of the same terms may differ run to run (docs/BACKENDS.md)
        assert all((mx.abs(a - b).max() <= 1e-4 * mx.abs(b).max()).item() for (_, a), (_, b) in zip(*flat))
    else:
        assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(*flat))
    # ... and under mx.compile with the weights as its inputs (against
    # compiled plain layers: a GPU's fused kernels may round differently
    # from eager ones).
    compiled = [mx.compile(lambda m=e.model: loss(m), inputs=e.model.state)() for e in (on, off)]
    assert mx.array_equal(*compiled).item()
