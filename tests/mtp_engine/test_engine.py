"""`MTPEngine.generate`: results, stopping, statistics, trace, reuse, errors."""

from __future__ import annotations

import pytest

from mtp_engine import MODES, MTPEngine
from tests.conftest import PROMPTS

SPECULATIVE = [m for m in MODES if m != "baseline"]


@pytest.fixture(scope="module")
def baseline(tiny_engine):
    return {p: tiny_engine.generate(p, max_tokens=48, mode="baseline") for p in PROMPTS[1:5]}


@pytest.mark.parametrize("mode", MODES)
def test_result_fields_and_length_stop(tiny_engine, baseline, mode):
    prompt = PROMPTS[1]
    result = tiny_engine.generate(prompt, max_tokens=48, mode=mode)
    assert result.tokens == baseline[prompt].tokens
    assert result.finish_reason == "length" and len(result.tokens) == 48
    assert result.text == tiny_engine.tokenizer.decode(result.tokens)
    assert result.prompt_tokens == tiny_engine.encode(prompt)
    s = result.stats
    assert s.mode == mode and s.generated_tokens == 48 and s.prompt_tokens == len(result.prompt_tokens)
    assert s.prefill_s > 0 and s.decode_s > 0
    if mode == "baseline":
        assert s.steps == 47 and s.drafted == 0 and s.acceptance_length == 1.0
    else:
        assert sum(s.histogram) == s.steps == sum(s.row_wins)
        assert s.accepted == sum(n * count for n, count in enumerate(s.histogram))
        assert s.acceptance_length == pytest.approx((s.accepted + s.steps) / s.steps)
        assert s.accepted <= s.drafted
        # Every token after the first comes from a verify step.
        assert s.accepted + s.steps >= len(result.tokens) - 1


@pytest.mark.parametrize("mode", MODES)
def test_eos_stops_and_is_not_returned(tiny_path, baseline, mode):
    prompt = PROMPTS[2]
    reference = baseline[prompt].tokens
    eos = reference[10]
    engine = MTPEngine.load(tiny_path)
    engine.tokenizer.add_eos_token(str(eos))
    result = engine.generate(prompt, max_tokens=48, mode=mode)
    assert result.finish_reason == "stop"
    assert result.tokens == reference[: reference.index(eos)]


@pytest.mark.parametrize("mode", ["baseline", "chain", "paths"])
def test_stop_string_cuts_the_text(tiny_engine, baseline, mode):
    prompt = PROMPTS[3]
    full_text = baseline[prompt].text
    stop = full_text[20:24]
    result = tiny_engine.generate(prompt, max_tokens=48, mode=mode, stop=[stop, "never-seen"])
    assert result.finish_reason == "stop"
    assert result.text == full_text[: full_text.find(stop)]
    assert stop not in result.text
    assert result.tokens == baseline[prompt].tokens[: len(result.tokens)]


@pytest.mark.parametrize("mode", SPECULATIVE)
def test_trace_records_every_verify_step(tiny_engine, mode):
    result = tiny_engine.generate(PROMPTS[4], max_tokens=40, mode=mode, trace=True, draft_tokens=3)
    assert len(result.trace) == result.stats.steps
    emitted = [t for step in result.trace for t in step.emitted]
    assert [result.tokens[0]] + emitted[: len(result.tokens) - 1] == result.tokens
    for step in result.trace:
        winner = step.drafts[step.row]
        assert step.emitted[: step.accepted] == winner[: step.accepted]
        assert len(step.emitted) == step.accepted + 1
        assert all(len(d) == len(winner) for d in step.drafts)
        # The verify logits behind each emitted token: it is their argmax.
        assert len(step.top_logits) == len(step.emitted)
        for token, top in zip(step.emitted, step.top_logits):
            values = [v for _, v in top]
            assert top[0][0] == token and values == sorted(values, reverse=True)


def test_engine_reuse_leaks_no_state(tiny_engine):
    first = [tiny_engine.generate(p, max_tokens=24, mode="tree").tokens for p in PROMPTS[:3]]
    tiny_engine.generate(PROMPTS[5], max_tokens=60, mode="paths", paths=4)
    again = [tiny_engine.generate(p, max_tokens=24, mode="tree").tokens for p in reversed(PROMPTS[:3])]
    assert first == list(reversed(again))


def test_string_prompt_equals_token_ids(tiny_engine):
    text = PROMPTS[4]
    a = tiny_engine.generate(text, max_tokens=16)
    b = tiny_engine.generate(tiny_engine.encode(text), max_tokens=16)
    assert a.tokens == b.tokens and a.prompt_tokens == b.prompt_tokens


def test_one_token_prompt_and_one_token_budget(tiny_engine):
    result = tiny_engine.generate([5], max_tokens=1, mode="chain")
    assert len(result.tokens) == 1 and result.stats.steps == 0
    result = tiny_engine.generate([5], max_tokens=2, mode="tree")
    assert len(result.tokens) == 2 and result.stats.steps == 1 and result.stats.drafted == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(mode="beam"), ValueError, "unknown mode 'beam'"),
        (dict(draft_tokens=0), ValueError, "draft_tokens.*0"),
        (dict(tau=0.0), ValueError, "tau.*0.0"),
        (dict(tau=1.5), ValueError, "tau.*1.5"),
        (dict(paths=0), ValueError, "paths.*0"),
        (dict(max_tokens=0), ValueError, "max_tokens.*0"),
        (dict(stop=3), TypeError, "stop"),
        (dict(stop=[""]), ValueError, "empty"),
    ],
)
def test_bad_parameters_are_named(tiny_engine, kwargs, error, match):
    with pytest.raises(error, match=match):
        tiny_engine.generate("hi", **kwargs)


@pytest.mark.parametrize(
    "prompt, error, match",
    [
        ("", ValueError, "empty"),
        ([], ValueError, "empty"),
        ([1, "a"], TypeError, "token ids"),
        ([1, 100000], ValueError, "100000.*vocabulary"),
        (3.5, TypeError, "string or a list"),
    ],
)
def test_bad_prompts_are_named(tiny_engine, prompt, error, match):
    with pytest.raises(error, match=match):
        tiny_engine.generate(prompt)
