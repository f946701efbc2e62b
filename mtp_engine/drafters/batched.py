"""Drafting for a batch of rows that speculate together.

Every step each row drafts K tokens from its own pending pairs (its last
step's accepted tokens against the trunk's true hiddens). Two drafters:

- `BatchedMLXDrafter`: the MLX head over the whole batch, one forward per
  draft position (the first over every row's pending pairs, right-padded to
  the longest; the padding becomes holes of its `BatchKVCache`).
- `BatchedCppDrafter`: the C++ head, one session per row (its own KV cache,
  nothing ragged), every row's chain drafted in one lazy primitive on MLX's
  CPU stream (each product of the head over all rows at once).

Both take rows as they join (`add_row`, after the row's prefill, or
`replace_row` in the place of one that left), drop the rows that leave
(`filter`), draft ``[B, k]`` (`draft`) and queue each row's
accepted pairs (`commit`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.cache.batch import BatchKVCache
from mtp_engine.drafters.compiled_head import CompiledHead
from mtp_engine.drafters.cpp_head import CppDrafter
from mtp_engine.model.mtp_head import MTPHead
from mtp_engine.options import MAX_VERIFY_WIDTH
from mtp_engine.sampling import SamplingParams, draft_choice
from mtp_engine.verify import positions_of


@dataclass
class _Pending:
    """Pending pairs of some consecutive rows: ``hidden[r, :counts[r]]``
    with ``tokens[r]``."""

    hidden: mx.array  # [rows, >= max(counts), dim]
    tokens: list[list[int]]
    counts: list[int]


class BatchedMLXDrafter:
    """Chain drafts of a batch with the MLX head.

    Args:
        head: The `MTPHead`; embed: the trunk's embedding; lm_head: hiddens
            to logits.
        prefill_step_size: Pairs per forward of a joining row's head prefill.
        compiled: The head's `CompiledHead` (draft forwards in compiled
            pieces, traced once per ``[rows, width]``), or None for eager
            forwards.
    """

    name = "mlx"

    def __init__(self, head: MTPHead, embed: nn.Module, lm_head, prefill_step_size: int = 2048,
                 compiled: CompiledHead | None = None):
        self.head = head
        self.embed = embed
        self.lm_head = lm_head
        self.prefill_step_size = prefill_step_size
        self.compiled = compiled
        self._greedy = mx.compile(lambda m: mx.argmax(lm_head(m), axis=-1).astype(mx.int32))
        self.q_scaled: mx.array | None = None
        self.cache = [BatchKVCache() for _ in head.layers]
        self.pending: list[_Pending] = []
        self._base: tuple[int, list[int]] | None = None

    @property
    def rows(self) -> int:
        return self.cache[0].batch_size

    def add_row(self, prompt_hidden: mx.array, tokens: list[int]) -> None:
        """A joining row: the head consumes its prompt's pairs
        ``(prompt_hidden[0, j], tokens[j])`` but the last, which stays pending."""
        for c, o in zip(self.cache, self._prefill(prompt_hidden, tokens)):
            c.add_row(o.keys, o.values, o.idx)
        n = len(tokens) - 1
        self.pending.append(_Pending(prompt_hidden[:, n : n + 1], [tokens[n:]], [1]))

    def replace_row(self, row: int, prompt_hidden: mx.array, tokens: list[int]) -> None:
        """`add_row` in place of row ``row``, one that left."""
        for c, o in zip(self.cache, self._prefill(prompt_hidden, tokens)):
            c.replace_row(row, o.keys, o.values, o.idx)
        hidden, pending, counts = self._gather_pending()
        n = len(tokens) - 1
        hidden[row : row + 1, :1] = prompt_hidden[:, n : n + 1].astype(hidden.dtype)
        pending[row], counts[row] = tokens[n:], 1
        self.pending = [_Pending(hidden, pending, counts)]

    def _prefill(self, prompt_hidden: mx.array, tokens: list[int]) -> list[BatchKVCache]:
        """The head's caches of one row after its prompt's pairs but the last."""
        own = [BatchKVCache(1) for _ in self.head.layers]
        n = len(tokens) - 1
        ids = mx.array(tokens[:-1])[None]
        for start in range(0, n, self.prefill_step_size):
            end = min(start + self.prefill_step_size, n)
            self.head(prompt_hidden[:, start:end], self.embed(ids[:, start:end]), own)
            mx.eval([c.state for c in own])
        return own

    def filter(self, rows: list[int]) -> None:
        for c in self.cache:
            c.filter(rows)
        hidden, tokens, counts = self._gather_pending()
        index = mx.array(rows, dtype=mx.int32)
        self.pending = [_Pending(hidden[index], [tokens[r] for r in rows], [counts[r] for r in rows])] if rows else []

    def _gather_pending(self) -> tuple[mx.array, list[list[int]], list[int]]:
        """All rows' pending pairs as one right-padded block."""
        width = max(max(p.counts) for p in self.pending)
        blocks = []
        for p in self.pending:
            h = p.hidden[:, :width]
            if h.shape[1] < width:
                h = mx.concatenate([h, mx.zeros((h.shape[0], width - h.shape[1], h.shape[2]), h.dtype)], axis=1)
            blocks.append(h)
        hidden = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)
        tokens = [t for p in self.pending for t in p.tokens]
        counts = [c for p in self.pending for c in p.counts]
        return hidden, tokens, counts

    def draft(self, k: int, params: list[SamplingParams] | None = None, starts: list[int] | None = None) -> mx.array:
        """``[B, k]`` int32 drafts (lazy), one head forward per position:
        greedy, or each row's sampler choice at generated positions
        ``starts[b]..`` (then `q_scaled` holds what rejection needs)."""
        if k < 1:
            raise ValueError(f"a chain draft needs k >= 1 tokens, got {k}")
        self.q_scaled = None
        if params is not None and not all(p.greedy for p in params):
            return self._draft_sampled(k, params, starts)
        hidden, tokens, counts = self._gather_pending()
        width = hidden.shape[1]
        ids = mx.array([t + [0] * (width - len(t)) for t in tokens], dtype=mx.int32)  # [B, width]
        m = self._forward(hidden, ids)  # [B, width, dim]
        for c in self.cache:
            c.settle(counts, width)
        self._base = (self.cache[0].idx, list(self.cache[0].positions))
        last = m[:, -1:] if len(set(counts)) == 1 and counts[0] == width else (
            m[mx.arange(len(counts)), mx.array(counts) - 1][:, None])  # [B, 1, dim]
        drafts = [self._greedy(last[:, 0])]
        for _ in range(k - 1):
            mx.async_eval(drafts[-1])
            last = self._forward(last, drafts[-1][:, None])
            drafts.append(self._greedy(last[:, 0]))
        mx.async_eval(drafts[-1])  # the device drafts while the caller builds the verify forward
        return mx.stack(drafts, axis=1)

    def _draft_sampled(self, k: int, params: list[SamplingParams], starts: list[int]) -> mx.array:
        hidden, tokens, counts = self._gather_pending()
        width = hidden.shape[1]
        ids = mx.array([t + [0] * (width - len(t)) for t in tokens], dtype=mx.int32)
        m = self._forward(hidden, ids)
        for c in self.cache:
            c.settle(counts, width)
        self._base = (self.cache[0].idx, list(self.cache[0].positions))
        last = m[mx.arange(len(counts)), mx.array(counts) - 1][:, None]  # [B, 1, dim]
        drafts, scaled = [], []
        for depth in range(k):
            if depth:
                last = self._forward(last, drafts[-1])
            d, q = draft_choice(self.lm_head(last), params, positions_of(starts, 1) + depth)
            drafts.append(d)
            scaled.append(q)
            mx.async_eval(d)
        if scaled[0] is not None:
            self.q_scaled = mx.concatenate(scaled, axis=1)  # [B, k, V]
        return mx.concatenate(drafts, axis=1)

    def _forward(self, hidden: mx.array, ids: mx.array) -> mx.array:
        """The head's final-normed hiddens over ``[B, L]`` pairs."""
        if self.compiled is not None and ids.shape[1] <= MAX_VERIFY_WIDTH:
            return self.compiled.hiddens(hidden, ids, self.cache)
        return self.head(hidden, self.embed(ids), self.cache)

    def commit(self, hidden: mx.array, emitted: list[list[int]]) -> None:
        """Drop what drafting wrote; queue row ``b``'s pairs
        ``(hidden[b, j], emitted[b][j])`` (``hidden`` is the verify
        forward's ``[B, K+1, dim]``)."""
        if self._base is not None:
            for c in self.cache:
                c.rewind(*self._base)
        self.pending = [_Pending(hidden, [list(e) for e in emitted], [len(e) for e in emitted])]


class BatchedCppDrafter:
    """Chain drafts of a batch with the C++ head: one session per row."""

    name = "cpp"

    def __init__(self, cpp: CppDrafter):
        self.cpp = cpp
        self.states = []
        self.q_scaled = None

    @property
    def rows(self) -> int:
        return len(self.states)

    def add_row(self, prompt_hidden: mx.array, tokens: list[int]) -> None:
        state = self.cpp.new_state()
        self.cpp.set_pending(state, prompt_hidden, tokens)
        self.states.append(state)

    def replace_row(self, row: int, prompt_hidden: mx.array, tokens: list[int]) -> None:
        state = self.cpp.new_state()
        self.cpp.set_pending(state, prompt_hidden, tokens)
        self.states[row] = state

    def filter(self, rows: list[int]) -> None:
        self.states = [self.states[r] for r in rows]

    def draft(self, k: int, params: list[SamplingParams] | None = None, starts: list[int] | None = None) -> mx.array:
        if params is not None and not all(p.greedy for p in params):
            raise ValueError("the C++ drafter drafts greedily; sampling drafts with the MLX head")
        self.q_scaled = None
        return self.cpp.draft_batch(self.states, k)

    def commit(self, hidden: mx.array, emitted: list[list[int]]) -> None:
        for row, (state, tokens) in enumerate(zip(self.states, emitted)):
            self.cpp.commit(state, hidden, tokens, row=row)
