"""The decoder (`mtp_engine.decoder`), batched: every row's tokens equal
mlx-lm's greedy decoding of its prompt alone (`mlx_lm.load` +
`generate_step`), for batch sizes 1..16, K = 1..6, prompts of very different
lengths, budgets per row, rows ending at different steps (EOS, stop strings,
budgets) and rows joining mid-flight; whatever rows share the batch. A
divergence passes only on a numerical near-tie (none are expected on MLX's
CPU backend in float32)."""

from __future__ import annotations

import json
import shutil
import time

import mlx.core as mx
import pytest

from mtp_engine import MTPEngine
from mtp_engine.decoder import Decoder
from mtp_engine.io.tiny import tiny_config
from mtp_engine.modes import DecodeConfig
from mtp_engine.sampling import GREEDY, SamplingParams
from mtp_engine.verify import verify
from mtp_engine.tools.phases import PHASES, PhaseTimer
from mtp_engine.tools.projection import ProjectedDrafts, ProjectingDrafter, parse_profile, project_rows
from tests.conftest import PROMPTS
from tests.mtp_engine.test_lossless import CONFIGS, first_divergence

LONG = " ".join(PROMPTS) * 3  # a few hundred tokens


@pytest.fixture(scope="module")
def models(checkpoint_factory, reference_factory, tmp_path_factory):
    """Engines and references for three tiny configs, and one copy of the
    first whose EOS is a token its greedy outputs reach, so rows end on EOS."""
    out = {}
    for name in ("l4_fai4_kv2_e4k2", "l6_fai3_kv1_e8k1_mtp2", "l5_random_tied_sparse2"):
        config, kwargs = CONFIGS[name]
        path = checkpoint_factory(name, config, **kwargs)
        out[name] = (MTPEngine.load(path), reference_factory(path))
    engine, reference = out["l4_fai4_kv2_e4k2"]
    counts: dict[int, int] = {}
    for prompt in PROMPTS:
        tokens, _ = reference.greedy(engine.encode(prompt), 8)
        for t in set(tokens[2:]):  # within every row's budget (8 or more)
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)  # reached by the most prompts
    folder = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(engine.checkpoint.path, folder)
    for name in ("config.json", "generation_config.json"):  # mlx-lm reads both
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(config))
    out["eos"] = (MTPEngine.load(folder), reference)
    return out


def rows_for(engine, reference, n_tokens: int = 48):
    """Prompts of very different lengths, budgets per row, two stop strings
    cut from the reference text, and each row's reference."""
    prompts = [engine.encode(p) for p in PROMPTS] + [engine.encode(LONG), engine.encode("x")]
    rows = []
    for i, ids in enumerate(prompts):
        budget = 8 + (i * 13) % (n_tokens - 8)
        ref, gaps = reference.greedy(ids, n_tokens)
        stop = None
        if i in (2, 5):
            text = engine.tokenizer.decode(ref[:budget])
            stop = text[len(text) // 2 : len(text) // 2 + 2] or None
        rows.append(dict(ids=ids, max_tokens=budget, stop=stop, ref=ref, gaps=gaps))
    return rows


def check_row(result, row, eos, engine) -> str:
    """"identical" or "near_tie"; fails on any other divergence."""
    ours, ref = result.tokens, row["ref"]
    if first_divergence(ours, ref, row["gaps"]) == "near_tie":
        return "near_tie"
    if result.finish_reason == "length":
        assert len(ours) == row["max_tokens"]
    elif row["stop"] and row["stop"] in engine.tokenizer.decode(ours):
        assert row["stop"] not in engine.tokenizer.decode(ours[:-1])  # it stopped at the first one
    else:  # EOS: the reference's next token is one
        assert len(ours) < len(ref) and ref[len(ours)] in eos, (len(ours), result.finish_reason)
    return "identical"


CASES = [
    # (model, batch size, mode, K, drafter)
    ("l4_fai4_kv2_e4k2", 1, "chain", 1, "mlx"),
    ("l4_fai4_kv2_e4k2", 3, "chain", 2, "cpp"),
    ("l4_fai4_kv2_e4k2", 16, "chain", 6, "mlx"),
    ("l6_fai3_kv1_e8k1_mtp2", 5, "chain", 4, "mlx"),
    ("l6_fai3_kv1_e8k1_mtp2", 2, "chain", 3, "cpp"),
    ("l5_random_tied_sparse2", 8, "chain", 5, "mlx"),
    ("eos", 6, "chain", 3, "mlx"),
    ("eos", 4, "baseline", 3, "mlx"),  # plain batched decoding
    ("l4_fai4_kv2_e4k2", 4, "tree", 3, "mlx"),  # several paths per row
    ("l6_fai3_kv1_e8k1_mtp2", 3, "paths", 2, "mlx"),
    ("eos", 5, "adaptive", 4, "cpp"),
    ("l5_random_tied_sparse2", 3, "adaptive_tree", 3, "mlx"),
    ("l4_fai4_kv2_e4k2", 4, "auto", 3, "mlx"),  # plain and speculative steps, as the controller chooses
    ("eos", 5, "auto", 2, "cpp"),
    ("l6_fai3_kv1_e8k1_mtp2", 1, "auto", 4, "mlx"),
]


@pytest.mark.parametrize("name,batch,mode,k,drafter", CASES)
def test_every_row_equals_plain_decoding_of_its_prompt_alone(models, name, batch, mode, k, drafter, capsys):
    engine, reference = models[name]
    if drafter == "cpp" and engine.drafters.cpp is None:
        pytest.skip("needs the C++ drafter")
    rows = rows_for(engine, reference)
    # buckets: finished rows keep their places (ghosts stepping beside live rows), as on a GPU, down to
    # smaller buckets than a GPU's batches meet (rows leave a bucket too)
    decoder = Decoder(engine, DecodeConfig(mode=mode, draft_tokens=k, batch_size=batch, drafter=drafter),
                      buckets=[1, 2, 4])
    for i, row in enumerate(rows):
        decoder.add(i, row["ids"], [GREEDY], max_tokens=row["max_tokens"], stop=row["stop"])
    results, sizes = {}, set()
    while decoder.pending:
        finished = decoder.step()
        results.update({key: r for (key, _), r in finished})
        sizes.add(len(decoder.rows))
    assert max(sizes) == min(batch, len(rows))  # rows joined as others left
    assert sizes <= set(decoder.buckets) | {len(rows)}  # finished rows kept their places down to a bucket
    outcomes = [check_row(results[i], row, engine.eos_token_ids, engine) for i, row in enumerate(rows)]
    reasons = {r.finish_reason for r in results.values()}
    with capsys.disabled():
        print(f"\n[batched {name} B={batch} {mode} K={k} {drafter}] identical={outcomes.count('identical')} "
              f"near_ties={outcomes.count('near_tie')} finish={sorted(reasons)}")
    assert "length" in reasons and "stop" in reasons
    if mode not in ("baseline", "auto") and CONFIGS.get(name, (None, {}))[1].get("predictability"):
        assert sum(r.stats.accepted for r in results.values()) > 0  # long accepted prefixes were committed
    if mode == "auto":  # how many steps draft is the controller's choice from measured times (test_controller.py)
        assert all(sum(r.stats.depths) == r.stats.steps for r in results.values())
    if name == "eos":
        eos = engine.eos_token_ids
        assert any(r.finish_reason == "stop" and not rows[i]["stop"] and rows[i]["ref"][len(r.tokens)] in eos
                   for i, r in results.items())


def test_warm_up_meets_every_step_shape_of_the_job_and_changes_no_token(models, monkeypatch):
    """Mode auto's warm-up steps every bucket of rows at every width once
    (twice: the controller's costs start measured); the decoding after it
    meets no verify shape the warm-up did not, and its rows are plain
    decoding's. A later decoder of the engine with the same settings meets
    nothing again."""
    engine, reference = models["l4_fai4_kv2_e4k2"]
    engine.warmed.clear()  # another test's warm-up of these settings would leave nothing to meet
    decoder = Decoder(engine, DecodeConfig(mode="auto", draft_tokens=3, batch_size=6), buckets=[1, 2, 4])
    seconds, shapes, reused = decoder.warm_up(GREEDY)
    assert decoder.buckets == [1, 2, 4, 6] and shapes == 4 * 4 and not reused and seconds > 0 and not decoder.rows
    measured = {shape for shape, (_, recent) in decoder.controller.costs.items() if recent}
    assert measured == {(decoder.controller.bucket(b), w) for b in decoder.buckets for w in range(1, 5)}
    met = []

    def spy(trunk, lm_head, caches, xs, proposal, *args):
        met.append((xs.shape[0], proposal.tokens.shape[1] + 1))
        return verify(trunk, lm_head, caches, xs, proposal, *args)

    monkeypatch.setattr("mtp_engine.decoder.verify", spy)
    rows = rows_for(engine, reference)
    for i, row in enumerate(rows):
        decoder.add(i, row["ids"], [GREEDY], max_tokens=row["max_tokens"], stop=row["stop"])
    results = {}
    while decoder.pending:
        results.update({key: r for (key, _), r in decoder.step()})
    assert met and set(met) <= {(b, w) for b in decoder.buckets for w in range(2, 5)}
    assert all(check_row(results[i], row, engine.eos_token_ids, engine) == "identical" for i, row in enumerate(rows))

    # a later decoder of the engine with these settings meets nothing again: it starts from the costs measured then
    again = Decoder(engine, DecodeConfig(mode="auto", draft_tokens=3, batch_size=6), buckets=[1, 2, 4])
    assert again.warm_up(GREEDY)[1:] == (0, 4)  # no shape met, every bucket's costs reused
    assert {shape for shape, (_, recent) in again.controller.costs.items() if recent} == measured
    sampled = Decoder(engine, DecodeConfig(mode="auto", draft_tokens=3, batch_size=6), buckets=[1, 2, 4])
    assert sampled.warm_up(SamplingParams(temperature=0.7))[1] > 0  # other settings: other shapes to meet


def test_a_warm_up_whose_rows_end_at_their_first_token_records_nothing(models, monkeypatch):
    """Rows that end before a step meet no shape: the warm-up says so (no
    shape met, none reused) and the engine keeps nothing to reuse."""
    engine, _ = models["l4_fai4_kv2_e4k2"]
    engine.warmed.clear()
    every = set(range(engine.text.args.vocab_size))
    monkeypatch.setattr(type(engine), "eos_token_ids", property(lambda self: every))  # any first token ends a row
    decoder = Decoder(engine, DecodeConfig(mode="auto", draft_tokens=3, batch_size=2), buckets=[1])
    assert decoder.warm_up(GREEDY)[1:] == (0, 0) and not engine.warmed


def test_a_row_does_not_depend_on_the_rows_beside_it(models):
    engine, _ = models["l4_fai4_kv2_e4k2"]
    prompts = PROMPTS + [LONG]
    budgets = [40] * len(prompts)
    first = engine.generate_batch(prompts, batch_size=4, max_tokens=budgets, draft_tokens=3)
    order = list(reversed(range(len(prompts))))
    second = engine.generate_batch([prompts[i] for i in order], batch_size=7, max_tokens=budgets, draft_tokens=5)
    for j, i in enumerate(order):
        assert second[j].tokens == first[i].tokens


def test_generate_batch_yields_rows_as_they_finish_and_returns_them_in_order(models):
    engine, _ = models["l4_fai4_kv2_e4k2"]
    prompts = ["def add(a, b):", "x", "class Point:"]
    budgets = [30, 3, 12]
    finished = list(engine.generate_batch_iter(prompts, batch_size=3, max_tokens=budgets))
    assert finished[0][0] == 1 and sorted(i for i, _ in finished) == [0, 1, 2]  # the 3-token row first
    results = engine.generate_batch(prompts, batch_size=2, max_tokens=budgets)
    for prompt, budget, result in zip(prompts, budgets, results):
        assert result.tokens == engine.generate(prompt, max_tokens=budget, mode="baseline").tokens
    assert all(r.stats.mode == "chain" and r.stats.prefill_s > 0 for r in results)


def test_rows_that_end_at_their_first_token_leave_their_places_within_one_admission(models):
    """Prompts admitted together are read back together; those whose rows
    end at their first token free their places for the next queued prompts
    in the same step, and every row still equals plain decoding."""
    engine, _ = models["l4_fai4_kv2_e4k2"]
    budgets = [1, 1, 9, 1, 9, 1]
    decoder = Decoder(engine, DecodeConfig(mode="chain", draft_tokens=3, batch_size=2))
    for i, budget in enumerate(budgets):
        decoder.add(i, PROMPTS[i], [GREEDY], max_tokens=budget)
    first = dict(decoder.step())
    assert sorted(k for k, _ in first) == [0, 1, 3]  # the third prompt and the fifth hold both places
    assert decoder.live == 2 and len(decoder.queue) == 1
    results = dict(first)
    while decoder.pending:
        results.update(decoder.step())
    decoder.close()
    for i, budget in enumerate(budgets):
        want = engine.generate(PROMPTS[i], max_tokens=budget, mode="baseline").tokens
        assert results[(i, 0)].tokens == want and len(want) <= budget
        assert results[(i, 0)].stats.prefill_s > 0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(batch_size=0), ValueError, "batch_size must be a positive int, got 0"),
    (dict(mode="beam"), ValueError, "unknown mode 'beam'"),
    (dict(draft_tokens=17), ValueError, "draft_tokens must be an int in 1..16, got 17"),
    (dict(max_tokens=[4]), ValueError, "1 max_tokens for 2 prompts"),
    (dict(max_tokens=0), ValueError, "max_tokens must be a positive integer, got 0"),
    (dict(drafter="gpu"), ValueError, "drafter must be one of"),
    (dict(prefill_ahead=1), TypeError, "unknown keyword 'prefill_ahead'"),
])
def test_bad_parameters_are_named_before_anything_decodes(models, kwargs, error, match):
    engine, _ = models["l4_fai4_kv2_e4k2"]
    with pytest.raises(error, match=match):
        engine.generate_batch(["def f():", "x"], **kwargs)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate_batch(["def f():", ""])


def test_projected_drafts_keep_the_output_and_follow_the_profile(models):
    """Drafts of a random-weight model replaced at a profile: the output
    still equals plain decoding, and acceptance follows the profile."""
    engine, reference = models["l5_random_tied_sparse2"]
    profile = parse_profile("0.9,0.8,0.6")
    prompts = [engine.encode(p) for p in PROMPTS]
    greedy = [reference.greedy(ids, 40) for ids in prompts]
    refs = [tokens for tokens, _ in greedy]
    vocab = engine.model.args.vocab_size
    projections = {(i, 0): ProjectedDrafts(profile, ref, vocab, seed=i) for i, ref in enumerate(refs)}
    drafter = ProjectingDrafter(engine.make_drafter(engine.pick_drafter("chain")), projections)
    decoder = Decoder(engine, DecodeConfig(draft_tokens=3, batch_size=6), drafter=drafter)
    for i, ids in enumerate(prompts):
        decoder.add(i, ids, [GREEDY], max_tokens=40)
    results = {}
    while decoder.pending:
        results.update({key: r for (key, _), r in decoder.step()})
    for i, (ref, gaps) in enumerate(greedy):
        first_divergence(results[i].tokens, ref, gaps)
    # Acceptance over the rows that follow their reference: past a near-tie
    # divergence the projected drafts follow a continuation the row no longer
    # has. On the CPU every row does; on the H200 4 of these 12 rows diverged
    # (each on a near-tie: first_divergence above).
    exact = [results[i] for i, ref in enumerate(refs) if results[i].tokens == ref]
    assert len(exact) >= (len(refs) // 2 if mx.default_device() == mx.gpu else len(refs) - 2)
    steps = sum(r.stats.steps for r in exact)
    histogram = [sum(r.stats.histogram[n] for r in exact) for n in range(4)]
    # P(accepted >= n) = 0.9, 0.8, 0.6 (steps near a budget's end draft less),
    # within 3 standard deviations of that many steps (at least 0.05 and 0.1).
    some, all3 = sum(histogram[1:]) / steps, histogram[3] / steps
    assert abs(some - 0.9) < max(0.05, 3 * (0.09 / steps) ** 0.5), (some, steps)
    assert abs(all3 - 0.6) < max(0.1, 3 * (0.24 / steps) ** 0.5), (all3, steps)
    alone = ProjectingDrafter(engine.make_drafter(engine.pick_drafter("chain")),
                              {(0, 0): ProjectedDrafts(profile, refs[0], vocab, seed=0)})
    decoder = Decoder(engine, DecodeConfig(draft_tokens=3, batch_size=1), drafter=alone)
    decoder.add(0, prompts[0], [GREEDY], max_tokens=40)
    single = None
    while decoder.pending:
        single = next((r for _, r in decoder.step()), single)
    first_divergence(single.tokens, *greedy[0])
    assert single.stats.acceptance_length > 2 or single.tokens != refs[0]
    with pytest.raises(ValueError, match="non-increasing"):
        parse_profile("0.5,0.9")


def test_projected_drafts_are_made_without_reading_the_heads():
    """Projected drafts follow the reference up to the first draft not kept
    and are wrong from there on; rows without a projection keep the head's
    drafts, which stay in the graph unread."""
    reference = [5, 9, 2, 7, 7, 1]
    always = ProjectedDrafts(parse_profile("1,1"), reference, vocab=10, seed=0)
    assert always.drafts(4, 1) == [9, 2, 7, 7]
    assert always.drafts(3, 5) == [1, 0, 0]  # past the reference: positions past any budget
    some = ProjectedDrafts(parse_profile("0.6,0.3"), reference, vocab=10, seed=5)
    kept_counts = []
    for emitted in range(3):
        out = some.drafts(3, emitted)
        truth = reference[emitted : emitted + 3]
        kept = next((j for j, (d, t) in enumerate(zip(out, truth)) if d != t), 3)
        assert out[kept:] == [(t + 1) % 10 for t in truth[kept:]]
        kept_counts.append(kept)
    assert 0 in kept_counts  # covered: a miss at the first draft makes all three wrong
    head = mx.array([[1, 2, 3], [4, 5, 6]], dtype=mx.int32)
    assert project_rows(head, [None, [7, 8, 9]]).tolist() == [[1, 2, 3], [7, 8, 9]]


@pytest.mark.parametrize("drafter", ["mlx", "cpp"])
def test_phase_timing_accounts_for_a_run_and_changes_no_token(models, drafter):
    # Timing every phase (for finding where time goes) evaluates and waits
    # after each; the rows' tokens stay the same, and the phases cover the
    # run: each one is charged, none twice.
    engine, _ = models["l4_fai4_kv2_e4k2"]
    if drafter == "cpp" and engine.drafters.cpp is None:
        pytest.skip("the C++ drafter is not built")
    prompts = [engine.encode(p) for p in PROMPTS] + [engine.encode(LONG)]
    plain = engine.generate_batch(prompts, batch_size=3, max_tokens=12, draft_tokens=3, drafter=drafter)
    timer = PhaseTimer()
    decoder = Decoder(engine, DecodeConfig(draft_tokens=3, batch_size=3, drafter=drafter), hooks=timer,
                      buckets=False)  # rows leave the batch: every phase is met
    for i, ids in enumerate(prompts):
        decoder.add(i, ids, [GREEDY], max_tokens=12)
    results, start = {}, time.perf_counter()
    while decoder.pending:
        results.update({key: r for (key, _), r in decoder.step()})
    wall = time.perf_counter() - start
    phases = timer.seconds
    assert [results[i].tokens for i in range(len(prompts))] == [r.tokens for r in plain]
    expected = set(PHASES) - ({"head_prefill"} if drafter == "cpp" else set())  # C++: prompt pairs in the first draft
    assert set(phases) <= set(PHASES) and expected <= set(phases)
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= wall


def test_plain_batched_decoding_is_batch_mode(models):
    engine, _ = models["l4_fai4_kv2_e4k2"]
    results = engine.generate_batch(PROMPTS[:5], batch_size=3, max_tokens=16, mode="baseline")
    for prompt, result in zip(PROMPTS[:5], results):
        assert result.tokens == engine.generate(prompt, max_tokens=16, mode="baseline").tokens
        # One forward per token after the prefill's (EOS, left out of the tokens, took one too).
        assert result.stats.steps == len(result.tokens) - (result.finish_reason == "length")
        assert result.stats.histogram == []


def test_tiny_config_is_covered():
    assert tiny_config()["num_hidden_layers"] == 4  # the cases above name the configs of test_lossless
