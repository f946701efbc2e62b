"""Shared prefixes prefilled once.

A `PrefixState` holds what a prompt's first ``L`` tokens leave behind: the
trunk's caches after them (attention keys and values, and each gated-delta
layer's conv window and recurrent state at exactly that boundary: the
recurrent state cannot be trimmed, so a prefix is reusable only for prompts
that continue it token for token), the trunk's hiddens over them, and the
MTP head's caches after its first ``L - 1`` pairs (hidden ``j`` with token
``j + 1``: the pair at ``L - 1`` takes the row's own first token), the MLX
head's and, where there is one, the C++ head's. A row whose prompt starts
with the prefix prefills only its suffix, into a copy of the caches
(`copy_caches`), and the head consumes only the pairs after the prefix's,
from a copy of its state; the prefix's own caches are never written.

The prefix is prefilled as a prompt of its own (chunks, its last token
alone), so a row's prefill is split at the prefix's end: a boundary plain
prefill does not have. Float arithmetic may round the two splits
differently; outputs stay those of plain decoding up to numerical near-ties
(tests/mtp_engine/test_prefix.py shows the first divergence, where any,
sits on one).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mtp_engine.cache.capture import StateCaptureCache, make_main_cache
from mtp_engine.drafters.head import head_prefill


@dataclass(frozen=True)
class PrefixState:
    """The trunk's state after a prompt prefix (`MTPEngine.prefill_prefix`).

    Attributes:
        tokens: The prefix's token ids.
        caches: The trunk's caches after them (never written after this).
        hidden: The trunk's final-normed hiddens over them, ``[1, L, dim]``.
        nbytes: Bytes held by the caches, hiddens and head states.
        head: The MTP head's batch-of-one caches after the pairs
            ``(hidden[0, j], tokens[j + 1])``, ``j < L - 1`` (never written).
        head_session: The C++ head's session after the same pairs, where
            the engine has the C++ head (rows start from copies of it).
    """

    tokens: tuple[int, ...]
    caches: list
    hidden: mx.array
    nbytes: int
    head: list | None = None
    head_session: object | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def continues(self, ids: list[int]) -> bool:
        """Whether a prompt starts with this prefix and goes on past it (a
        row prefills at least one token of its own)."""
        n = len(self.tokens)
        return len(ids) > n and tuple(ids[:n]) == self.tokens


def build_prefix(engine, ids: list[int]) -> PrefixState:
    """The `PrefixState` of ``ids`` (`MTPEngine.prefill_prefix`): prefilled
    on fresh trunk caches, then the heads' states after its pairs."""
    caches = make_main_cache(engine.model)
    hidden, _ = engine.prefill(ids, caches, keep_hidden=True)
    mx.eval([c.state for c in caches])
    head = head_prefill(engine.checkpoint.head, engine.text.model.embed_tokens, hidden, ids[1:],
                        engine.prefill_step_size)
    mx.eval([c.state for c in head])  # held for many rows: computed once, here
    cpp = engine.drafters.cpp
    session = cpp.session() if cpp is not None and len(ids) > 1 else None
    if session is not None:
        session.logits(hidden, ids[1:])  # the C++ head consumes the same pairs
    nbytes = cache_bytes(caches + head) + hidden.nbytes + (session.nbytes if session is not None else 0)
    return PrefixState(tuple(ids), caches, hidden, nbytes, head, session)


def copy_caches(caches: list) -> list:
    """New cache objects holding the same states, for a row to prefill on:
    writes to the copies never reach the originals (attention caches get
    their own arrays, recurrent caches their own lists)."""
    out = []
    for c in caches:
        if isinstance(c, StateCaptureCache):
            n = StateCaptureCache(len(c.cache))
            n.cache = list(c.cache)
            n.left_padding, n.lengths = c.left_padding, c.lengths
        elif isinstance(c, KVCache):
            n = type(c)()
            if c.keys is not None:
                n.keys, n.values = mx.array(c.keys[..., : c.offset, :]), mx.array(c.values[..., : c.offset, :])
            n.offset = c.offset
        else:
            raise TypeError(f"cannot copy a cache of type {type(c).__name__}")
        out.append(n)
    return out


def cache_bytes(caches: list) -> int:
    total = 0
    for c in caches:
        arrays = c.cache if isinstance(c, StateCaptureCache) else [c.keys, c.values]
        total += sum(a.nbytes for a in arrays if a is not None)
    return total
