"""Trunk decoder layers that hand their work to the device as they are built.

MLX is lazy: a forward's ops run when something evaluates them. A verify or
decoding forward is built in Python op by op (thousands of ops for a large
model), and until the caller evaluates its output the device waits. A
dispatched layer calls ``mx.async_eval`` on its output, so the device
computes layer ``l`` while the host builds layer ``l + 1``. The values are
the same arrays as without it: only when they are computed changes.

Only verify forwards dispatch (2 to `MAX_VERIFY_WIDTH` tokens a row), and
on CUDA only those of `CUDA_DISPATCH_MIN_TOKENS` tokens or more (rows x
width). On the H200 (80B-A3B shapes, 8 rows) dispatching made verify steps
of 4 tokens a row faster (66 against 87 ms) but one-token decoding steps
slower (48-52 against 38-43 ms), and one sequence's verify steps too (38
against 30 ms a step at K=3): each of the 48 submissions costs host time
and the device has little work to hide it behind. In prompt prefill, where the device
is the slower side, the host queued many layers ahead and their buffers
raised peak memory by about 6 GB for no time gained.

``mx.async_eval`` is not allowed inside a function transformation
(``mx.grad``, ``mx.compile``: head training runs the trunk under both);
there a dispatched layer is a plain one.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.model.swap import share_weights
from mtp_engine.options import MAX_VERIFY_WIDTH


class DispatchedLayer:
    """Mixin for a decoder layer class: in verify forwards (2 to
    `MAX_VERIFY_WIDTH` tokens a row, ``min_tokens`` or more in all) its output
    is evaluated asynchronously as soon as the layer's ops are built."""

    min_tokens: int = 2
    """The fewest tokens (rows x width) of a forward whose output dispatches."""

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


_CLASSES: dict[tuple[type, int], type] = {}


def dispatched_class(cls: type, min_tokens: int = 2) -> type:
    """The dispatching subclass of decoder layer class ``cls`` for forwards
    of ``min_tokens`` or more tokens (one per class and threshold)."""
    if issubclass(cls, DispatchedLayer):
        return cls
    key = (cls, min_tokens)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Dispatched{cls.__name__}", (DispatchedLayer, cls), {"min_tokens": min_tokens})
    return _CLASSES[key]


def install_layer_dispatch(model: nn.Module, min_tokens: int = 2) -> int:
    """Swap every trunk decoder layer of ``model`` for its dispatching
    subclass, sharing its weights; verify forwards of ``min_tokens`` or
    more tokens (rows x width) dispatch. Run it after the other layer
    installs (it subclasses whatever class each layer has by then). Returns
    how many layers were swapped (0 when installed before)."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 2:
        raise ValueError(f"min_tokens must be an int of at least 2, got {min_tokens!r}")
    layers = model.model.layers
    swapped = 0
    for i, layer in enumerate(layers):
        if not isinstance(layer, DispatchedLayer):
            layers[i] = share_weights(dispatched_class(type(layer), min_tokens), layer)
            swapped += 1
    return swapped
