"""Drafting with the MLX MTP head for the rows of a batch, in every mode.

The head keeps one `BatchKVCache` per layer for all rows and each row's
pending pairs (`mtp_engine.drafters.base`). A draft call first consumes every
row's pending pairs in one forward (right-padded to the longest; the padding
becomes holes), then drafts:

- chain: K tokens per row, one head forward per position over all rows, kept
  on the device (``mx.async_eval``): the drafts reach the host with the
  verify's targets in one sync. A constrained row's logits keep, at each
  position, what its grammar (`mtp_engine.constraints`) allows after the
  drafts before it, and the grammar follows the draft (one sync per
  position); the proposal carries the masks for the verify forward;
- adaptive: a chain that stops, per row, once the running product of its
  top-1 probabilities falls below ``tau`` (one sync per position);
- paths, tree, adaptive_tree: several paths per row. A row branches by
  taking the top-n choices at a position (greedy: likeliest; the exact
  sampler: by the targets' perturbed scores); from the first branch on the
  head drafts on a gathered copy of its cache with a row per path, so no path
  sees another's tokens and the committed cache stays untouched. Constrained
  rows mask every position as drafted, each path by its own fork of the row's
  grammar (`mtp_engine.constraints.PathGrammars`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.cache.batch import BatchKVCache, filter_rows
from mtp_engine.constraints import PathGrammars, constrain, masks_of
from mtp_engine.drafters.base import Proposal
from mtp_engine.drafters.compiled_head import CompiledHead
from mtp_engine.model.mtp_head import MTPHead
from mtp_engine.modes import CHAINS, SPECULATIVE_MODES, DecodeConfig
from mtp_engine.options import MAX_VERIFY_WIDTH
from mtp_engine.sampling import SamplingParams, choose, draft_choice, positions_of, ranked_rows


@dataclass
class _Pending:
    """Pending pairs of some consecutive rows: ``hidden[r, :counts[r]]``
    with ``tokens[r]``."""

    hidden: mx.array  # [rows, >= max(counts), dim]
    tokens: list[list[int]]
    counts: list[int]


def head_prefill(head: MTPHead, embed: nn.Module, hidden: mx.array, tokens: list[int], step: int,
                 start: list[BatchKVCache] | None = None) -> list[BatchKVCache]:
    """The head's batch-of-one caches after it consumed the pairs
    ``(hidden[0, j], tokens[j])``, ``step`` pairs a forward; ``start``: caches
    after the first of them (a `PrefixState`'s), copied and continued."""
    own = [c.take([0]) for c in start] if start is not None else [BatchKVCache(1) for _ in head.layers]
    done = own[0].positions[0]
    if done > len(tokens):
        raise ValueError(f"a head state of {done} pairs for a prompt of {len(tokens)}")
    ids = mx.array(tokens[done:], dtype=mx.int32)[None]
    for s in range(done, len(tokens), step):
        e = min(s + step, len(tokens))
        head(hidden[:, s:e], embed(ids[:, s - done : e - done]), own)
        if e < len(tokens):  # a long prompt's chunk; the last is evaluated with the next draft (no sync here)
            mx.eval([c.state for c in own])
    return own


class HeadDrafter:
    """The MLX head drafting for rows (the `mtp_engine.drafters.base.Drafter` interface).

    Args:
        head: The `MTPHead`; embed: the trunk's embedding; lm_head: hiddens
            to logits (the trunk's LM head, tied or not).
        prefill_step_size: Pairs per forward of a joining row's head prefill.
        compiled: The head's `CompiledHead` (draft forwards in compiled
            pieces), or None for eager forwards.
    """

    modes = frozenset(SPECULATIVE_MODES)

    def __init__(self, head: MTPHead, embed: nn.Module, lm_head, prefill_step_size: int = 2048,
                 compiled: CompiledHead | None = None):
        self.name = "mlx" if compiled is not None else "mlx-eager"
        self.head = head
        self.embed = embed
        self.lm_head = lm_head
        self.prefill_step_size = prefill_step_size
        self.compiled = compiled
        self._greedy = mx.compile(lambda m: mx.argmax(lm_head(m), axis=-1).astype(mx.int32))
        self.cache = [BatchKVCache() for _ in head.layers]
        self.pending: list[_Pending] = []
        self._more: list[tuple[mx.array, list[list[int]]]] = []  # plain steps' pairs, not merged yet
        self._base: tuple[int, list[int]] | None = None

    @property
    def rows(self) -> int:
        return self.cache[0].batch_size

    # -- rows joining and leaving -------------------------------------------

    def add_row(self, slot: int | None, prompt_hidden: mx.array, tokens: list[int], key=None, prefix=None) -> None:
        """The head consumes the joining row's prompt pairs but the last, which
        stays pending; those a `PrefixState` ``prefix`` covers come from a copy
        of its head caches."""
        self._merge()
        n = len(tokens) - 1
        own = head_prefill(self.head, self.embed, prompt_hidden, tokens[:n], self.prefill_step_size,
                           prefix.head if prefix is not None else None)
        last = prompt_hidden[:, n : n + 1]
        if slot is None:
            for c, o in zip(self.cache, own):
                c.add_row(o.keys, o.values, o.idx)
            self.pending.append(_Pending(last, [tokens[n:]], [1]))
            return
        for c, o in zip(self.cache, own):
            c.replace_row(slot, o.keys, o.values, o.idx)
        hidden, pending, counts = self._gather_pending()
        hidden[slot : slot + 1, :1] = last.astype(hidden.dtype)
        pending[slot], counts[slot] = tokens[n:], 1
        self.pending = [_Pending(hidden, pending, counts)]

    def filter(self, rows: list[int]) -> None:
        filter_rows(self.cache, rows)  # every layer trimmed with one read-back
        hidden, tokens, counts = self._gather_pending()
        index = mx.array(rows, dtype=mx.int32)
        self.pending = [_Pending(hidden[index], [tokens[r] for r in rows], [counts[r] for r in rows])] if rows else []

    def extend(self, hidden: mx.array, tokens: list[list[int]]) -> None:
        """The plain step's pairs are kept apart until the pending pairs are next read (`_merge`)."""
        self._more.append((hidden[:, :1], [t[:1] for t in tokens]))

    def _merge(self) -> None:
        """Fold the plain steps' pairs into the pending block (one gather)."""
        if not self._more:
            return
        more, self._more = self._more, []
        old, pending, counts = self._gather_pending()
        width = old.shape[1]
        picks = [[width + i for i, (_, t) in enumerate(more) if t[r]] for r in range(len(counts))]
        total = [c + len(p) for c, p in zip(counts, picks)]
        index = [list(range(c)) + p + [0] * (max(total) - n) for c, p, n in zip(counts, picks, total)]
        both = mx.concatenate([old] + [h.astype(old.dtype) for h, _ in more], axis=1)
        self.pending = [_Pending(mx.take_along_axis(both, mx.array(index, dtype=mx.int32)[..., None], axis=1),
                                 [p + [x for _, t in more for x in t[r]] for r, p in enumerate(pending)], total)]

    def _gather_pending(self) -> tuple[mx.array, list[list[int]], list[int]]:
        """All rows' pending pairs as one right-padded block."""
        self._merge()
        width = max(max(p.counts) for p in self.pending)
        blocks = []
        for p in self.pending:
            h = p.hidden[:, :width]
            if h.shape[1] < width:
                h = mx.concatenate([h, mx.zeros((h.shape[0], width - h.shape[1], h.shape[2]), h.dtype)], axis=1)
            blocks.append(h)
        hidden = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)
        return hidden, [t for p in self.pending for t in p.tokens], [c for p in self.pending for c in p.counts]

    # -- forwards -----------------------------------------------------------

    def _forward(self, hidden: mx.array, ids: mx.array, cache: list) -> mx.array:
        """The head's final-normed hiddens over ``[B, L]`` pairs."""
        if self.compiled is not None and ids.shape[1] <= MAX_VERIFY_WIDTH:
            return self.compiled.hiddens(hidden, ids, cache)
        return self.head(hidden, self.embed(ids), cache)

    def _consume(self) -> mx.array:
        """Feed every row's pending pairs; return the head's hidden at each
        row's last pair, ``[R, 1, dim]``. What drafting writes from here on
        is rewound at commit."""
        hidden, tokens, counts = self._gather_pending()
        width = hidden.shape[1]
        ids = mx.array([t + [0] * (width - len(t)) for t in tokens], dtype=mx.int32)  # [R, width]
        m = self._forward(hidden, ids, self.cache)
        for c in self.cache:
            c.settle(counts, width)
        self._base = (self.cache[0].idx, list(self.cache[0].positions))
        if len(set(counts)) == 1 and counts[0] == width:
            return m[:, -1:]
        return m[mx.arange(len(counts)), mx.array(counts) - 1][:, None]

    # -- drafting -----------------------------------------------------------

    def propose(self, decode: DecodeConfig, k: int, params: list[SamplingParams], starts: list[int],
                caps: list[int], grammars: list | None = None) -> Proposal:
        if k < 1:
            raise ValueError(f"a draft needs k >= 1 tokens, got {k}")
        m = self._consume()
        mode = decode.mode
        if mode in CHAINS or (mode == "paths" and decode.paths == 1):
            return self._chain(m, k, params, starts, caps, grammars)
        paths = PathGrammars(grammars)
        if mode in ("adaptive", "adaptive_tree"):
            return self._adaptive(m, k, decode.tau, params, starts, caps, branch=mode == "adaptive_tree", paths=paths)
        if mode == "paths":
            return self._grow(m, k, params, starts, caps, lambda depth, label: decode.paths if depth == 0 else 1,
                              paths=paths)
        if mode == "tree":
            two = decode.tree_pos2 and k >= 2

            def tree(depth, label):  # A (top-1 throughout), B (runner-up at 1), C (runner-up at 2)
                return 2 if depth == 0 or (two and depth == 1 and label == (0,)) else 1
            return self._grow(m, k, params, starts, caps, tree, order=[0, 2, 1] if two else None, paths=paths)
        raise ValueError(f"mode {mode!r} does not draft")

    def _chain(self, m: mx.array, k: int, params, starts, caps, grammars: list | None = None) -> Proposal:
        """K drafts per row (module docstring); ``grammars`` holds each row's
        `mtp_engine.constraints.RowGrammar` or None (not masked)."""
        greedy = grammars is None and all(p.greedy for p in params)
        drafts, scaled, masks = [], [], []
        for depth in range(k):
            if depth:
                m = self._forward(m, drafts[-1], self.cache)
            if greedy:
                d, q = self._greedy(m[:, 0])[:, None], None
            else:
                logits = self.lm_head(m)  # [R, 1, V]
                if grammars is not None:
                    mx.async_eval(logits)  # the device computes while the host computes the masks
                    masks.append(masks_of(grammars))
                    logits = constrain(logits, masks[-1])
                d, q = draft_choice(logits, params, positions_of(starts, 1) + depth)
                if grammars is not None:  # each grammar follows its row's drafts
                    for g, (t,), cap in zip(grammars, d.tolist(), caps):
                        if g is not None and depth < cap:
                            g.draft(t)
                        elif g is not None:  # past the row's budget: its drafts are not verified
                            g.ended = True
            mx.async_eval(d)  # the device drafts while the caller builds the verify forward
            drafts.append(d)
            scaled.append(q)
        if grammars is not None:
            masks.append(masks_of(grammars))  # the bonus position, after every draft
        q_scaled = mx.concatenate(scaled, axis=1) if scaled[0] is not None else None  # [R, k, V]
        return Proposal(mx.concatenate(drafts, axis=1), uses=caps, q_scaled=q_scaled,
                        masks=mx.concatenate(masks, axis=1) if masks else None)

    def _top1(self, logits: mx.array, params, positions: list[int]) -> tuple[list[int], list[float]]:
        """Each row's draft and its (unscaled) probability, one sync."""
        tokens = choose(logits[:, None], params, mx.array(positions, dtype=mx.int32)[:, None])[:, 0]
        probs = mx.exp(mx.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - mx.logsumexp(logits, axis=-1))
        mx.eval(tokens, probs)
        return tokens.tolist(), probs.tolist()

    def _adaptive(self, m: mx.array, k: int, tau: float, params, starts, caps, branch: bool = False, *,
                  paths: PathGrammars) -> Proposal:
        """Per row, a chain that stops once the running product of its top-1
        probabilities falls below ``tau``; with ``branch``, rows whose chain
        is at least 2 deep add a path from the runner-up at position 1,
        continued as deep (adaptive_tree). ``paths`` masks every position; a
        runner-up its grammar does not allow falls back to the top choice."""
        n = 2 if branch else 1  # paths a row drafts; its first sets the depth, the second follows it
        logits = paths.constrain(self.lm_head(m[:, 0]))
        cache = self.cache
        if branch:
            firsts = ranked_rows(logits, params, starts, 2)  # [R, 2]
            probs = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1)).tolist()
            cache = [c.take([r for r in range(len(params)) for _ in (0, 1)]) for c in self.cache]
            m = mx.repeat(m, 2, axis=0)
            paths.take([r for r in range(len(params)) for _ in (0, 1)])
        else:
            first, probs = self._top1(logits, params, starts)
            firsts = [[t] for t in first]
        first = paths.advance([t for f in firsts for t in f],
                              fallback=[f[0] for f in firsts for _ in f] if branch else None)
        drafts = [[t] for t in first]  # row b's paths are b * n .. b * n + n - 1
        last = mx.array(first, dtype=mx.int32)
        confidence = list(probs)
        active = [1 < min(k, cap) and p >= tau for cap, p in zip(caps, confidence)]
        depth = 1
        while any(active):
            m = self._forward(m, last[:, None], cache)
            tokens, probs = self._top1(paths.constrain(self.lm_head(m[:, 0])), [p for p in params for _ in range(n)],
                                       [s + depth for s in starts for _ in range(n)])
            paths.advance(tokens, moving=[a for a in active for _ in range(n)])
            for b in range(len(params)):
                if active[b]:
                    for j in range(b * n, b * n + n):
                        drafts[j].append(tokens[j])
                    confidence[b] *= probs[b * n]
                    active[b] = len(drafts[b * n]) < min(k, caps[b]) and confidence[b] >= tau
            last = mx.array(tokens, dtype=mx.int32)
            depth += 1
        kept = [j for j, p in enumerate(drafts) if j % n == 0 or len(p) >= 2]
        return Proposal.padded([drafts[j] for j in kept], caps, [j // n for j in kept] if branch else None,
                               masks=paths.masks(kept if branch else None))

    def _grow(self, m: mx.array, k: int, params, starts, caps, branches, order: list[int] | None = None, *,
              paths: PathGrammars) -> Proposal:
        """Paths grown position by position: at each, a path with label
        (its choice ranks so far) takes the top ``branches(depth, label)``
        choices (a rank below the tokens its grammar in ``paths`` allows
        takes the top one); ``order`` reorders each row's paths at the end."""
        rows = len(params)
        logits = self.lm_head(m[:, 0])  # [P, V], P paths (one per row to start)
        labels, owners = [() for _ in range(rows)], list(range(rows))
        tokens: list[list[int]] = [[] for _ in range(rows)]
        cache, last = self.cache, None
        for depth in range(k):
            if depth:
                m = self._forward(m, last[:, None], cache)
                logits = self.lm_head(m[:, 0])
            logits = paths.constrain(logits)
            counts = [branches(depth, label) for label in labels]
            pos = [starts[o] + depth for o in owners]
            pparams = [params[o] for o in owners]
            if max(counts) == 1:
                chosen = choose(logits[:, None], pparams, mx.array(pos, dtype=mx.int32)[:, None])[:, 0]
                if depth + 1 < k:
                    mx.async_eval(chosen)
                picked = paths.advance(chosen.tolist()) if paths.on else [(chosen, p) for p in range(len(tokens))]
                tokens = [t + [c] for t, c in zip(tokens, picked)]  # unconstrained: read at the end
                last = chosen
                continue
            ranks = ranked_rows(logits, pparams, pos, max(counts))
            index, new_labels, new_owners, new_tokens = [], [], [], []
            for p, n in enumerate(counts):
                for j in range(n):
                    index.append(p)
                    new_labels.append(labels[p] + (j,))
                    new_owners.append(owners[p])
                    new_tokens.append(tokens[p] + [ranks[p][j]])
            if len(index) != len(labels):
                cache = [c.take(index) for c in cache]
                m = m[mx.array(index, dtype=mx.int32)]
            paths.take(index)
            new_tokens = [t[:-1] + [c] for t, c in zip(new_tokens, paths.advance(
                [t[-1] for t in new_tokens], fallback=[ranks[p][0] for p in index]))]
            labels, owners, tokens = new_labels, new_owners, new_tokens
            last = mx.array([t[-1] for t in tokens], dtype=mx.int32)
        tokens = _resolve(tokens)
        picks = range(len(tokens)) if order is None else [b * len(order) + j for b in range(rows) for j in order]
        tokens, owners = [tokens[i] for i in picks], [owners[i] for i in picks]
        return Proposal(mx.array(tokens, dtype=mx.int32), owners=owners, uses=[min(k, caps[o]) for o in owners],
                        masks=paths.masks(None if order is None else picks))

    def commit(self, hidden: mx.array, emitted: list[list[int]], winners: list[int]) -> None:
        if self._base is not None:
            for c in self.cache:
                c.rewind(*self._base)
        if hidden.shape[0] != len(winners) or winners != list(range(len(winners))):
            hidden = hidden[mx.array(winners, dtype=mx.int32)]
        self.pending = [_Pending(hidden, [list(e) for e in emitted], [len(e) for e in emitted])]


def _resolve(tokens: list[list]) -> list[list[int]]:
    """Token lists whose entries may be ``(lazy array, index)``, read in one sync."""
    arrays = {id(e[0]): e[0] for t in tokens for e in t if isinstance(e, tuple)}
    mx.eval(list(arrays.values()))
    values = {k: a.tolist() for k, a in arrays.items()}
    return [[values[id(e[0])][e[1]] if isinstance(e, tuple) else e for e in t] for t in tokens]
