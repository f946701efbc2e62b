"""Drafting: the head's cache tracks the committed text (sync with the true
main hiddens), and each strategy drafts what it promises."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtp_engine.modes import DecodeConfig
from mtp_engine.sampling import GREEDY
from tests.conftest import PROMPTS


def fresh_chain(engine, committed: list[int], k: int) -> tuple[list[int], list[float], list[float]]:
    """Draft k tokens from scratch: one trunk forward over the committed text
    (all but its last token, which is not fed yet), an MTP prefill over every
    pair (H_j, t_{j+1}), then greedy steps.

    Returns:
        The drafts, the top-2 logit gap at each, and the running product of
        top-1 probabilities.
    """
    model, head = engine.model, engine.checkpoint.head
    embed = model.model.embed_tokens
    hidden = model.model(mx.array(committed[:-1])[None], cache=model.make_cache())
    cache = head.make_cache()  # the head alone, eager, as the reference
    m = head(hidden, embed(mx.array(committed[1:])[None]), cache)[:, -1:]
    drafts, gaps, products, running = [], [], [], 1.0
    for _ in range(k):
        logits = engine.lm_head(m)[0, 0]
        top2 = mx.sort(logits)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        d = int(mx.argmax(logits))
        running *= float(mx.softmax(logits)[d])
        drafts.append(d)
        products.append(running)
        m = head(m, embed(mx.array([[d]])), cache)
    return drafts, gaps, products


def fresh_drafts(engine, committed: list[int], k: int) -> tuple[list[int], list[float]]:
    drafts, gaps, _ = fresh_chain(engine, committed, k)
    return drafts, gaps


@pytest.mark.parametrize("prompt", PROMPTS[1:4])
def test_head_cache_matches_the_committed_text_after_every_step(tiny_engine, prompt):
    k = 3
    result = tiny_engine.generate(prompt, max_tokens=40, mode="chain", draft_tokens=k, trace=True)
    ids = result.prompt_tokens
    committed = len(ids) + 1  # prompt and the first token
    sequence = ids + result.tokens
    exact = 0
    for step in result.trace:
        expected, gaps = fresh_drafts(tiny_engine, sequence[:committed], len(step.drafts[0]))
        got = step.drafts[0]
        for j, (a, b) in enumerate(zip(got, expected)):
            if a != b:
                # Only a float near-tie in the head may flip a draft.
                assert gaps[j] < 1e-3, f"draft {j} differs: {a} vs {b}, gap {gaps[j]}"
                break
        else:
            exact += 1
        committed += len(step.emitted)
    assert exact >= len(result.trace) - 1


@pytest.mark.parametrize("tau", [1e-9, 0.3, 0.7, 1.0])
def test_adaptive_depth_stops_when_confidence_falls_below_tau(tiny_engine, tau):
    depth_max = 4
    result = tiny_engine.generate(
        PROMPTS[1], max_tokens=40, mode="adaptive", draft_tokens=depth_max, tau=tau, trace=True
    )
    ids = result.prompt_tokens
    committed = len(ids) + 1
    sequence = ids + result.tokens
    depths = []
    for step in result.trace[:-1]:
        _, _, products = fresh_chain(tiny_engine, sequence[:committed], depth_max)
        below = [j + 1 for j, c in enumerate(products) if c < tau]
        expected = min(below[0], depth_max) if below else depth_max
        budget = 40 - (committed - len(ids)) - 1  # never draft past max_tokens
        expected = min(expected, budget)
        if not any(abs(c - tau) < 1e-4 for c in products):
            assert len(step.drafts[0]) == expected
        depths.append(len(step.drafts[0]))
        committed += len(step.emitted)
    if tau == 1e-9:
        assert depths.count(depth_max) >= len(depths) - 2


def test_tree_branches(tiny_engine):
    result = tiny_engine.generate(PROMPTS[2], max_tokens=40, mode="tree", draft_tokens=3, trace=True)
    for step in result.trace[:-1]:
        a, b, c = step.drafts
        assert a[0] != b[0]  # B: runner-up at position 1
        assert c[0] == a[0] and c[1] != a[1]  # C: runner-up at position 2
    result = tiny_engine.generate(PROMPTS[2], max_tokens=40, mode="tree", draft_tokens=3, tree_pos2=False, trace=True)
    assert all(len(s.drafts) == 2 for s in result.trace[:-1])


def test_paths_have_distinct_first_tokens(tiny_engine):
    result = tiny_engine.generate(PROMPTS[3], max_tokens=40, mode="paths", draft_tokens=3, paths=4, trace=True)
    for step in result.trace[:-1]:
        firsts = [p[0] for p in step.drafts]
        assert len(step.drafts) == 4 and len(set(firsts)) == 4
    chain = tiny_engine.generate(PROMPTS[3], max_tokens=40, mode="chain", draft_tokens=3, trace=True)
    one = tiny_engine.generate(PROMPTS[3], max_tokens=40, mode="paths", draft_tokens=3, paths=1, trace=True)
    assert [s.drafts for s in chain.trace] == [s.drafts for s in one.trace]


def test_first_path_of_paths_is_the_chain(tiny_engine):
    """Branches restart the head's cache at the fork: path 0 of a paths step
    equals the chain drafted from the same state."""
    result = tiny_engine.generate(PROMPTS[4], max_tokens=40, mode="paths", draft_tokens=3, paths=3, trace=True)
    ids = result.prompt_tokens
    committed = len(ids) + 1
    sequence = ids + result.tokens
    for step in result.trace[:-1]:
        expected, gaps = fresh_drafts(tiny_engine, sequence[:committed], 3)
        for j, (a, b) in enumerate(zip(step.drafts[0], expected)):
            if a != b:
                assert gaps[j] < 1e-3
                break
        committed += len(step.emitted)


def test_adaptive_tree_branch_only_when_deep(tiny_engine):
    result = tiny_engine.generate(PROMPTS[1], max_tokens=50, mode="adaptive_tree", draft_tokens=4, tau=0.5, trace=True)
    for step in result.trace[:-1]:
        if len(step.drafts[0]) >= 2:
            assert len(step.drafts) == 2 and step.drafts[1][0] != step.drafts[0][0]
            assert len(step.drafts[1]) == len(step.drafts[0])
        else:
            assert len(step.drafts) == 1


def test_chain_draft_needs_a_positive_depth(tiny_engine):
    drafter = tiny_engine.make_drafter(tiny_engine.pick_drafter("tree"))  # the MLX drafter
    hidden = mx.zeros((1, 2, tiny_engine.model.args.hidden_size))
    drafter.add_row(None, hidden, [5, 6])
    with pytest.raises(ValueError, match="k >= 1 tokens, got 0"):
        drafter.propose(DecodeConfig(), 0, [GREEDY], [0], [0])
    assert drafter.propose(DecodeConfig(), 3, [GREEDY], [0], [3]).tokens.shape == (1, 3)
