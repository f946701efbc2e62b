"""Verify, accept, commit: the half of a speculative step after drafting.

Glossary (one meaning per word, everywhere): a *verify forward* is one trunk
forward over ``[x, d_1..d_K]`` for every drafted path of every row; its
*targets* ``g_0..g_K`` are what plain decoding would emit there (the greedy
token, or the exact sampler's choice at that position); a draft is
*accepted* while ``d_j == g_{j-1}``; the *bonus token* ``g_n`` follows the
``n`` accepted drafts; the step *emits* ``d_1..d_n, g_n`` and *commits* those
``n + 1`` inputs to the row's caches (attention caches keep them, the rest
become holes; recurrent caches take the state captured after input ``n``). A
row with several paths keeps the one that accepted most (the first on a
tie). Under the rejection sampler a draft is accepted with probability
``min(1, p/q)`` instead, and the token after the accepted drafts is a
residual sample (or the bonus token when all are accepted); see
`mtp_engine.sampling`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mtp_engine.cache.batch import commit_rows, filter_rows
from mtp_engine.cache.capture import StateCaptureCache
from mtp_engine.constraints import constrain
from mtp_engine.drafters.base import Proposal
from mtp_engine.sampling import ACCEPT, RESIDUAL, SamplingParams, apply_penalties, choose, gumbel
from mtp_engine.sampling import positions_of, scaled_logprobs, uniforms


def decisions(drafts: mx.array, logits: mx.array, params: list[SamplingParams], starts: list[int],
              q_scaled: mx.array | None = None) -> mx.array:
    """What the host needs to decide each verify row's acceptance, as one
    lazy ``[V, ...]`` int32 array (read back with a single sync).

    Args:
        drafts: ``[V, K]`` drafted tokens.
        logits: The verify forward's ``[V, K+1, vocab]`` logits.
        params: Each verify row's sampling.
        starts: Each verify row's generated position of column 0.
        q_scaled: Rejection sampler: the head's ``[V, K, vocab]`` filtered,
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


def decide(values: list[int], k: int, rejection: bool, use: int) -> tuple[int, list[int]]:
    """One verify row's accepted count and emitted tokens from its
    `decisions` row of ``k`` drafts, using only the first ``use`` of them."""
    draft = values[:use]
    if not rejection:
        targets = values[k:]
        n = next((j for j in range(use) if draft[j] != targets[j]), use)
        return n, draft[:n] + [targets[n]]
    accepted, residual, targets = values[k : k + use], values[2 * k : 3 * k], values[3 * k :]
    n = next((j for j, a in enumerate(accepted) if not a), use)
    return n, draft[:n] + [residual[n] if n < use else targets[n]]


@dataclass
class Verified:
    """One verify forward's outcome.

    Attributes:
        emitted: What each row emits (its winning path's accepted drafts and
            the bonus or residual token).
        winners: Each row's winning verify row.
        paths: Each verify row's drafts (the ones it used) as token lists.
        accepted: Each verify row's accepted count.
        hidden: The forward's trunk hiddens, ``[V, K+1, dim]``.
        logits: The forward's logits, ``[V, K+1, vocab]`` (lazy).
    """

    emitted: list[list[int]]
    winners: list[int]
    paths: list[list[int]]
    accepted: list[int]
    hidden: mx.array
    logits: mx.array


def verify(trunk, lm_head, caches: list, xs: mx.array, proposal: Proposal, params: list[SamplingParams],
           starts: list[int], histories: list[list[int]] | None = None) -> Verified:
    """One trunk forward over every verify row's ``[x, drafts]``; commit each
    row's winning path to the caches.

    Args:
        trunk: The trunk (``model.model``): inputs to final-normed hiddens.
        lm_head: Hiddens to logits.
        caches: The batch's caches (`mtp_engine.cache.batch`), one row per
            row; a row with several paths is gathered into a row per path
            for the forward and back to its winner after it.
        xs: Each row's last emitted token, not yet fed, ``[R, 1]`` int32.
        proposal: The drafts.
        params: Each row's sampling.
        starts: Each row's generated position of the token ``x`` precedes.
        histories: Each row's generated tokens, for rows with penalties
            (`mtp_engine.sampling.apply_penalties`; each position also
            counts the drafts before it).
    """
    rows = xs.shape[0]
    owners = proposal.owners if proposal.owners is not None else list(range(rows))
    tiled = owners != list(range(rows))
    width = proposal.tokens.shape[1] + 1
    if tiled:
        filter_rows(caches, owners, trim=False)
        xs = xs[mx.array(owners, dtype=mx.int32)]
    inputs = mx.concatenate([xs, proposal.tokens.astype(mx.int32)], axis=1)  # [V, K+1]
    for c in caches:
        if isinstance(c, StateCaptureCache):
            c.begin_capture()
    hidden = trunk(inputs, cache=caches)  # [V, K+1, dim]
    logits = lm_head(hidden)
    vparams = [params[o] for o in owners]
    vstarts = [starts[o] for o in owners]
    if histories is not None:
        logits = apply_penalties(logits, vparams, [histories[o] for o in owners], inputs[:, 1:])
    logits = constrain(logits, proposal.masks)  # constrained rows: what their grammars allow
    rejecting = [proposal.q_scaled is not None and p.rejects for p in vparams]
    lazy = []
    if not all(rejecting):  # rows whose drafts match targets (greedy, exact sampler)
        lazy.append(decisions(inputs[:, 1:], logits, vparams, vstarts))
    if any(rejecting):
        lazy.append(decisions(inputs[:, 1:], logits, vparams, vstarts, proposal.q_scaled))
    mx.eval(*lazy)  # one sync for everything the host reads
    reads = [a.tolist() for a in lazy]
    accepted, outs, paths = [], [], []
    for v in range(len(owners)):
        use = width - 1 if proposal.uses is None else min(proposal.uses[v], width - 1)
        values = reads[-1 if rejecting[v] else 0][v]  # both layouts start with the drafts
        n, out = decide(values, width - 1, rejecting[v], use)
        accepted.append(n)
        outs.append(out)
        paths.append(values[:use])
    winners = [-1] * rows
    for v, o in enumerate(owners):  # each row's path that accepted most, the first on a tie
        if winners[o] < 0 or accepted[v] > accepted[winners[o]]:
            winners[o] = v
    commit_rows(caches, width, [len(o) for o in outs])
    if tiled:
        filter_rows(caches, winners, trim=False)
    return Verified([outs[w] for w in winners], winners, paths, accepted, hidden, logits)
