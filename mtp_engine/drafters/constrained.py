"""Chains of drafts for batches with constrained rows (`mtp_engine.constraints`).

At each depth the head's logits keep only the tokens each row's grammar
allows after the drafts before it, the draft is chosen from them as usual
(greedy, the exact sampler's noise, or the rejection sampler's sample of the
masked head distribution), read back, and the row's grammar advances along
it. So a draft never breaks its row's grammar, and the proposal carries the
masks of every verified position (``[V, K+1, vocab]``), which the verify
forward applies to the trunk's logits. One host sync per depth: the next
mask needs the draft.
"""

from __future__ import annotations

import mlx.core as mx

from mtp_engine.constraints import RowGrammar, constrain, masks_of
from mtp_engine.drafters.base import Proposal
from mtp_engine.sampling import SamplingParams, draft_choice
from mtp_engine.verify import positions_of


def masked_chain(drafter, m: mx.array, k: int, params: list[SamplingParams], starts: list[int], caps: list[int],
                 grammars: list[RowGrammar | None]) -> Proposal:
    """``k`` drafts per row from the head's hiddens ``m`` (``[R, 1, dim]``,
    after the pending pairs), each masked by its row's grammar (rows with
    None are not masked); ``drafter`` is the `HeadDrafter` whose cache the
    forwards extend."""
    drafts, scaled, masks = [], [], []
    for depth in range(k):
        if depth:
            m = drafter._forward(m, drafts[-1], drafter.cache)
        logits = drafter.lm_head(m)  # [R, 1, V]
        mx.async_eval(logits)  # the device computes while the host computes the masks
        masks.append(masks_of(grammars))
        d, q = draft_choice(constrain(logits, masks[-1]), params, positions_of(starts, 1) + depth)
        for g, (t,), cap in zip(grammars, d.tolist(), caps):
            if g is not None and depth < cap:
                g.draft(t)
            elif g is not None:  # past the row's budget: its drafts are not verified
                g.ended = True
        drafts.append(d)
        scaled.append(q)
    masks.append(masks_of(grammars))  # the bonus position, after every draft
    q_scaled = mx.concatenate(scaled, axis=1) if scaled[0] is not None else None  # [R, k, V]
    return Proposal(mx.concatenate(drafts, axis=1), uses=caps, q_scaled=q_scaled,
                    masks=mx.concatenate(masks, axis=1))
