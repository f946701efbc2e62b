"""Drafting with the MLX MTP head, in every mode.

The drafter owns nothing between generations: each generation gets an
`MTPDraftState` (the head's KV caches plus the pending pairs, see
`mtp_engine.drafters.base`).

Forks (trees, paths) restart the head's cache from the fork point by
trimming it back to that offset: its KV entries before the fork are never
written again, so no branch sees another branch's tokens.

Chain drafts stay on the device: each step's greedy token feeds the next
step as an array and its evaluation starts at once (``mx.async_eval``), so
the host builds the next step, and the verify forward, while the device
computes, and the drafted tokens reach the host with the verify forward's
targets in one sync (faster on the CPU and on a GPU than a sync per step,
or one lazy graph for the whole chain: docs/BENCHMARKS.md). Modes that
branch on a draft step's result (adaptive, trees, paths) read each step
back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mtp_engine.drafters.compiled_head import (
    CompiledHead,
    last_draft,
)
from mtp_engine.model.mtp_head import MTPHead
from mtp_engine.modes import SPECULATIVE_MODES
from mtp_engine.options import MAX_VERIFY_WIDTH
from mtp_engine.sampling import (
    DRAFT,
    GREEDY,
    TARGET,
    SamplingParams,
    choose,
    gumbel,
    ranked,
    scaled_logprobs,
)


@dataclass
class MTPDraftState:
    """The head's state during one generation.

    Attributes:
        cache: One KV cache per MTP layer.
        pending_hidden: Hiddens of the pairs not consumed yet, ``[1, m, dim]``.
        pending_tokens: Tokens of those pairs (``t_{i+1}`` for ``H_i``).
        base: Cache offset after the pending pairs are consumed; entries
            below it are true (committed) ones, above it drafted ones.
        sampling: How drafts are chosen: greedy, the exact sampler's
            choice (the targets' noise at the same position) or a sample of
            the head's distribution (rejection sampler).
        position: The generated position the next draft call's first
            draft proposes (set by the engine before each draft).
        q_scaled: Rejection sampler: the head's scaled log-probabilities at
            each draft of the last chain, ``[1, V]`` each.
    """

    cache: list[KVCache]
    pending_hidden: mx.array | None = None
    pending_tokens: list[int] = field(default_factory=list)
    base: int = 0
    sampling: SamplingParams = GREEDY
    position: int = 0
    q_scaled: list[mx.array] = field(default_factory=list)

    @property
    def offset(self) -> int:
        return self.cache[0].offset


class MLXDrafter:
    """Greedy drafting with an MTP head sharing the trunk's embedding and LM
    head, run as MLX ops (the `Drafter` interface, every mode).

    Args:
        head: The `MTPHead`.
        embed: The trunk's token embedding.
        lm_head: Maps hiddens to logits (the trunk's LM head).
        prefill_step_size: Pending pairs consumed per forward at most, so a
            long prompt's MTP prefill is chunked like the trunk's.
        compiled: Run draft forwards of up to `MAX_VERIFY_WIDTH` pairs
            through a `CompiledHead` (the head's weights as they are now).
    """

    modes = frozenset(SPECULATIVE_MODES)

    def __init__(
        self,
        head: MTPHead,
        embed: nn.Module,
        lm_head,
        prefill_step_size: int = 2048,
        compiled: bool = False,
    ):
        self.name = "mlx" if compiled else "mlx-eager"
        self.head = head
        self.embed = embed
        self.lm_head = lm_head
        self.prefill_step_size = prefill_step_size
        self.compiled = CompiledHead(head, embed, lm_head) if compiled else None

    def new_state(self) -> MTPDraftState:
        return MTPDraftState(cache=self.head.make_cache())

    # -- cache bookkeeping -------------------------------------------------

    def set_pending(self, state: MTPDraftState, hidden: mx.array, tokens: list[int], row: int = 0) -> None:
        """Queue pairs ``(hidden[row, j], tokens[j])`` for the next forward
        (``hidden`` ``[rows, >= len(tokens), dim]``; its first positions)."""
        if hidden.shape[1] < len(tokens):
            raise ValueError(f"{hidden.shape[1]} hiddens for {len(tokens)} tokens")
        state.pending_hidden = hidden[row : row + 1, : len(tokens)]
        state.pending_tokens = list(tokens)

    def commit(self, state: MTPDraftState, hidden: mx.array, tokens: list[int], row: int = 0) -> None:
        """Drop drafted entries and queue the accepted pairs.

        Args:
            hidden: The trunk's hiddens of the verify forward, ``[P, K+1, dim]``;
                positions ``0..n`` of ``row`` (inputs ``x, d_1..d_n``) pair
                with ``tokens``.
            tokens: The tokens those positions predicted: ``d_1..d_n`` and
                the bonus token, i.e. what the step emitted.
            row: The verified row (path) that won.
        """
        self.rewind(state, state.base)
        self.set_pending(state, hidden, tokens, row)

    def rewind(self, state: MTPDraftState, offset: int) -> None:
        """Trim the head's caches back to ``offset`` entries."""
        for c in state.cache:
            c.trim(c.offset - offset)

    # -- forwards ----------------------------------------------------------

    def _forward(self, state: MTPDraftState, hidden: mx.array, tokens: mx.array):
        """Logits ``[vocab]``, hidden ``M`` ``[1, 1, dim]`` and greedy token
        ``[1, 1]`` int32 of the last of the pairs (lazy)."""
        if self.compiled is not None and tokens.shape[1] <= MAX_VERIFY_WIDTH:
            return self.compiled(hidden, tokens, state.cache)
        return last_draft(self.head(hidden, self.embed(tokens), state.cache), self.lm_head)

    def first_step(self, state: MTPDraftState):
        """Consume the pending pairs; return logits and hidden of the last one."""
        return self._forward_pending(state)[:2]

    @staticmethod
    def pending(state: MTPDraftState) -> tuple[mx.array, list[int]]:
        """The pending pairs' hiddens and tokens; a RuntimeError when none
        are queued."""
        if state.pending_hidden is None or not state.pending_tokens:
            raise RuntimeError("drafting needs pending pairs (set_pending/commit)")
        return state.pending_hidden, state.pending_tokens

    def _forward_pending(self, state: MTPDraftState):
        """`first_step` with the greedy token as a third, lazy output."""
        hidden, tokens = self.pending(state)
        ids = mx.array(tokens)[None]
        total = len(tokens)
        start = 0
        while total - start > self.prefill_step_size:
            end = start + self.prefill_step_size
            self.head(hidden[:, start:end], self.embed(ids[:, start:end]), state.cache)
            mx.eval([c.state for c in state.cache])
            start = end
        out = self._forward(state, hidden[:, start:], ids[:, start:])
        state.pending_hidden, state.pending_tokens = None, []
        state.base = state.offset
        return out

    def step(self, state: MTPDraftState, hidden: mx.array, token: int):
        """One draft step from ``(hidden, token)``; returns logits and ``M``."""
        return self._forward(state, hidden, mx.array([[token]]))[:2]

    def _choose(self, state: MTPDraftState, logits: mx.array, greedy: mx.array, depth: int) -> mx.array:
        """The draft at ``depth`` of the current call from the head's logits
        ``[V]``: ``greedy`` ``[1, 1]``, or the sampler's choice."""
        s = state.sampling
        if s.greedy:
            return greedy
        position = mx.array([[state.position + depth]], dtype=mx.int32)
        if s.sampler == "rejection":
            scaled = scaled_logprobs(logits[None, None], [s])[0]  # [1, V]
            state.q_scaled.append(scaled)
            noise = gumbel([s.seed], position, logits.shape[-1], DRAFT)[0]
            return mx.argmax(scaled + noise, axis=-1).astype(mx.int32).reshape(1, 1)
        return choose(logits[None, None], [s], position, TARGET)

    def _continue(self, state: MTPDraftState, hidden: mx.array, token: int, n: int, depth: int) -> list[int]:
        """Extend a path ending in ``token`` (made with ``hidden``, the draft
        at ``depth - 1``) by n drafts."""
        out = []
        for i in range(n):
            logits, hidden, greedy = self._forward(state, hidden, mx.array([[token]]))
            token = self._choose(state, logits, greedy, depth + i).item()
            out.append(token)
        return out

    def _top1(self, state: MTPDraftState, logits: mx.array, depth: int) -> tuple[int, float]:
        """The draft at ``depth`` and its softmax probability, one host sync."""
        if state.sampling.greedy:
            return _top1(logits)
        token = self._choose(state, logits, None, depth).reshape(())
        prob = mx.exp(logits[token] - mx.logsumexp(logits))
        mx.eval(token, prob)
        return int(token), float(prob)

    def _ranked(self, state: MTPDraftState, logits: mx.array, depth: int, k: int) -> list[int]:
        """The ``k`` best drafts at ``depth`` (greedy: likeliest first; the
        exact sampler: by the targets' perturbed scores)."""
        return ranked(logits, state.sampling, state.position + depth, min(k, logits.shape[-1]))

    # -- strategies ----------------------------------------------------------

    def draft(self, state: MTPDraftState, k: int) -> mx.array:
        """K greedy draft tokens (a chain), ``[1, k]`` int32, not read back:
        the verify forward takes them as they are."""
        if k < 1:
            raise ValueError(f"a chain draft needs k >= 1 tokens, got {k}")
        state.q_scaled = []
        logits, m, d = self._forward_pending(state)
        d = self._choose(state, logits, d, 0)
        tokens = [d]
        for depth in range(1, k):
            mx.async_eval(d)  # start each step at once (module docstring)
            logits, m, d = self._forward(state, m, d)
            d = self._choose(state, logits, d, depth)
            tokens.append(d)
        mx.async_eval(d)
        return mx.concatenate(tokens, axis=1)

    def draft_adaptive(self, state: MTPDraftState, depth_max: int, tau: float) -> list[int]:
        """Greedy chain that stops once the running product of top-1
        probabilities falls below ``tau``; 1..depth_max tokens."""
        logits, m = self.first_step(state)
        d, p = self._top1(state, logits, 0)
        chain, confidence = [d], p
        while len(chain) < depth_max and confidence >= tau:
            logits, m = self.step(state, m, d)
            d, p = self._top1(state, logits, len(chain))
            chain.append(d)
            confidence *= p
        return chain

    def draft_tree(self, state: MTPDraftState, k: int, pos2: bool = True) -> list[list[int]]:
        """Minimal tree: chain A (all top-1), B (runner-up at draft position 1)
        and, if ``pos2`` and k >= 2, C (runner-up at position 2). Each k long."""
        logits, m1 = self.first_step(state)
        d1a, d1b = self._ranked(state, logits, 0, 2)
        fork1 = state.offset
        paths = []
        if pos2 and k >= 2:
            logits2, m2 = self.step(state, m1, d1a)
            d2a, d2c = self._ranked(state, logits2, 1, 2)
            fork2 = state.offset
            paths.append([d1a, d2a] + self._continue(state, m2, d2a, k - 2, 2))
            self.rewind(state, fork2)
            chain_c = [d1a, d2c] + self._continue(state, m2, d2c, k - 2, 2)
        else:
            paths.append([d1a] + self._continue(state, m1, d1a, k - 1, 1))
            chain_c = None
        self.rewind(state, fork1)
        paths.append([d1b] + self._continue(state, m1, d1b, k - 1, 1))
        if chain_c is not None:
            paths.append(chain_c)
        return paths

    def draft_adaptive_tree(self, state: MTPDraftState, depth_max: int, tau: float) -> list[list[int]]:
        """Adaptive chain A plus, when it is at least 2 deep, a branch B from
        the runner-up at position 1, continued to the same depth."""
        logits, m1 = self.first_step(state)
        (d1a, d1b), p = self._ranked(state, logits, 0, 2), _top_prob(logits)
        fork1 = state.offset
        chain, confidence = [d1a], p
        m, d = m1, d1a
        while len(chain) < depth_max and confidence >= tau:
            logits, m = self.step(state, m, d)
            d, pd = self._top1(state, logits, len(chain))
            chain.append(d)
            confidence *= pd
        if len(chain) < 2:
            return [chain]
        self.rewind(state, fork1)
        return [chain, [d1b] + self._continue(state, m1, d1b, len(chain) - 1, 1)]

    def draft_paths(self, state: MTPDraftState, k: int, p: int) -> list[list[int]]:
        """Top-``p`` first tokens, each continued greedily to ``k`` tokens."""
        logits, m1 = self.first_step(state)
        firsts = self._ranked(state, logits, 0, p)
        fork1 = state.offset
        paths = []
        for j, first in enumerate(firsts):
            if j:
                self.rewind(state, fork1)
            paths.append([first] + self._continue(state, m1, first, k - 1, 1))
        return paths


def _top1(logits: mx.array) -> tuple[int, float]:
    """Greedy token and its softmax probability, one host sync."""
    top = mx.argmax(logits)
    prob = mx.exp(logits[top] - mx.logsumexp(logits))
    mx.eval(top, prob)
    return int(top), float(prob)


def _top_prob(logits: mx.array) -> float:
    """Softmax probability of the likeliest token."""
    return float(mx.exp(mx.max(logits) - mx.logsumexp(logits)))
