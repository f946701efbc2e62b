"""The interface every drafter implements.

A drafter proposes tokens from the MTP head; the trunk's verify forward
decides what is emitted, so a drafter changes speed, never the output. All
drafters keep the same bookkeeping: each generation gets a state (the head's
KV cache plus the *pending* pairs, ``(H_i, t_{i+1})`` pairs the head has not
consumed yet). After every commit the pending pairs are the accepted tokens
against the trunk's true hiddens, so the head's cache always matches the
committed text; the next draft consumes them in the forward that makes its
first draft token.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class Drafter(Protocol):
    """What the engine calls on a drafter.

    Attributes:
        name: The drafter's name, as ``generate(drafter=...)`` takes it.
        modes: The decoding modes it can draft.
    """

    name: str
    modes: frozenset[str]

    def new_state(self):
        """A fresh per-generation state."""

    def set_pending(self, state, hidden: mx.array, tokens: list[int], row: int = 0) -> None:
        """Queue pairs ``(hidden[row, j], tokens[j])`` (``hidden``
        ``[rows, >= len(tokens), dim]``) for the next draft forward."""

    def commit(self, state, hidden: mx.array, tokens: list[int], row: int = 0) -> None:
        """Drop the entries drafting wrote and queue the accepted pairs:
        positions ``0..n`` of ``row`` of the verify forward's hiddens
        ``[P, K+1, dim]`` with the tokens the step emitted."""

    def draft(self, state, k: int) -> mx.array:
        """A chain of ``k`` greedy draft tokens, ``[1, k]`` int32 (may be
        lazy: the verify forward reads it back with its targets)."""

    def draft_adaptive(self, state, depth_max: int, tau: float) -> list[int]:
        """A greedy chain that stops once the running product of top-1
        probabilities falls below ``tau``; 1..depth_max tokens."""
