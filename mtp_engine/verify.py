"""Verify, accept, commit: the half of a speculative step after drafting.

Glossary (one meaning per word, everywhere): a *verify forward* is one trunk
forward over ``[x, d_1..d_K]`` for each drafted path; its greedy *targets*
``g_0..g_K`` are what plain decoding would emit; a draft is *accepted* while
``d_j == g_{j-1}``; the *bonus token* ``g_n`` follows the ``n`` accepted
drafts; the step *emits* ``d_1..d_n, g_n`` and *commits* those ``n + 1``
inputs to the caches (attention caches trim the rest, recurrent caches take
the state captured after input ``n``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mtp_engine.cache.capture import StateCaptureCache
from mtp_engine.cache.ops import (
    commit_by_replay,
    commit_tree_row,
    commit_verified_prefix,
    snapshot,
    tile_caches,
)


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of one verify forward.

    Attributes:
        row: Winning row (path index).
        accepted: Drafts accepted on that row (n).
        emitted: ``d_1..d_n`` and the bonus token.
        hidden: The verify forward's trunk hiddens, every row, ``[P, K+1, dim]``;
            positions ``0..n`` of ``row`` are the committed ones.
        logits: That row's logits at positions ``0..n``, ``[n+1, vocab]`` (lazy).
        paths: The drafted paths that were verified, as token lists.
    """

    row: int
    accepted: int
    emitted: list[int]
    hidden: mx.array
    logits: mx.array
    paths: list[list[int]]


def greedy_tokens(logits: mx.array) -> mx.array:
    """Greedy choice as mlx-lm's ``generate_step`` makes it (argmax of the
    log-probabilities), so rounding ties resolve identically."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


def accepted_prefix(draft: list[int], targets: list[int]) -> int:
    """Length of the longest prefix with ``draft[j] == targets[j]``."""
    n = 0
    for d, g in zip(draft, targets):
        if d != g:
            break
        n += 1
    return n


def top_logits(logits: mx.array, k: int = 4) -> list[list[tuple[int, float]]]:
    """The ``k`` highest ``(token, logit)`` pairs of each row of ``[n, vocab]``
    logits, best first (float32 values)."""
    order = mx.argsort(-logits.astype(mx.float32), axis=-1)[:, :k]
    values = mx.take_along_axis(logits, order, axis=-1).astype(mx.float32)
    return [list(zip(t, v)) for t, v in zip(order.tolist(), values.tolist())]


def verify(
    trunk, lm_head, caches: list, x: int, paths: list[list[int]] | mx.array, capture: bool = True
) -> VerifyOutcome:
    """One trunk forward over ``[x, path]`` for every path; commit the
    winning row's accepted prefix.

    Args:
        trunk: The trunk (``model.model``): inputs to final-normed hiddens.
        lm_head: Hiddens to logits.
        caches: The trunk's caches (batch 1; tiled here for several paths).
        x: The last committed token, not yet fed to the trunk.
        paths: Equal-length token lists, or the drafts as a lazy ``[P, K]``
            int32 array (read back here, with the targets).
        capture: Commit from captured per-token states (else snapshot
            before and replay the accepted inputs after).
    """
    drafts = paths if isinstance(paths, mx.array) else mx.array(paths, dtype=mx.int32)
    n_paths, width = drafts.shape[0], drafts.shape[1] + 1
    snaps = None if capture else snapshot(caches)
    if n_paths > 1:
        tile_caches(caches, n_paths)
    if capture:
        for c in caches:
            if isinstance(c, StateCaptureCache):
                c.begin_capture()
    inputs = mx.concatenate([mx.full((n_paths, 1), x, dtype=mx.int32), drafts], axis=1)  # [P, K+1]
    hidden = trunk(inputs, cache=caches)  # [P, K+1, dim]
    logits = lm_head(hidden)  # [P, K+1, vocab]
    # Drafts and targets in one read: [P][K] and [P][K+1].
    rows = mx.concatenate([drafts, greedy_tokens(logits).astype(mx.int32)], axis=1).tolist()
    paths = [r[: width - 1] for r in rows]
    targets = [r[width - 1 :] for r in rows]

    best_row, best_n = 0, -1
    for r, (path, g) in enumerate(zip(paths, targets)):
        n = accepted_prefix(path, g)
        if n > best_n:  # ties: the lower row, the likelier first token
            best_row, best_n = r, n
    path, g = paths[best_row], targets[best_row]
    emitted = path[:best_n] + [g[best_n]]
    keep = best_n + 1

    if n_paths > 1:
        committed = commit_tree_row(caches, width, keep, best_row)
    else:
        committed = commit_verified_prefix(caches, width, keep)
    if not committed:
        commit_by_replay(trunk, caches, snaps, mx.array([[x] + path[:best_n]]))
        mx.eval([c.state for c in caches])
    return VerifyOutcome(best_row, best_n, emitted, hidden, logits[best_row, :keep], paths)
