"""Trunk decoder layers that hand their work to the device as they are built.

MLX is lazy: a forward's ops run when something evaluates them. A verify or
decoding forward is built in Python op by op (thousands of ops for a large
model), and until the caller evaluates its output the device waits. A
dispatched layer calls ``mx.async_eval`` on its output, so the device
computes layer ``l`` while the host builds layer ``l + 1``. The values are
the same arrays as without it: only when they are computed changes.

Only verify forwards dispatch (2 to `MAX_VERIFY_WIDTH` tokens a row), and
on CUDA only those of `CUDA_DISPATCH_MIN_TOKENS` tokens or more (rows x
width): there one-token decoding steps and one sequence's verify forwards
give the device too little work to hide each layer's submission behind, and
in prompt prefill the host would queue many layers ahead and raise peak
memory for no time gained (figures: docs/BACKENDS.md).

``mx.async_eval`` of a traced array is refused (inside ``mx.grad`` or
``mx.compile`` of a function of the weights or of the trunk's input); there
a dispatched layer is a plain one. A trunk that a transformed function only
closes over is not traced: its layers are constants of the trace, and a
dispatched layer evaluates them as the trace is built.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

from mtp_engine.model.compiled import CompiledDecoderLayer
from mtp_engine.model.swap import share_weights
from mtp_engine.options import MAX_VERIFY_WIDTH

CUDA_DISPATCH_MIN_TOKENS = 16
"""Tokens (rows x width) from which a verify forward's layers dispatch on
CUDA (`EngineOptions.layer_dispatch`): below it there is too little device
work to hide the extra submissions; on the CPU every verify forward
dispatches (figures: docs/BACKENDS.md)."""


class DispatchedLayer:
    """Mixin for a decoder layer class: in verify forwards (2 to
    `MAX_VERIFY_WIDTH` tokens a row, ``min_tokens`` or more in all) its output
    is evaluated asynchronously as soon as the layer's ops are built."""

    min_tokens: int = 2
    """The fewest tokens (rows x width) of a forward whose output dispatches
    (set per instance by `install_layer_dispatch`)."""

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        out = super().__call__(x, *args, **kwargs)
        rows, width = x.shape[0], x.shape[1]
        if not 1 < width <= MAX_VERIFY_WIDTH or rows * width < self.min_tokens:
            return out
        try:
            mx.async_eval(out)
        except ValueError:  # inside mx.grad / mx.compile: the caller evaluates
            pass
        return out


class DispatchedNextLayer(DispatchedLayer, Qwen3NextDecoderLayer):
    """mlx-lm's Qwen3-Next decoder layer, dispatched."""


class DispatchedQwen35Layer(DispatchedLayer, qwen3_5.DecoderLayer):
    """mlx-lm's Qwen3.5 decoder layer, dispatched."""


class DispatchedCompiledLayer(DispatchedLayer, CompiledDecoderLayer):
    """The engine's compiled decoder layer, dispatched."""


DISPATCHED: dict[type, type] = {
    Qwen3NextDecoderLayer: DispatchedNextLayer,
    qwen3_5.DecoderLayer: DispatchedQwen35Layer,
    CompiledDecoderLayer: DispatchedCompiledLayer,
}
"""Each trunk layer class the engine loads, and its dispatching subclass."""


def dispatched(layer: nn.Module, min_tokens: int = 2) -> DispatchedLayer:
    """``layer`` as its dispatching subclass (sharing its weights) for
    forwards of ``min_tokens`` or more tokens."""
    new = share_weights(DISPATCHED[type(layer)], layer)
    new.min_tokens = min_tokens
    return new


def install_layer_dispatch(model: nn.Module, min_tokens: int = 2) -> int:
    """Swap every trunk decoder layer of ``model`` for its dispatching
    subclass, sharing its weights; verify forwards of ``min_tokens`` or
    more tokens (rows x width) dispatch. Run it after the other layer
    installs (it subclasses the class each layer has by then). Returns how
    many layers were swapped (0 when installed before)."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 2:
        raise ValueError(f"min_tokens must be an int of at least 2, got {min_tokens!r}")
    layers = model.model.layers
    swapped = 0
    for i, layer in enumerate(layers):
        if not isinstance(layer, DispatchedLayer):
            layers[i] = dispatched(layer, min_tokens)
            swapped += 1
    return swapped
