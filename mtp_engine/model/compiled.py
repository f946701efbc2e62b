"""Compiled decoder layers for the engine's own decode and verify forwards.

A decode step of a small or MoE-heavy model spends most of its time building
and dispatching many tiny ops, not computing. ``mx.compile`` traces a layer
once per input shape and replays it, fusing the elementwise ops. Decode and
verify forwards have few shapes (one token; ``K + 1`` tokens; ``P`` rows of a
tree), so each layer holds a handful of traces.

What is compiled, per decoder layer:

- gated-delta layers: the whole layer (norms, mixer with its per-token
  recurrence and captured states, MoE) — its caches have fixed shapes;
- full-attention layers (trunk and MTP head): the MoE half. Attention reads a
  KV cache that grows every step, so it stays eager.

Only the engine's forwards take the compiled path: it needs the engine's
caches (`StateCaptureCache`, `EngineKVCache`), and widths up to
`MAX_VERIFY_WIDTH` tokens (prompt prefill stays eager). mlx-lm's own
decoding of the same model instance (the lossless reference, the batch mode)
builds mlx-lm caches and runs mlx-lm's code unchanged.

The compiled functions hold the layer weights as they are at install time, so
`install_compiled_layers` runs after the last cast or quantization; our
loaders do. On MLX's CPU backend the fused float32 kernels give bit-identical
results to the eager ops (tested). On CUDA in bfloat16 compiling changed the
arithmetic and did not pay (docs/BENCHMARKS.md), so
`EngineOptions.compile_layers` defaults to the CPU backend only.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

from mtp_engine.cache.batch import BatchKVCache
from mtp_engine.cache.capture import (
    ConvWindows,
    EngineKVCache,
    StackedStates,
    StateCaptureCache,
    stack_states,
)
from mtp_engine.model.gated_delta import mix_tokens
from mtp_engine.model.mtp_head import MTPDecoderLayer, MTPHead, mlp_residual
from mtp_engine.model.swap import share_weights
from mtp_engine.options import MAX_VERIFY_WIDTH


class CompiledDecoderLayer(Qwen3NextDecoderLayer):
    """A trunk decoder layer with compiled decode and verify paths."""

    @classmethod
    def from_layer(cls, layer: Qwen3NextDecoderLayer) -> "CompiledDecoderLayer":
        new = share_weights(cls, layer)
        new._mlp_fn = mx.compile(partial(mlp_residual, new))
        new._linear_fn = mx.compile(new._linear_layer) if new.is_linear else None
        return new

    def _linear_layer(self, x: mx.array, conv_state: mx.array, state: mx.array) -> list[mx.array]:
        out, conv_states, ssm_states = mix_tokens(
            self.linear_attn, self.input_layernorm(x), conv_state, state
        )
        # The states of every token as two arrays (the conv inputs and the
        # stacked recurrent states): a commit slices out the one it keeps.
        return [mlp_residual(self, x + out), conv_states.conv_input, stack_states(ssm_states)]

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        width = x.shape[1]
        if width <= MAX_VERIFY_WIDTH:
            if self.is_linear and _compiled_linear_ok(cache, mask, width):
                res = self._linear_fn(x, cache[0], cache[1])
                n_keep = self.linear_attn.conv_kernel_size - 1
                cache.record(width, ConvWindows(res[1], n_keep), StackedStates(res[2]))
                return res[0]
            if not self.is_linear and isinstance(cache, (EngineKVCache, BatchKVCache)):
                h = x + self.self_attn(self.input_layernorm(x), mask, cache)
                return self._mlp_fn(h)
        return super().__call__(x, mask=mask, cache=cache)


def _compiled_linear_ok(cache, mask, width: int) -> bool:
    return (
        isinstance(cache, StateCaptureCache)
        and mask is None
        and cache[0] is not None
        and cache[1] is not None
        and (width == 1 or cache.capture)
    )


class CompiledMTPLayer(MTPDecoderLayer):
    """An MTP head layer whose MoE half is compiled for narrow forwards."""

    @classmethod
    def from_layer(cls, layer: MTPDecoderLayer) -> "CompiledMTPLayer":
        new = share_weights(cls, layer)
        new._mlp_fn = mx.compile(partial(mlp_residual, new))
        return new

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        if x.shape[1] > MAX_VERIFY_WIDTH:
            return super().__call__(x, mask, cache)
        return self._mlp_fn(x + self.self_attn(self.input_layernorm(x), mask, cache))



def install_compiled_layers(model: nn.Module, head: MTPHead | None = None) -> None:
    """Swap the trunk's (and the head's) decoder layers for compiled ones that
    share their weights. Run it after `install_state_capture` and after the
    last change to the weights. Installing twice is a no-op."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if not isinstance(layer, CompiledDecoderLayer):
            layers[i] = CompiledDecoderLayer.from_layer(layer)
    if head is not None:
        for i, layer in enumerate(head.layers):
            if not isinstance(layer, CompiledMTPLayer):
                head.layers[i] = CompiledMTPLayer.from_layer(layer)
