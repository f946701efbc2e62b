"""Verify, accept, commit: the half of a speculative step after drafting.

Glossary (one meaning per word, everywhere): a *verify forward* is one trunk
forward over ``[x, d_1..d_K]`` for each drafted path; its *targets*
``g_0..g_K`` are what plain decoding would emit there (the greedy token, or
the exact sampler's choice at that position); a draft is *accepted* while
``d_j == g_{j-1}``; the *bonus token* ``g_n`` follows the ``n`` accepted
drafts; the step *emits* ``d_1..d_n, g_n`` and *commits* those ``n + 1``
inputs to the caches (attention caches trim the rest, recurrent caches take
the state captured after input ``n``). Under the rejection sampler a draft is
accepted with probability ``min(1, p/q)`` instead, and the token after the
accepted drafts is a residual sample (or the bonus token when all are
accepted); see `mtp_engine.sampling`.
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
from mtp_engine.sampling import (
    ACCEPT,
    RESIDUAL,
    SamplingParams,
    choose,
    gumbel,
    scaled_logprobs,
    uniforms,
)


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of one verify forward.

    Attributes:
        row: Winning row (path index).
        accepted: Drafts accepted on that row (n).
        emitted: ``d_1..d_n`` and the bonus (or residual) token.
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


def positions_of(starts: list[int], width: int) -> mx.array:
    """``[R, width]`` generated positions: row ``r`` from ``starts[r]``."""
    return mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)[None]


def decisions(drafts: mx.array, logits: mx.array, params: list[SamplingParams], starts: list[int],
              q_scaled: mx.array | None = None) -> mx.array:
    """What the host needs to decide each row's acceptance, as one lazy
    ``[R, ...]`` int32 array (read back with a single sync).

    Args:
        drafts: ``[R, K]`` drafted tokens.
        logits: The verify forward's ``[R, K+1, V]`` logits.
        params: Each row's sampling.
        starts: Each row's generated position of verify column 0.
        q_scaled: Rejection sampler: the head's ``[R, K, V]`` filtered,
            temperature-scaled log-probabilities at each draft.

    Returns:
        Target acceptance: ``[drafts (K) | targets (K+1)]``. Rejection:
        ``[drafts (K) | accepted flags (K) | residual samples (K) | targets
        (K+1)]``, a target (a sample of ``p``) at every column, so a row
        may use fewer drafts than ``K`` (`decide`) with the tokens a
        ``K``-draft step of its own would give.
    """
    R, K = drafts.shape
    positions = positions_of(starts, K + 1)
    if q_scaled is None:
        return mx.concatenate([drafts, choose(logits, params, positions)], axis=1)
    seeds = [p.seed for p in params]
    p = mx.softmax(scaled_logprobs(logits, params), axis=-1)  # [R, K+1, V]
    q = mx.softmax(q_scaled, axis=-1)  # [R, K, V]
    index = drafts[..., None].astype(mx.int32)
    pd = mx.take_along_axis(p[:, :K], index, axis=-1)[..., 0]
    qd = mx.take_along_axis(q, index, axis=-1)[..., 0]
    u = uniforms(seeds, positions[:, :K], 1, ACCEPT)[..., 0]
    accepted = (u * qd < pd).astype(mx.int32)  # u < min(1, p/q)
    residual = mx.maximum(p[:, :K] - q, 0)
    residual_pick = mx.argmax(mx.log(residual) + gumbel(seeds, positions[:, :K], logits.shape[-1], RESIDUAL), axis=-1)
    targets = choose(logits, params, positions)  # the bonus token wherever the drafts stop
    return mx.concatenate([drafts, accepted, residual_pick.astype(mx.int32), targets], axis=1)


def decide(values: list[int], k: int, rejection: bool, use: int | None = None) -> tuple[int, list[int]]:
    """One row's accepted count and emitted tokens from its `decisions` row
    of ``k`` drafts, using only the first ``use`` of them (default all)."""
    use = k if use is None else use
    draft = values[:use]
    if not rejection:
        targets = values[k:]
        n = accepted_prefix(draft, targets)
        return n, draft[:n] + [targets[n]]
    accepted, residual, targets = values[k : k + use], values[2 * k : 3 * k], values[3 * k :]
    n = next((j for j, a in enumerate(accepted) if not a), use)
    return n, draft[:n] + [residual[n] if n < use else targets[n]]


def verify(
    trunk, lm_head, caches: list, x: int, paths: list[list[int]] | mx.array, capture: bool = True,
    sampling: SamplingParams | None = None, start: int = 0, q_scaled: mx.array | None = None,
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
        sampling: How targets are chosen (default greedy).
        start: The generated position of the token ``x`` precedes (the
            first the forward predicts).
        q_scaled: Rejection sampler: the head's ``[1, K, V]`` scaled
            log-probabilities at the drafts (chains only).
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
    params = [sampling or SamplingParams()] * n_paths
    rejection = q_scaled is not None
    rows = decisions(drafts.astype(mx.int32), logits, params, [start] * n_paths, q_scaled).tolist()

    best_row, best_n, emitted = 0, -1, []
    for r, values in enumerate(rows):
        n, out = decide(values, width - 1, rejection)
        if n > best_n:  # ties: the lower row, the likelier first token
            best_row, best_n, emitted = r, n, out
    paths = [values[: width - 1] for values in rows]
    keep = best_n + 1

    if n_paths > 1:
        committed = commit_tree_row(caches, width, keep, best_row)
    else:
        committed = commit_verified_prefix(caches, width, keep)
    if not committed:
        commit_by_replay(trunk, caches, snaps, mx.array([[x] + paths[best_row][:best_n]]))
        mx.eval([c.state for c in caches])
    return VerifyOutcome(best_row, best_n, emitted, hidden, logits[best_row, :keep], paths)
