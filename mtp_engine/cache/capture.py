"""Per-token recurrent-state capture for verify forwards.

Gated-delta caches hold ``[conv_state, ssm_state]`` and cannot be trimmed.
To commit a verified prefix without replaying it, a verify forward records,
for every token, the conv window and the recurrent state after it (its
*captured states*, filled by `mtp_engine.model.gated_delta`); commit is then
a lookup. The per-token states are sliced only when asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache


class CapturedStates(Sequence):
    """``[conv_state, ssm_state]`` after each token of a captured forward."""

    def __init__(self, conv_states: Sequence, ssm_states: Sequence):
        assert len(conv_states) == len(ssm_states), (len(conv_states), len(ssm_states))
        self.conv_states = conv_states
        self.ssm_states = ssm_states

    def __len__(self) -> int:
        return len(self.ssm_states)

    def __getitem__(self, t: int) -> list[mx.array]:
        return [self.conv_states[t], self.ssm_states[t]]


class StateCaptureCache(ArraysCache):
    """An ``ArraysCache`` that can record per-token states during a forward.

    Attributes:
        capture: When True, the next forward through a capturing layer
            records ``captured`` (it resets ``capture`` afterwards).
        captured: ``captured[i]`` is ``[conv_state, ssm_state]`` after token
            ``i`` of the last captured forward (a `CapturedStates`, which
            builds only the items asked for), or None.
    """

    def __init__(self, size: int = 2):
        super().__init__(size)
        self.capture: bool = False
        self.captured: CapturedStates | None = None

    def begin_capture(self) -> None:
        self.capture, self.captured = True, None

    def clear_captured(self) -> None:
        self.capture, self.captured = False, None

    def record(self, tokens: int, conv_states: Sequence, ssm_states: Sequence) -> None:
        """Advance past the ``tokens`` of a forward and, when capturing, keep
        their per-token states."""
        self[0], self[1] = conv_states[-1], ssm_states[-1]
        self.advance(tokens)
        if self.capture:
            self.captured = CapturedStates(conv_states, ssm_states)
            self.capture = False


class ConvWindows(Sequence):
    """The conv window after each token of a forward: item ``t`` is the
    ``n_keep`` conv inputs ending at token ``t`` of ``conv_input`` (which
    starts with the ``n_keep`` inputs before the forward)."""

    def __init__(self, conv_input: mx.array, n_keep: int):
        self.conv_input = conv_input
        self.n_keep = n_keep

    def __len__(self) -> int:
        return self.conv_input.shape[1] - self.n_keep

    def __getitem__(self, t: int) -> mx.array:
        t = range(len(self))[t]  # negative indices; IndexError past the end
        return mx.contiguous(self.conv_input[:, t + 1 : t + 1 + self.n_keep, :])

    def rows(self, last: mx.array) -> mx.array:
        """``[B, n_keep, C]``: row b's window after its token ``last[b]``."""
        B, L, C = self.conv_input.shape
        index = mx.arange(B)[:, None] * L + last[:, None] + 1 + mx.arange(self.n_keep)[None]
        return mx.take(self.conv_input.reshape(B * L, C), index.reshape(-1), axis=0).reshape(B, self.n_keep, C)


class StackedStates(Sequence):
    """Rows of a ``[T, ...]`` array of per-token recurrent states."""

    def __init__(self, states: mx.array):
        self.states = states

    def __len__(self) -> int:
        return self.states.shape[0]

    def __getitem__(self, t: int) -> mx.array:
        return self.states[range(len(self))[t]]

    def rows(self, last: mx.array) -> mx.array:
        """``[B, ...]``: row b's state after its token ``last[b]``."""
        T, B = self.states.shape[:2]
        flat = self.states.reshape(T * B, -1)  # rows of whole states: the gather copies each one whole
        return mx.take(flat, last * B + mx.arange(B), axis=0).reshape(self.states.shape[1:])

    def stacked(self) -> mx.array:
        """Every token's state, ``[T, B, ...]``."""
        return self.states


def state_rows(states: Sequence, last: mx.array) -> mx.array:
    """Row b of ``states[last[b]]``: per-token states of a forward over B
    rows (`ConvWindows`, `StackedStates`, the CUDA kernel's deferred states,
    or a list of ``[B, ...]`` arrays), each row at its own token."""
    return (states if hasattr(states, "rows") else StackedStates(mx.stack(list(states)))).rows(last)


def stack_states(states: Sequence) -> mx.array:
    """Per-token recurrent states as one ``[T, B, ...]`` array."""
    return states.stacked() if hasattr(states, "stacked") else mx.stack(list(states))


class EngineKVCache(KVCache):
    """A ``KVCache`` made by the engine (`make_main_cache`); full-attention
    layers take their compiled path only with one (`mtp_engine.model.compiled`)."""


def make_main_cache(model: nn.Module) -> list:
    """Fresh caches for the trunk: KV for attention, capturing arrays for
    gated-delta layers."""
    return [StateCaptureCache(2) if layer.is_linear else EngineKVCache() for layer in model.layers]
