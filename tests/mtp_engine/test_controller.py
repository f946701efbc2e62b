"""Mode "auto": the controller chooses each step's drafts from the acceptance
and step costs it measures, and never changes a token."""

from __future__ import annotations

import pytest

from mtp_engine import MTPEngine
from mtp_engine.controller import MAX_PLAIN_RUN, PLAIN_RUN, Controller, RowAcceptance
from mtp_engine.decoder import Decoder
from mtp_engine.modes import DecodeConfig
from mtp_engine.sampling import SamplingParams
from tests.conftest import PROMPTS


def measured(controller: Controller, rows: int, costs: dict[int, float]) -> None:
    """Steps of each width at these costs (twice: a shape's first is not counted)."""
    for width, seconds in costs.items():
        for _ in range(2):
            controller.observe_step(rows, width, seconds)


def with_rate(controller: Controller, rows: list[RowAcceptance], rate: float, steps: int = 30) -> None:
    """Steps in which each row accepts drafts at ``rate`` (a fixed pattern)."""
    k = controller.k
    for s in range(steps):
        accepted = [next((j for j in range(k) if (s * 7 + j * 3 + b) % 100 >= rate * 100), k)
                    for b in range(len(rows))]
        controller.observe_rows(rows, [k] * len(rows), accepted)


def first_choices(width_cost, acceptance: float, steps: int = 8) -> list[int]:
    """A fresh controller's first choices where a step of width w costs
    ``width_cost(w)`` and every draft is accepted with ``acceptance``."""
    c = Controller(3)
    rows = [RowAcceptance.empty(3) for _ in range(4)]
    seen = []
    for _ in range(steps):
        d = c.choose(rows, [100] * 4)
        seen.append(d)
        c.observe_step(4, d + 1, width_cost(d + 1))
        if d:
            c.observe_rows(rows, [d] * 4, [d if acceptance > 0.5 else 0] * 4)
    return seen


def test_a_fresh_controller_measures_plain_steps_and_one_draft_then_goes_wider_only_where_it_looks_best():
    # Each shape twice (a shape's first step is not counted).
    assert first_choices(lambda w: 1.0, 0.9) == [0, 0, 1, 1, 3, 3, 3, 3]  # wide steps nearly free, drafts land
    assert first_choices(lambda w: w, 0.9)[:4] == [0, 0, 1, 1]
    assert first_choices(lambda w: w, 0.0) == [0, 0, 1, 1, 0, 0, 0, 0]  # drafts miss: no wider step is tried


def test_drafts_that_pay_are_taken_and_drafts_that_do_not_are_not():
    costs = {1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9}  # a CPU-like step: width costs
    good, bad = Controller(3), Controller(3)
    for c in (good, bad):
        measured(c, 8, costs)
    good_rows = [RowAcceptance.empty(3) for _ in range(8)]
    bad_rows = [RowAcceptance.empty(3) for _ in range(8)]
    with_rate(good, good_rows, 0.9)
    with_rate(bad, bad_rows, 0.1)
    assert good.choose(good_rows, [100] * 8) == 3
    assert bad.choose(bad_rows, [100] * 8) == 0
    # Where a wider step is nearly free (a GPU at small batches), even modest drafts pay.
    cheap = Controller(3)
    measured(cheap, 8, {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06})
    cheap_rows = [RowAcceptance.empty(3) for _ in range(8)]
    with_rate(cheap, cheap_rows, 0.3)
    assert cheap.choose(cheap_rows, [100] * 8) >= 1


def test_it_follows_acceptance_that_falls_and_looks_again_after_plain_steps():
    c = Controller(3)
    measured(c, 4, {1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9})
    rows = [RowAcceptance.empty(3) for _ in range(4)]
    with_rate(c, rows, 0.9)
    assert c.choose(rows, [100] * 4) == 3
    with_rate(c, rows, 0.05, steps=40)  # the context changed: drafts stop landing
    choices = [c.choose(rows, [100] * 4) for _ in range(PLAIN_RUN + 1)]
    assert choices[:PLAIN_RUN] == [0] * PLAIN_RUN
    assert choices[PLAIN_RUN] >= 1  # after PLAIN_RUN plain steps a speculative one measures again


def test_budgets_cap_the_depth_and_row_counts_borrow_costs():
    c = Controller(4)
    measured(c, 16, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4})
    rows = [RowAcceptance.empty(4) for _ in range(16)]
    with_rate(c, rows, 0.95)
    assert c.choose(rows, [100] * 16) == 4
    assert c.choose(rows, [3] * 16) == 2  # a row that may emit 3 more tokens needs at most 2 drafts
    assert c.choose(rows, [1] * 16) == 0
    # 3 rows (bucket 4) have measured nothing: they borrow the curve of 16 rows.
    assert c.cost(3, 3) == pytest.approx(1.2)
    c.observe_step(3, 1, 0.5)
    c.observe_step(3, 1, 0.5)
    assert c.cost(3, 3) == pytest.approx(0.5 * 1.2 / 1.0)  # scaled by what it measured at width 1
    assert c.choose(rows[:3], [100] * 3) == 4


@pytest.fixture(scope="module")
def engine(tiny_path):
    return MTPEngine.load(tiny_path)


@pytest.mark.parametrize("batch,drafter", [(1, "mlx"), (4, "mlx"), (3, "cpp")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_auto_mode_emits_plain_decodings_tokens_whatever_it_chooses(engine, batch, drafter, temperature):
    if drafter == "cpp" and (engine.drafters.cpp is None or temperature > 0):
        pytest.skip("the C++ drafter drafts greedy rows on the CPU")
    prompts = PROMPTS[:5]
    plain = engine.generate_batch(prompts, mode="baseline", batch_size=batch, max_tokens=40,
                                  temperature=temperature, seed=11)
    auto = engine.generate_batch(prompts, mode="auto", draft_tokens=3, batch_size=batch, drafter=drafter,
                                 max_tokens=40, temperature=temperature, seed=11)
    assert [r.tokens for r in auto] == [r.tokens for r in plain]
    for r in auto:
        assert r.stats.mode == "auto" and len(r.stats.depths) == 4
        assert sum(r.stats.depths) == r.stats.steps
    # The first steps try plain steps and every depth, so rows met both kinds of step.
    assert sum(r.stats.depths[0] for r in auto) > 0 and sum(sum(r.stats.depths[1:]) for r in auto) > 0


def test_a_decoder_in_auto_mode_keeps_what_it_measured_across_rows(engine):
    decoder = Decoder(engine, DecodeConfig(mode="auto", draft_tokens=2, batch_size=2))
    for i, prompt in enumerate(PROMPTS[:6]):
        decoder.add(i, prompt, [SamplingParams()], max_tokens=24)
    while decoder.pending:
        decoder.step()
    c = decoder.controller
    assert sum(c.chosen) > 0 and any(entry[1] for entry in c.costs.values())
    assert sum(c.tried[1:]) > 0


def test_probes_grow_rarer_while_drafts_do_not_pay():
    c = Controller(2)
    measured(c, 4, {1: 1.0, 2: 1.5, 3: 2.0})
    rows = [RowAcceptance.empty(2) for _ in range(4)]
    with_rate(c, rows, 0.02, steps=40)
    gaps, run = [], 0
    for _ in range(1200):
        d = c.choose(rows, [1000] * 4)
        if d:
            gaps.append(run)
            run = 0
            c.observe_rows(rows, [d] * 4, [0] * 4)  # the probe's drafts were all rejected
        else:
            run += 1
    assert gaps[:5] == [PLAIN_RUN, 2 * PLAIN_RUN, 4 * PLAIN_RUN, 8 * PLAIN_RUN, 16 * PLAIN_RUN]
    assert set(gaps[5:]) == {MAX_PLAIN_RUN}


def steps_at(true: dict[int, float], first: dict[int, float], steps: int) -> list[int]:
    """A controller's choices over 8 rows whose drafts land at 0.8, each
    width measured at ``first`` before its steps cost ``true``."""
    c = Controller(3)
    measured(c, 8, first)
    rows = [RowAcceptance.empty(3) for _ in range(8)]
    choices = []
    for s in range(steps):
        d = c.choose(rows, [1000] * 8)
        choices.append(d)
        c.observe_step(8, d + 1, true[d + 1])
        if d:
            accepted = [next((j for j in range(d) if (s * 7 + j * 3 + b) % 10 >= 8), d) for b in range(8)]
            c.observe_rows(rows, [d] * 8, accepted)
    return choices


def test_a_depth_misjudged_at_start_is_measured_again_and_taken():
    # Width 4's only early measure was slow (a second use of a shape still
    # compiling); the step really costs what width 3 does. Drafts land at 0.8.
    true = {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06}
    choices = steps_at(true, {**true, 4: 1.6}, 400)
    assert choices[:20].count(3) < 5  # misjudged at first
    assert choices[-100:].count(3) > 80  # measured again, then taken


def test_a_narrow_step_priced_above_a_wider_one_is_measured_again_and_taken():
    # One draft's only early measure paid a first use (100x its cost); one
    # draft is the best depth at the true costs (E = 1.8 / 2.44 / 2.95 tokens).
    true = {1: 1.0, 2: 1.05, 3: 1.6, 4: 2.2}
    assert steps_at(true, {**true, 2: 100.0}, 200)[-100:].count(1) > 80


def test_a_position_no_step_tries_keeps_its_estimate():
    c = Controller(3)
    rows = [RowAcceptance.empty(3) for _ in range(4)]
    for s in range(40):  # the first two drafts always land, the third one time in four
        c.observe_rows(rows, [3] * 4, [3 if s % 4 == 0 else 2] * 4)
    deep = c.rate(3, rows[0])
    assert deep < 0.4
    for _ in range(50):  # steps of one draft: positions 2 and 3 are not tried
        c.observe_rows(rows, [1] * 4, [1] * 4)
    assert c.rate(3, rows[0]) == pytest.approx(deep, abs=0.01)
    # A position never tried starts at the one above it, not at a fixed guess.
    fresh = Controller(3)
    fresh_rows = [RowAcceptance.empty(3) for _ in range(4)]
    for _ in range(30):
        fresh.observe_rows(fresh_rows, [1] * 4, [1] * 4)
    assert fresh.rate(2) == pytest.approx(fresh.rate(1)) and fresh.rate(1) > 0.9


def test_no_probe_while_even_drafts_all_accepted_could_not_pay():
    c = Controller(2)
    measured(c, 4, {1: 1.0, 2: 3.0, 3: 5.0})  # one draft costs three plain steps: at most 2 tokens for 3
    rows = [RowAcceptance.empty(2) for _ in range(4)]
    with_rate(c, rows, 0.02, steps=40)
    choices = [c.choose(rows, [1000] * 4) for _ in range(10 * PLAIN_RUN)]
    assert choices[PLAIN_RUN] >= 1  # one probe measures acceptance; it finds plain steps pay
    assert choices[:PLAIN_RUN] + choices[PLAIN_RUN + 1:] == [0] * (10 * PLAIN_RUN - 1)  # then no more
    assert c.settled and "settled on plain steps" in c.describe()
    with_rate(c, rows, 0.99, steps=40)  # settled: whatever acceptance it hears of, steps stay plain
    assert not any(c.choose(rows, [1000] * 4) for _ in range(4 * MAX_PLAIN_RUN))
    # Where a step of two drafts costs less than three plain ones, probes go on.
    d = Controller(2)
    measured(d, 4, {1: 1.0, 2: 1.9, 3: 2.5})
    with_rate(d, rows, 0.02, steps=40)
    assert any(d.choose(rows, [1000] * 4) for _ in range(PLAIN_RUN + 1))
    assert not d.settled


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_decoder_settled_on_plain_steps_stops_feeding_the_head_and_keeps_every_token(engine, temperature):
    prompts = PROMPTS[:6]
    plain = engine.generate_batch(prompts, mode="baseline", batch_size=2, max_tokens=32, temperature=temperature,
                                  seed=5)
    decoder = Decoder(engine, DecodeConfig(mode="auto", draft_tokens=2, batch_size=2, drafter="mlx"))
    for i, prompt in enumerate(prompts):
        decoder.add(i, prompt, [SamplingParams(temperature=temperature, seed=5 + i)], max_tokens=32)
    results, steps = {}, 0
    while decoder.pending:
        steps += 1
        if steps == 6:  # mid-row, with plain steps' pairs queued for the head: the costs say drafts cannot pay
            decoder.controller.settled = True
        for (i, _), r in decoder.step():
            results[i] = r
    assert decoder.drafter is None  # the head no longer consumes the rows' prompts and tokens
    assert [results[i].tokens for i in range(len(prompts))] == [r.tokens for r in plain]
    late = [results[i].stats.depths for i in range(2, len(prompts))]  # rows that joined after it settled
    assert all(sum(d[1:]) == 0 for d in late)
