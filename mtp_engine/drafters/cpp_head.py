"""Chain and adaptive drafts with the MTP head in C++, on the CPU.

A draft step (the head's fc, one full-attention decoder layer with its MoE
block, the final norm and the LM head, for one token) is about two hundred
MLX primitives, and on MLX's CPU backend each costs a fixed dispatch far
above its arithmetic. ``_mtp_cpp_drafter`` (``native/cpp_drafter.cpp``,
built by ``make install``) runs the same arithmetic as plain loops over the
same float32 weights, which the MLX model keeps (nothing is copied).

Drafts only propose: the verify forward decides every emitted token, so the
C++ arithmetic need not match MLX's bit for bit, only closely enough to
draft the same tokens (tests compare its logits with the MLX head's).

It serves chain and adaptive modes when the model runs on the CPU in float32
(not quantized) and the head has the layout it knows (`head_weights`); the
tree modes keep the MLX drafter (they fork the head's cache). On a GPU it is
opt-in (`EngineOptions.cpp_drafter_on_gpu`): the head then drafts on the
host CPU from float32 copies while the GPU verifies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.drafters.head_weights import FLOATS, UnsupportedHead, head_weights
from mtp_engine.kernels.extensions import load_extension, unavailable_reason
from mtp_engine.model.mtp_head import MTPHead

MODULE = "_mtp_cpp_drafter"


def extension():
    """The extension module, or None when it is not built."""
    return load_extension(MODULE)


def build_cpp_head(head: MTPHead, embed: nn.Module, lm_head: nn.Module, on_gpu: bool = False):
    """A ``DraftHead`` of the extension for this head.

    On the CPU backend it reads the head's own float32 weights. On a GPU
    (``on_gpu``) it keeps float32 copies of the head, embedding and LM head
    in host memory, drafts on the CPU, and the GPU verifies.

    Returns:
        ``(draft_head, None)``, or ``(None, why)`` when it cannot run here.
    """
    ext = extension()
    if ext is None:
        return None, unavailable_reason(MODULE)
    gpu = mx.default_device() != mx.cpu
    if gpu and not on_gpu:
        return None, "off on a GPU unless cpp_drafter_on_gpu (host drafts) is set"
    try:
        weights, values = head_weights(head, embed, lm_head, FLOATS if gpu else (mx.float32,))
    except UnsupportedHead as e:
        return None, f"the head is not one it runs: {e}"
    with mx.stream(mx.cpu):
        weights = {k: mx.contiguous(w.astype(mx.float32)) for k, w in weights.items()}
        mx.eval(list(weights.values()))
    config = ext.HeadConfig()
    for k, v in values.items():
        setattr(config, k, v)
    return ext.DraftHead(weights, config), None


@dataclass
class CppDraftState:
    """One generation's C++ head session and the pairs it has not consumed."""

    session: object
    pending_hidden: mx.array | None = None
    pending_row: int = 0
    pending_tokens: list[int] = field(default_factory=list)
    base: int = 0


class CppDrafter:
    """Chain and adaptive drafts with the C++ head (the `Drafter` interface)."""

    name = "cpp"
    modes = frozenset({"chain", "adaptive"})

    def __init__(self, head):
        self.head = head

    def new_state(self) -> CppDraftState:
        return CppDraftState(session=self.head.session())

    def set_pending(self, state: CppDraftState, hidden: mx.array, tokens: list[int], row: int = 0) -> None:
        """Queue pairs ``(hidden[row, j], tokens[j])``; the C++ head reads
        them straight from ``hidden`` (``[rows, >= len(tokens), dim]``)."""
        if hidden.shape[1] < len(tokens):
            raise ValueError(f"{hidden.shape[1]} hiddens for {len(tokens)} tokens")
        state.pending_hidden, state.pending_row = hidden, row
        state.pending_tokens = list(tokens)

    def commit(self, state: CppDraftState, hidden: mx.array, tokens: list[int], row: int = 0) -> None:
        """Drop the drafted cache entries and queue the accepted pairs."""
        state.session.rewind(state.base)
        self.set_pending(state, hidden, tokens, row)

    def _pending(self, state: CppDraftState) -> tuple[mx.array, int, list[int]]:
        """Take the pending pairs (they are consumed by the next draft)."""
        hidden, row, tokens = state.pending_hidden, state.pending_row, state.pending_tokens
        if hidden is None or not tokens:
            raise RuntimeError("drafting needs pending pairs (set_pending/commit)")
        state.base += len(tokens)
        state.pending_hidden, state.pending_tokens = None, []
        return hidden, row, tokens

    def draft(self, state: CppDraftState, k: int) -> mx.array:
        """K greedy draft tokens, ``[1, k]`` int32. On the CPU backend it is
        not read back: like the MLX drafter's chains, it is evaluated on
        MLX's CPU stream (the C++ head runs there) while the host builds the
        verify forward on top of it."""
        if k < 1:
            raise ValueError(f"a chain draft needs k >= 1 tokens, got {k}")
        hidden, row, tokens = self._pending(state)
        if mx.default_device() != mx.cpu:
            # Host drafts for a GPU model are drafted at once: a verify on the
            # GPU waiting on an array of the CPU stream hung on MLX 0.32.4's
            # CUDA backend.
            return mx.array([state.session.draft(hidden, tokens, k, 0.0, row)[0]], dtype=mx.int32)
        drafts = state.session.draft_lazy(hidden, tokens, k, row)
        mx.async_eval(drafts)
        return drafts

    def draft_batch(self, states: list[CppDraftState], k: int) -> mx.array:
        """K greedy drafts for each of several generations, ``[len(states),
        k]`` int32, drafted together: every product of the head takes all
        their rows at once (each weight is read once per tile of rows, not
        once per generation). Each row's drafts are the ones `draft` gives
        it alone. Lazy on the CPU backend, as `draft`."""
        if k < 1:
            raise ValueError(f"a chain draft needs k >= 1 tokens, got {k}")
        hiddens, sources, rows, tokens = {}, [], [], []  # hiddens: each array once, by identity
        for state in states:
            hidden, row, pairs = self._pending(state)
            sources.append(hiddens.setdefault(id(hidden), (len(hiddens), hidden))[0])
            rows.append(row)
            tokens.append(pairs)
        hiddens = [h for _, h in hiddens.values()]
        drafts = extension().draft_batch([s.session for s in states], hiddens, sources, rows, tokens, k)
        if mx.default_device() != mx.cpu:  # drafted at once, as `draft` does on a GPU
            return mx.array(drafts.tolist(), dtype=mx.int32)
        mx.async_eval(drafts)
        return drafts

    def draft_adaptive(self, state: CppDraftState, depth_max: int, tau: float) -> list[int]:
        """Greedy chain that stops once the running product of top-1
        probabilities falls below ``tau``; 1..depth_max tokens."""
        hidden, row, tokens = self._pending(state)
        drafts, _ = state.session.draft(hidden, tokens, depth_max, tau, row)  # evaluates ``hidden``
        return drafts
