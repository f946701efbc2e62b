"""Shared prefixes prefilled once (`mtp_engine.prefix`): a row that starts
from a prefix's caches emits what plain decoding of its whole prompt emits
(greedy and the exact sampler, one row and batched, every batched mode), on
held-out configs, compared with mlx-lm's model decoding one token per
forward; where float rounding of the extra prefill boundary parts them, the
first divergence must sit on a numerical near-tie. The prefix's own caches
are never written."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtp_engine import MTPEngine
from mtp_engine.decoder import Decoder
from mtp_engine.drafters.head import head_prefill
from mtp_engine.io.tiny import tiny_config
from mtp_engine.modes import DecodeConfig
from mtp_engine.prefix import copy_caches
from mtp_engine.sampling import SamplingParams
from tests.conftest import PROMPTS
from tests.mtp_engine.test_sampling import PlainSampler, assert_same_or_near_tie

HELD_OUT = {  # config, checkpoint options, temperature (greedy on one, the exact sampler on the other)
    "l4_fai2_e4k2": (tiny_config(num_hidden_layers=4, full_attention_interval=2, num_experts=4), dict(seed=31), 0.0),
    "l5_fai5_kv2": (tiny_config(num_hidden_layers=5, full_attention_interval=5, num_key_value_heads=2),
                    dict(seed=32, predictability=0.6), 0.9),
}
N_TOKENS = 16


@pytest.fixture(scope="module", params=sorted(HELD_OUT))
def held_out(request, checkpoint_factory):
    config, kwargs, _ = HELD_OUT[request.param]
    path = checkpoint_factory(f"prefix-{request.param}", config, **kwargs)
    return request.param, MTPEngine.load(path), PlainSampler(path)


def _arrays(prefix) -> list[mx.array]:
    """Every array the prefix's caches hold."""
    out = []
    for c in prefix.caches:
        out += [a for a in c.cache] if hasattr(c, "cache") else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out + [a for c in prefix.head for a in c.state]


def _prompts(engine) -> tuple[list[int], list[list[int]]]:
    system = engine.encode(" ".join(PROMPTS) * 3)  # a long shared head, then each prompt
    return system, [system + engine.encode(p) for p in PROMPTS[:4]]


def test_rows_from_a_prefix_equal_plain_decoding_of_the_whole_prompt(held_out):
    name, engine, plain = held_out
    temperature = HELD_OUT[name][2]
    system, prompts = _prompts(engine)
    prefix = engine.prefill_prefix(system)
    assert len(prefix) == len(system) > 100 and prefix.nbytes > 0
    before = [mx.array(a) for a in _arrays(prefix)]
    params = [SamplingParams(temperature=temperature, top_p=0.95, seed=70 + i) for i in range(len(prompts))]
    references = [plain.sample(ids, p, N_TOKENS) for ids, p in zip(prompts, params)]
    for mode in ("baseline", "chain", "tree"):
        for i, (ids, p) in enumerate(zip(prompts, params)):
            got = engine.generate(ids, mode=mode, max_tokens=N_TOKENS, sampling=p, prefix=prefix)
            assert_same_or_near_tie(f"{name} {mode} row {i}", got.tokens, references[i], p)
    for mode in ("chain", "auto", "baseline"):  # batched, rows with and without the prefix side by side
        decoder = Decoder(engine, DecodeConfig(mode=mode, draft_tokens=3, batch_size=3))
        for i, (ids, p) in enumerate(zip(prompts, params)):
            decoder.add(i, ids, [p], max_tokens=N_TOKENS, prefix=prefix if i % 2 == 0 else None)
        results = {}
        while decoder.pending:
            results.update({key: r.tokens for (key, _), r in decoder.step()})
        for i, p in enumerate(params):
            assert_same_or_near_tie(f"{name} batched {mode} row {i}", results[i], references[i], p)
    after = _arrays(prefix)
    assert len(before) == len(after) and all(mx.array_equal(a, b).item() for a, b in zip(before, after))


def test_the_head_goes_on_from_the_prefix_as_from_the_whole_prompt(tiny_engine):
    """A row from a prefix feeds the head (MLX, and C++ where built) only its
    own pairs: its state then is what consuming the whole prompt leaves."""
    engine = tiny_engine
    system, prompts = _prompts(engine)
    prefix = engine.prefill_prefix(system)
    assert [c.positions for c in prefix.head] == [[len(system) - 1]] * len(prefix.head)
    ids = prompts[0]
    own, _ = engine.prefill(ids[len(system):], copy_caches(prefix.caches), keep_hidden=True)
    hidden = mx.concatenate([prefix.hidden, own], axis=1)  # as a joining row's
    head, embed = engine.checkpoint.head, engine.text.model.embed_tokens
    whole = head_prefill(head, embed, hidden, ids[1:], engine.prefill_step_size)
    resumed = head_prefill(head, embed, hidden, ids[1:], engine.prefill_step_size, prefix.head)
    for a, b in zip(whole, resumed):
        assert a.positions == b.positions == [len(ids) - 1]
        assert mx.allclose(a.keys[..., : a.idx, :], b.keys[..., : b.idx, :], atol=1e-5).item()
        assert mx.allclose(a.values[..., : a.idx, :], b.values[..., : b.idx, :], atol=1e-5).item()
    with pytest.raises(ValueError, match="head state of"):  # a prefix longer than the row's pairs
        head_prefill(head, embed, hidden, ids[1:10], engine.prefill_step_size, prefix.head)
    cpp, n = engine.drafters.cpp, len(system) - 1
    if cpp is not None:  # the C++ head: a copy of the prefix's session goes on as a whole prompt's session
        whole, resumed = cpp.session(), prefix.head_session.copy()
        _, expected = whole.logits(hidden, ids[1:])
        _, got = resumed.logits(hidden[:, n:], ids[1 + n :])
        assert whole.offset == resumed.offset == len(ids) - 1 and prefix.head_session.offset == n
        assert mx.allclose(mx.array(got), mx.array(expected), atol=1e-4).item()


def test_a_prompt_that_does_not_continue_the_prefix_is_named(tiny_engine):
    prefix = tiny_engine.prefill_prefix("def add(a, b):\n    return")
    with pytest.raises(ValueError, match="does not start with the prefix's"):
        tiny_engine.generate("class Point:", prefix=prefix)
    with pytest.raises(ValueError, match="does not start with the prefix's"):  # nothing of its own after it
        tiny_engine.generate(list(prefix.tokens), prefix=prefix)
    ids = list(prefix.tokens) + tiny_engine.encode(" a + b")
    batch = tiny_engine.generate_batch([ids, "class Point:"], max_tokens=8, prefix=prefix)  # served where it fits
    assert [r.tokens for r in batch] == [tiny_engine.generate(p, max_tokens=8).tokens for p in (ids, "class Point:")]
