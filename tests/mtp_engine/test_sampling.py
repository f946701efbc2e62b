"""Sampling (`mtp_engine.sampling`) on held-out tiny configs.

- The exact sampler: every mode, and batched speculation at any batch size,
  K and batch composition, emits the tokens plain sampling emits for the
  seed, token for token. Plain sampling is computed here from mlx-lm's own
  model (`mlx_lm.load`, one token per forward) and the sampler's definition
  (`choose`). A divergence is allowed only on a numerical near-tie at that
  position: of the two best perturbed scores, or of a filter's decision on
  either token (a log-probability at the min-p or top-k cut, a mass at the
  top-p cut), where a rounding difference moves a token in or out of the
  support.
- Its marginal is ``softmax(filtered_logits / T)``: chi-square over
  thousands of deterministic seeds, fixed threshold.
- The rejection sampler is lossless in distribution: the joint distribution
  of the first 3 tokens (top_k = 3: 27 sequences) over thousands of seeds
  matches exact enumeration under plain sampling (chi-square, fixed
  threshold); its batched tokens equal its one-sequence tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mtp_engine import MTPEngine
from mtp_engine.decoder import Decoder
from mtp_engine.modes import DecodeConfig
from mtp_engine.io.tiny import tiny_config
from mtp_engine.sampling import (
    GREEDY,
    SamplingParams,
    choose,
    draft_choice,
    draft_noise,
    filtered_logprobs,
    gumbel,
    scaled_logprobs,
)
from tests.conftest import PROMPTS

# Configs no other test uses (held out from development of the sampler),
# with a prompt whose next-token distribution is spread (distribution tests).
HELD_OUT = {
    "l5_fai5_kv2_e6k2": (tiny_config(num_hidden_layers=5, full_attention_interval=5, num_experts=6),
                         dict(seed=21, predictability=0.5), 4),
    "l6_fai2_kv1_e8k3": (tiny_config(num_hidden_layers=6, full_attention_interval=2, linear_num_key_heads=4,
                                     num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
                         dict(seed=22, predictability=0.35), 9),
}
SETTINGS = [
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0, top_k=20, min_p=0.05),
]
N_TOKENS = 40
# Gap between the two best perturbed scores (units of logprob / T) under
# which a divergence counts as a numerical near-tie. MLX's CUDA float32
# products differ more between a batched and a one-token pass (a gap of
# 2.3e-3 was seen on the H200) than its CPU backend's.
NEAR_TIE = 1e-3 if mx.default_device() == mx.cpu else 1e-2


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square statistic exceeded with probability ~0.001 (z = 3.09),
    by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(observed: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expecting fewer
    than 5 are pooled."""
    stat, df, pooled_o, pooled_e = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pooled_o += observed.get(cell, 0)
            pooled_e += e
            continue
        stat += (observed.get(cell, 0) - e) ** 2 / e
        df += 1
    outside = n - sum(observed.get(c, 0) for c in expected)
    assert outside == 0, f"{outside} samples fell outside the filtered support"
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-9)
        df += 1
    return stat, df


@dataclass
class Reference:
    """Plain sampling's tokens and, per position, the gap between the two
    best perturbed scores (greedy: log-probabilities) and the logits."""

    tokens: list[int]
    gaps: list[float]
    logits: list[mx.array]


class PlainSampler:
    """Plain sampling from mlx-lm's model of a folder, one token per forward."""

    def __init__(self, path):
        from mlx_lm.utils import load

        self.model, self.tokenizer = load(str(path))
        self.eos = set(self.tokenizer.eos_token_ids)

    def sample(self, ids: list[int], params: SamplingParams, n: int) -> Reference:
        """``n`` tokens of plain sampling with their scores' gaps (penalties
        applied by `penalized`, not by the engine's code)."""
        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(ids)[None], cache=cache)[:, -1:, :]
        out = Reference([], [], [])
        for t in range(n):
            logits = penalized(logits, params, out.tokens)
            token = int(choose(logits, [params], mx.array([[t]]))[0, 0].item())
            if params.greedy:
                score = logits[0, 0] - mx.logsumexp(logits[0, 0])
            else:
                score = (scaled_logprobs(logits, [params]) + gumbel([params.seed], mx.array([[t]]),
                                                                    logits.shape[-1]))[0, 0]
            top2 = mx.sort(score)[-2:]
            out.tokens.append(token)
            out.gaps.append(float(top2[1] - top2[0]))
            out.logits.append(logits[0, 0])
            logits = self.model(mx.array([[token]]), cache=cache)[:, -1:, :]
        return out

    def last_logits(self, ids: list[int]) -> mx.array:
        return self.model(mx.array(ids)[None])[:, -1:, :]


def penalized(logits: mx.array, params: SamplingParams, generated: list[int]) -> mx.array:
    """``[1, 1, V]`` logits with the penalties applied token by token in
    Python, from their definitions (Hugging Face's repetition penalty, then
    OpenAI's presence and frequency penalties, over the generated tokens)."""
    if not params.penalized or not generated:
        return logits
    row = logits[0, 0].astype(mx.float32).tolist()
    for token, count in Counter(generated).items():
        x = row[token]
        x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        row[token] = x - params.presence_penalty - params.frequency_penalty * count
    return mx.array(row, dtype=mx.float32).astype(logits.dtype)[None, None]


def filter_margin(logits: mx.array, params: SamplingParams, token: int) -> float:
    """How near ``token``'s membership of the filtered support is to
    flipping: the least distance of a filter's deciding quantity from its
    cut (log-probabilities for min-p and top-k, probability mass for top-p,
    as `mlx_lm.sample_utils` decides them). Infinite with no filter (and
    for greedy decoding, which filters nothing)."""
    if params.greedy:
        return math.inf
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp)
    own = float(lp[token])
    margins = [math.inf]
    if params.min_p > 0:
        margins.append(abs(own - (float(lp.max()) + math.log(params.min_p))))
    if 0 < params.top_k < lp.shape[-1]:
        ordered = mx.sort(lp)[::-1]  # likeliest first
        kept = own >= float(ordered[params.top_k - 1])
        margins.append(own - float(ordered[params.top_k]) if kept else float(ordered[params.top_k - 1]) - own)
    if params.top_p < 1:
        order = mx.argsort(lp)  # ascending, as apply_top_p sorts
        probs = mx.exp(lp[order])
        mass_above = mx.cumsum(probs, reverse=True, inclusive=False)
        at = int(mx.argmax(order == token))
        margins.append(abs(float(mass_above[at]) - params.top_p * float(mass_above[0] + probs[0])))
    return min(margins)


@pytest.fixture(scope="module", params=sorted(HELD_OUT))
def held_out(request, checkpoint_factory):
    config, kwargs, _ = HELD_OUT[request.param]
    path = checkpoint_factory(f"sampling-{request.param}", config, **kwargs)
    return request.param, MTPEngine.load(path), PlainSampler(path)


def spread_prompt(engine: MTPEngine, name: str) -> list[int]:
    return engine.encode(PROMPTS[HELD_OUT[name][2]])


def assert_same_or_near_tie(name: str, got: list[int], reference: Reference, params: SamplingParams) -> None:
    want = reference.tokens[: len(got)]
    if got == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    gap = reference.gaps[i]
    margin = min(filter_margin(reference.logits[i], params, t) for t in (got[i], want[i]))
    assert min(gap, margin) < NEAR_TIE, (
        f"{name}: first divergence at token {i} ({got[i]} vs {want[i]}) is not a near-tie "
        f"(gap {gap:.2e}, filter margin {margin:.2e})")


@pytest.mark.parametrize("setting", SETTINGS, ids=["T0.8-top_p0.9", "T1.0-top_k20-min_p0.05"])
def test_exact_sampler_every_mode_equals_plain_sampling(held_out, setting):
    name, engine, plain = held_out
    modes = [("baseline", {}), ("chain", dict(draft_tokens=3)), ("adaptive", dict(draft_tokens=4)),
             ("tree", dict(draft_tokens=3)), ("adaptive_tree", dict(draft_tokens=3)),
             ("paths", dict(draft_tokens=3, paths=2))]
    for i, prompt in enumerate(PROMPTS[:4]):
        ids = engine.encode(prompt)
        seed = 1000 + i
        reference = plain.sample(ids, SamplingParams(seed=seed, **setting), N_TOKENS)
        for mode, kw in modes:
            result = engine.generate(ids, mode=mode, max_tokens=N_TOKENS, seed=seed, **setting, **kw)
            assert result.stats.seed == seed
            assert_same_or_near_tie(f"{name} {mode} prompt {i}", result.tokens, reference,
                                    SamplingParams(seed=seed, **setting))


PENALTIES = [dict(repetition_penalty=1.4), dict(presence_penalty=1.0, frequency_penalty=0.6)]


def test_penalties_under_speculation_equal_plain_decoding_with_them(held_out):
    """Penalties change the tokens (the test can fail), and every mode, and
    a batch mixing penalized and unpenalized rows, emits what plain decoding
    with the same penalties emits (its positions in a verify forward each
    see the drafts before them)."""
    name, engine, plain = held_out
    temperature = 0.0 if name == min(HELD_OUT) else 0.8  # greedy on one config, the exact sampler on the other
    prompts = [engine.encode(p) for p in PROMPTS[:3]]
    settings = [SamplingParams(temperature=temperature, seed=50 + i, **pen)
                for i, pen in enumerate(PENALTIES + [{}])]
    references = [plain.sample(ids, p, N_TOKENS) for ids, p in zip(prompts, settings)]
    unpenalized = [plain.sample(ids, SamplingParams(temperature=temperature, seed=p.seed), N_TOKENS)
                   for ids, p in zip(prompts[:2], settings[:2])]
    assert any(r.tokens != u.tokens for r, u in zip(references, unpenalized))
    for i, (ids, params) in enumerate(zip(prompts, settings)):
        for mode in ("baseline", "chain", "tree"):
            result = engine.generate(ids, mode=mode, max_tokens=N_TOKENS, sampling=params, draft_tokens=3)
            assert_same_or_near_tie(f"{name} {mode} row {i}", result.tokens, references[i], params)
    for mode in ("chain", "auto"):
        decoder = Decoder(engine, DecodeConfig(mode=mode, draft_tokens=3, batch_size=3))
        for i, (ids, params) in enumerate(zip(prompts, settings)):
            decoder.add(i, ids, [params], max_tokens=N_TOKENS)
        results = {}
        while decoder.pending:
            results.update({key: r.tokens for (key, _), r in decoder.step()})
        for i, params in enumerate(settings):
            assert_same_or_near_tie(f"{name} batched {mode} row {i}", results[i], references[i], params)


def test_logprobs_under_speculation_equal_plain_decodings(held_out, temperature=0.9):
    """Each token's log-probability and its alternatives, in every mode and
    batched, equal those of plain decoding's logits (mlx-lm's model, one
    token per forward) within 1e-4: log-softmax, the row's filters when it
    samples, before the temperature (greedy rows: in the jobs' test)."""
    name, engine, plain = held_out
    params = [SamplingParams(temperature=temperature, top_p=0.9, seed=90 + i) for i in range(3)]
    prompts = [engine.encode(p) for p in PROMPTS[:3]]
    references = [plain.sample(ids, p, N_TOKENS) for ids, p in zip(prompts, params)]

    def check(label, result, reference, p):
        assert len(result.logprobs) == len(result.tokens)
        for j, (token, want) in enumerate(zip(result.tokens, reference.tokens)):
            if token != want:  # a near-tie parted them (assert_same_or_near_tie): compare up to it
                break
            lp = reference.logits[j][None, None]
            lp = (filtered_logprobs(lp, p) if not p.greedy else lp - mx.logsumexp(lp, axis=-1, keepdims=True))[0, 0]
            got, alternatives = result.logprobs[j]
            assert abs(got - lp[token].item()) < 1e-4, f"{label} token {j}"
            kept = int(mx.sum(lp > -math.inf).item())  # the filters may keep fewer than 3
            assert len(alternatives) == min(3, kept) and alternatives[0][1] >= alternatives[-1][1]
            for t, value in alternatives:
                assert abs(value - lp[t].item()) < 1e-4, f"{label} token {j} alternative {t}"
            assert alternatives[0][1] >= lp.max().item() - 1e-4
    for mode in ("baseline", "chain", "tree"):
        for i, (ids, p) in enumerate(zip(prompts, params)):
            result = engine.generate(ids, mode=mode, max_tokens=N_TOKENS, sampling=p, draft_tokens=3, logprobs=3)
            assert_same_or_near_tie(f"{name} {mode} row {i}", result.tokens, references[i], p)
            check(f"{name} {mode} row {i}", result, references[i], p)
    decoder = Decoder(engine, DecodeConfig(mode="auto", draft_tokens=3, batch_size=3))
    for i, (ids, p) in enumerate(zip(prompts, params)):
        decoder.add(i, ids, [p], max_tokens=N_TOKENS, logprobs=3 if i != 1 else None)
    results = {}
    while decoder.pending:
        results.update({key: r for (key, _), r in decoder.step()})
    assert results[1].logprobs is None
    for i in (0, 2):
        check(f"{name} batched auto row {i}", results[i], references[i], params[i])


@pytest.mark.parametrize("batch_size,k", [(1, 2), (3, 0), (3, 4), (8, 2)])
def test_exact_sampler_batched_equals_plain_sampling_whatever_the_batch(held_out, batch_size, k):
    """Rows of different settings, budgets and seeds (one greedy) share
    batches; each row's tokens are its own plain sampling."""
    name, engine, plain = held_out
    rows = []
    for i, prompt in enumerate(PROMPTS[:7]):
        setting = {} if i == 3 else SETTINGS[i % 2]
        params = SamplingParams(seed=77 + 13 * i, **setting)
        rows.append((i, engine.encode(prompt), params, 12 + 5 * i))
    decoder = Decoder(engine, DecodeConfig(mode="chain" if k else "baseline", draft_tokens=k or 1,
                                           batch_size=batch_size))
    for i, ids, params, budget in rows:
        decoder.add(i, ids, [params], max_tokens=budget)
    results = {}
    while decoder.pending:
        results.update({key: r for (key, _), r in decoder.step()})
    for i, ids, params, budget in rows:
        reference = plain.sample(ids, params, budget)
        assert_same_or_near_tie(f"{name} B={batch_size} K={k} row {i}", results[i].tokens, reference, params)


def test_auto_drafter_gives_way_to_the_mlx_head_for_the_first_sampled_row(held_out):
    """On the CPU "auto" drafts with the C++ head, which drafts greedily:
    a sampled row waits until the greedy rows in flight finish, then the
    MLX head drafts; every row still equals its plain decoding."""
    name, engine, plain = held_out
    if engine.drafters.cpp is None:
        pytest.skip("needs the C++ drafter")
    rows = [(i, engine.encode(p), SamplingParams(seed=5 + i, **({} if i < 2 else SETTINGS[i % 2])), 10 + 4 * i)
            for i, p in enumerate(PROMPTS[:5])]  # two greedy rows, then three sampled
    decoder = Decoder(engine, DecodeConfig(draft_tokens=2, batch_size=3))
    for i, ids, params, budget in rows:
        decoder.add(i, ids, [params], max_tokens=budget)
    results, drafters = {}, []
    while decoder.pending:
        results.update({key: r for (key, _), r in decoder.step()})
        drafters.append((decoder.drafter.name, sorted(r.key[0] for r in decoder.rows)))
    assert drafters[0] == ("cpp", [0, 1])  # the sampled rows wait for the greedy ones
    assert drafters[-1][0] == "mlx" and all(keys == [] or min(keys) >= 2 for d, keys in drafters if d == "mlx")
    for i, ids, params, budget in rows:
        assert_same_or_near_tie(f"{name} auto drafter row {i}", results[i].tokens, plain.sample(ids, params, budget),
                                params)


def test_n_samples_share_a_prefill_and_equal_single_generations(held_out):
    _, engine, _ = held_out
    ids = engine.encode(PROMPTS[0])
    seeds = [5, 6, 7]
    shared = engine.generate_samples(ids, seeds=seeds, max_tokens=24, mode="chain", temperature=0.9)
    for seed, result in zip(seeds, shared):
        assert result.tokens == engine.generate(ids, max_tokens=24, mode="chain", temperature=0.9, seed=seed).tokens
    assert len({tuple(r.tokens) for r in shared}) > 1, "different seeds gave one completion"
    decoder = Decoder(engine, DecodeConfig(draft_tokens=3, batch_size=4))
    decoder.add("p", ids, [SamplingParams(0.9, seed=s) for s in seeds], max_tokens=24)
    batched = {}
    while decoder.pending:
        batched.update(decoder.step())
    assert [batched[("p", j)].tokens for j in range(3)] == [r.tokens for r in shared]


@pytest.mark.parametrize("setting", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.8, top_k=50, min_p=0.02)])
def test_exact_sampler_marginal_is_the_filtered_softmax(held_out, setting):
    """The first token over 4000 seeds against softmax(filtered / T)."""
    name, engine, plain = held_out
    ids = spread_prompt(engine, name)
    n = 4000
    decoder = Decoder(engine, DecodeConfig(mode="baseline", batch_size=n))
    decoder.add("p", ids, [SamplingParams(seed=s, **setting) for s in range(n)], max_tokens=1)
    finished = dict(decoder.step())
    # An end-of-sequence token ends the completion before it: an empty one.
    observed = Counter(r.tokens[0] if r.tokens else "eos" for r in (finished[("p", j)] for j in range(n)))
    params = SamplingParams(**setting)
    probs = mx.softmax(filtered_logprobs(plain.last_logits(ids), params)[0, 0] / params.temperature).tolist()
    expected = Counter()
    for t, p in enumerate(probs):
        if p > 0:
            expected["eos" if t in engine.eos_token_ids else t] += p
    stat, df = chi2(observed, expected, n)
    assert df >= 3, "too few cells to test"
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} over {df} degrees of freedom"


def _enumerate_three(plain: PlainSampler, ids: list[int], params: SamplingParams) -> dict[tuple, float]:
    """Exact probabilities of the first three tokens under plain sampling."""
    def dist(prefix):
        lp = filtered_logprobs(plain.last_logits(ids + list(prefix)), params)[0, 0] / params.temperature
        return {t: p for t, p in enumerate(mx.softmax(lp).tolist()) if p > 0}

    # A completion ends at an end-of-sequence token (not emitted): such
    # sequences are one cell, the tokens before it and "eos".
    joint = Counter()

    def walk(prefix: tuple, p: float) -> None:
        if len(prefix) == 3:
            joint[prefix] += p
            return
        for t, q in dist(prefix).items():
            if t in eos:
                joint[prefix + ("eos",)] += p * q
            else:
                walk(prefix + (t,), p * q)

    eos = plain.eos
    walk((), 1.0)
    return joint


def test_rejection_sampler_joint_of_three_tokens_equals_plain_sampling(held_out):
    name, engine, plain = held_out
    k = 2 if name.startswith("l5") else 3
    ids = spread_prompt(engine, name)
    params = SamplingParams(temperature=1.0, top_k=3, sampler="rejection")
    expected = _enumerate_three(plain, ids, params)
    n, chunk = 6000, 500
    observed, accepted, drafted = Counter(), 0, 0
    for start in range(0, n, chunk):
        decoder = Decoder(engine, DecodeConfig(draft_tokens=k, batch_size=chunk))
        decoder.add("p", ids, [SamplingParams(1.0, top_k=3, seed=s, sampler="rejection")
                               for s in range(start, start + chunk)], max_tokens=3)
        while decoder.pending:
            for _, result in decoder.step():
                tokens = tuple(result.tokens)
                observed[tokens + ("eos",) if len(tokens) < 3 else tokens] += 1
                accepted += result.stats.accepted
                drafted += result.stats.drafted
    assert 0 < accepted < drafted, f"{name}: the test needs drafts both accepted and rejected"
    stat, df = chi2(observed, expected, n)
    assert stat < chi2_critical(df), f"{name} K={k}: chi-square {stat:.1f} over {df} degrees of freedom"


def test_rejection_sampler_batched_tokens_equal_one_sequence(held_out):
    """Rejection tokens depend on the seed, mode and K, not on the batch."""
    _, engine, _ = held_out
    prompts = [engine.encode(p) for p in PROMPTS[:5]]
    budgets = [13, 20, 7, 31, 16]
    results = engine.generate_batch(prompts, batch_size=3, seed=[1, 5, 7, 9, 11], temperature=0.9,
                                    max_tokens=budgets, draft_tokens=3, sampler="rejection")
    for ids, seed, budget, result in zip(prompts, [1, 5, 7, 9, 11], budgets, results):
        single = engine.generate(ids, seed=seed, temperature=0.9, max_tokens=budget, mode="chain", draft_tokens=3,
                                 sampler="rejection")
        assert result.tokens == single.tokens


def test_filter_margins_find_the_tokens_at_a_cut():
    """The near-tie rule's filter margins: small exactly for a token whose
    membership of the filtered support a rounding could flip."""
    logits = mx.log(mx.array([0.5, 0.30001, 0.149, 0.025001, 0.02, 0.005989]))  # sums to 1
    kept = lambda params: mx.isfinite(filtered_logprobs(logits, params)).tolist()  # noqa: E731
    min_p = SamplingParams(1.0, min_p=0.05)  # cut at 0.05 x 0.5: token 3 just inside, 4 well outside
    assert kept(min_p) == [True, True, True, True, False, False]
    assert filter_margin(logits, min_p, 3) < 1e-3 and filter_margin(logits, min_p, 0) > 1
    top_k = SamplingParams(1.0, top_k=3)  # token 2 is the last kept, token 3 the first dropped
    assert filter_margin(logits, top_k, 2) > 1 and filter_margin(logits, top_k, 3) > 1
    close = mx.log(mx.array([0.5, 0.3, 0.1, 0.1 - 1e-6]))
    assert filter_margin(close, top_k, 2) < 1e-3 and filter_margin(close, top_k, 3) < 1e-3
    top_p = SamplingParams(1.0, top_p=0.8)  # the mass above token 2 (0.80001) just reaches 0.8: on the cut
    assert kept(top_p)[:3] == [True, True, False]
    assert filter_margin(logits, top_p, 2) < 1e-3 and filter_margin(logits, top_p, 1) > 0.1
    assert filter_margin(logits, SamplingParams(1.0), 3) == math.inf


def test_bad_penalties_are_named():
    for kwargs, message in ((dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
                            (dict(presence_penalty=3), "presence_penalty must be a number in \\[-2, 2\\]"),
                            (dict(frequency_penalty="1"), "frequency_penalty must be a number")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


def test_bad_sampling_values_are_named():
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(temperature=1, top_p=0)
    with pytest.raises(ValueError, match="sampler must be one of exact, rejection, got 'gumbel'"):
        SamplingParams(sampler="gumbel")


def test_draft_noise_makes_the_drafts_an_argmax_of_the_raw_logits():
    """`draft_noise` is what the CUDA chain kernel adds to the head's logits:
    argmax(logits + noise) is `draft_choice`'s draft for greedy and
    exact-sampler rows, at each row's generated positions."""
    params = [SamplingParams(temperature=0.7, seed=3), GREEDY, SamplingParams(temperature=1.4, seed=8)]
    starts, k, vocab = [0, 5, 17], 4, 300
    logits = 3 * mx.random.normal((3, k, vocab), key=mx.random.key(1))
    noise = draft_noise(params, starts, k, vocab)
    assert noise.shape == (3, k, vocab) and noise.dtype == mx.float32
    assert not mx.any(noise[1]).item()  # the greedy row's
    got = mx.argmax(logits + noise, axis=-1)
    want = mx.concatenate([draft_choice(logits[:, j : j + 1], params, mx.array(starts)[:, None] + j)[0]
                           for j in range(k)], axis=1)
    assert got.tolist() == want.tolist()
    assert len({tuple(r) for r in got.tolist()}) == 3
    assert draft_noise([GREEDY] * 2, [0, 0], k, vocab) is None
    with pytest.raises(ValueError, match="rejection-sampler rows draft from the head's distribution"):
        draft_noise([SamplingParams(temperature=1.0, sampler="rejection")], [0], k, vocab)
