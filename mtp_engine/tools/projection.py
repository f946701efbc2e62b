"""Drafts projected at a published acceptance profile, for benchmarks of
random-weight models.

A model with random weights accepts nothing its MTP head drafts, so its
speedups mean nothing. To price speculation on such a model at a realistic
acceptance, the head still runs every step (its cost is paid), but its
tokens are replaced by the true greedy continuation (from a plain run of the
same prompt), each position kept with the conditional probability a
cumulative acceptance profile implies: with profile ``(p1, p2, p3)``, draft
1 is right with probability p1, draft 2 with p2/p1 given draft 1 was, and so
on, the last ratio repeating past the profile's end; a second profile may
take over past a number of new tokens (acceptance that falls with
context). From the first draft that
is not kept on, drafts are wrong tokens. The verify forward still decides every
emitted token, so the output equals plain decoding; figures made this way
are labelled "projected at profile X", never measured acceptance.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np


def parse_profile(text: str) -> tuple[float, ...]:
    """``"0.93,0.82,0.64"`` as a non-increasing cumulative profile in (0, 1]."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"an acceptance profile is comma-separated probabilities, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values) or any(b > a for a, b in zip(values, values[1:])):
        raise ValueError(f"an acceptance profile must be non-increasing values in (0, 1], got {text!r}")
    return values


def _conditional(profile: tuple[float, ...]) -> list[float]:
    return [profile[0]] + [b / a for a, b in zip(profile, profile[1:])]


def parse_later(text: str) -> tuple[int, tuple[float, ...]]:
    """``"512:0.70,0.45,0.27"``: from 512 new tokens on, that profile."""
    after, sep, profile = text.partition(":")
    if not sep or not after.isdigit():
        raise ValueError(f"a later profile is NEW_TOKENS:PROFILE (e.g. 512:0.70,0.45,0.27), got {text!r}")
    return int(after), parse_profile(profile)


class ProjectedDrafts:
    """Replaces one prompt's drafts by its true continuation at a profile.

    Args:
        profile: Cumulative acceptance by draft position (`parse_profile`).
        reference: The prompt's plain greedy continuation (its tokens).
        vocab: Vocabulary size (wrong tokens are drawn from it).
        seed: Seeds the keep/drop draws.
        later: ``(after, profile)``: drafts for positions from ``after``
            new tokens on draw with this profile instead.
    """

    def __init__(self, profile: tuple[float, ...], reference: list[int], vocab: int, seed: int = 0,
                 later: tuple[int, tuple[float, ...]] | None = None):
        self.conditional = _conditional(profile)
        self.after, self.later = (later[0], _conditional(later[1])) if later else (None, None)
        self.reference = list(reference)
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def keep_probability(self, j: int, emitted: int = 0) -> float:
        """Probability that draft ``j`` (from 0) after ``emitted`` new tokens
        is right given the earlier ones were."""
        table = self.later if self.after is not None and emitted >= self.after else self.conditional
        return table[min(j, len(table) - 1)]

    def drafts(self, k: int, emitted: int) -> list[int]:
        """``k`` drafts that follow ``emitted`` generated tokens (the last of
        them is the verify's first input), made without the head's: the
        verify stops at the first wrong one, so what follows it (wrong tokens
        too) and positions past the reference (past the row's budget) are
        never emitted. The head's drafts are still computed: the caller
        evaluates them without reading them back, as a real run does."""
        out, missed = [], False
        for j in range(k):
            position = emitted + j
            true = self.reference[position] if position < len(self.reference) else 0
            missed = missed or self.rng.random() >= self.keep_probability(j, emitted)
            out.append((true + 1) % self.vocab if missed else true)
        return out


def project_rows(drafts: mx.array, rows: list[list[int] | None]) -> mx.array:
    """``drafts`` ``[B, k]`` with row ``b`` replaced by ``rows[b]`` where it
    is not None. The head's drafts stay in the graph (the verify that reads
    the result pays their cost) and are never read back."""
    k = drafts.shape[1]
    keep = mx.array([r is None for r in rows])[:, None]
    return mx.where(keep, drafts, mx.array([[0] * k if r is None else r for r in rows], dtype=mx.int32))


class ProjectingDrafter:
    """A drafter whose chain drafts are projected (`ProjectedDrafts`) for
    the rows that have a projection: it drafts with ``inner`` (the head's
    cost is paid) and replaces each such row's tokens. Rows join with their
    decoder key; ``projections`` maps a key to its `ProjectedDrafts` (a
    missing key keeps the head's drafts)."""

    def __init__(self, inner, projections: dict):
        self.inner = inner
        self.projections = projections
        self.keys: list = []
        self.name, self.modes = inner.name, frozenset({"chain"})

    @property
    def rows(self) -> int:
        return self.inner.rows

    def add_row(self, slot, prompt_hidden, pairs, key=None, prefix=None) -> None:
        self.inner.add_row(slot, prompt_hidden, pairs, key, prefix)
        if slot is None:
            self.keys.append(key)
        else:
            self.keys[slot] = key

    def filter(self, rows: list[int]) -> None:
        self.inner.filter(rows)
        self.keys = [self.keys[r] for r in rows]

    def propose(self, decode, k: int, params, starts, caps):
        proposal = self.inner.propose(decode, k, params, starts, caps)
        rows = [None if (p := self.projections.get(key)) is None else p.drafts(k, start)
                for key, start in zip(self.keys, starts)]
        return replace(proposal, tokens=project_rows(proposal.tokens, rows))

    def extend(self, hidden, tokens) -> None:
        self.inner.extend(hidden, tokens)

    def commit(self, hidden, emitted, winners) -> None:
        self.inner.commit(hidden, emitted, winners)
