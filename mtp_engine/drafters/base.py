"""The interface every drafter implements.

A drafter proposes tokens from the MTP head for the rows of a batch; the
trunk's verify forward decides what is emitted, so a drafter changes speed,
never the output. Per row, a drafter keeps the head's cache and the
*pending* pairs ``(H_i, t_{i+1})`` the head has not consumed: after every
commit, the accepted tokens against the trunk's true hiddens (so the head's
cache always matches the committed text), consumed by the next draft's
first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx


@dataclass
class Proposal:
    """What a drafter proposes for one verify forward.

    Attributes:
        tokens: ``[V, k]`` int32 drafts, one verify row per path (may be
            lazy: the verify forward reads them back with its targets).
        owners: The row each verify row drafts for (None: verify row ``v``
            is row ``v``); a row's paths are consecutive.
        uses: How many of its ``k`` drafts each verify row uses (None: all).
        q_scaled: Rejection sampler: the head's ``[V, k, vocab]`` filtered,
            temperature-scaled log-probabilities at the drafts (chains).
        masks: Constrained rows (`mtp_engine.constraints`): ``[V, k+1,
            vocab]`` bool, the tokens each verified position allows.
    """

    tokens: mx.array
    owners: list[int] | None = None
    uses: list[int] | None = None
    q_scaled: mx.array | None = None
    masks: mx.array | None = None

    @classmethod
    def padded(cls, paths: list[list[int]], caps: list[int], owners: list[int] | None = None,
               masks: mx.array | None = None) -> "Proposal":
        """Host paths of different lengths, each padded by repeating its last
        token and using at most its own length and its row's cap."""
        width = max(len(p) for p in paths)
        return cls(mx.array([p + [p[-1]] * (width - len(p)) for p in paths], dtype=mx.int32), owners=owners,
                   uses=[min(len(p), caps[o]) for p, o in zip(paths, owners or range(len(paths)))], masks=masks)


class Drafter(Protocol):
    """What the decoder calls on a drafter: ``name`` (as ``DecodeConfig(drafter=...)``
    takes it), the ``modes`` it drafts, the ``rows`` it drafts for."""

    name: str
    modes: frozenset[str]
    rows: int

    def add_row(self, slot: int | None, prompt_hidden: mx.array, pairs: list[int], key=None, prefix=None) -> None:
        """A row joins (at the end, or in place of row ``slot``, one that
        left) with its prompt's pairs ``(prompt_hidden[0, j], pairs[j])``;
        ``prefix``: the `PrefixState` its prompt starts with, if any."""

    def filter(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""

    def extend(self, hidden: mx.array, tokens: list[list[int]]) -> None:
        """Queue a plain step's pairs (mode "auto"): row ``b``'s ``(hidden[b, 0],
        tokens[b][0])``, where ``tokens[b]`` is empty for a row not fed."""

    def propose(self, decode, k: int, params: list, starts: list[int], caps: list[int], grammars=None) -> Proposal:
        """Drafts for one verify forward (``k`` deep at most, row ``b`` using
        at most ``caps[b]``, its choices at generated positions ``starts[b]..``,
        masked by its `mtp_engine.constraints.RowGrammar` where ``grammars``
        has one: the MLX head only)."""

    def commit(self, hidden: mx.array, emitted: list[list[int]], winners: list[int]) -> None:
        """Rewind what drafting wrote and queue each row's accepted pairs:
        positions ``0..n`` of verify row ``winners[b]`` of the hiddens
        ``[V, K+1, dim]`` with the tokens row ``b`` emitted."""
