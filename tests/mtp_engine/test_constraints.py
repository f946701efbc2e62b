"""Structured outputs (`mtp_engine.constraints`) under speculation, on the
held-out tiny configs of test_sampling.py.

- Lossless: in every mode (`mtp_engine.modes.MODES`, the tree-shaped ones
  too), batched with rows of other constraints and none, greedy and the
  exact sampler, each row's tokens equal plain constrained decoding of its
  prompt alone, computed here from mlx-lm's model one token per forward with
  the grammar's mask applied before `choose`; every speculative mode accepts
  drafts, and the tree-shaped modes' branches that the grammar leaves no
  runner-up for take their sibling's top token.
- Every finished output matches its constraint (a JSON schema with nested
  objects, arrays, enums and numbers, a regex, a choice list, any JSON
  object); one cut by max_tokens first says so.
- The rejection sampler under a constraint is lossless in distribution: the
  joint of the first three tokens matches exact enumeration of the masked
  distribution (chi-square).
- Bad constraints are errors naming the problem.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mtp_engine import MTPEngine
from mtp_engine.constraints import Constraint, ConstraintError, constrain
from mtp_engine.decoder import Decoder
from mtp_engine.modes import MODES, DecodeConfig
from mtp_engine.sampling import GREEDY, SamplingParams, choose, filtered_logprobs
from tests.conftest import PROMPTS
from tests.mtp_engine.test_sampling import HELD_OUT, PlainSampler, chi2, chi2_critical

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["function", "class", "module"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
    },
    "required": ["name", "kind", "score", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,5}(, [a-z]{1,5}){0,2}\."
CHOICES = ("yes", "no", "maybe so")
CONSTRAINTS = [Constraint.json_schema(SCHEMA), Constraint("regex", REGEX), Constraint.choice(CHOICES),
               Constraint("json_object"), None]
N_TOKENS = 40
FALLBACKS: dict[str, int] = {}  # sibling fallbacks taken per lossless run (reported with -s)


def valid(instance, schema: dict) -> bool:
    """A checker for the JSON-schema keywords SCHEMA uses."""
    if "enum" in schema:
        return instance in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(instance, dict) and all(k in instance for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(instance) <= set(props))
                and all(valid(v, props[k]) for k, v in instance.items() if k in props))
    if kind == "array":
        return (isinstance(instance, list) and len(instance) <= schema.get("maxItems", len(instance))
                and all(valid(v, schema["items"]) for v in instance))
    if kind == "string":
        return isinstance(instance, str) and len(instance) <= schema.get("maxLength", len(instance))
    if kind == "integer":
        return isinstance(instance, int) and not isinstance(instance, bool)
    if kind == "number":
        return isinstance(instance, (int, float)) and not isinstance(instance, bool)
    return isinstance(instance, bool) if kind == "boolean" else True


def matches(text: str, constraint: Constraint | None) -> bool:
    if constraint is None:
        return True
    if constraint.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if constraint.kind == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return valid(value, SCHEMA) if constraint.kind == "json_schema" else isinstance(value, dict)


def test_the_checker_can_fail():
    good = {"name": "ab", "kind": "class", "score": 1.5, "tags": ["x"], "owner": {"id": 3, "active": True}}
    assert valid(good, SCHEMA)
    for bad in ({**good, "kind": "enum"}, {**good, "tags": ["x", "y", "z"]}, {**good, "owner": {"id": 3}},
                {**good, "score": "1"}, {**good, "extra": 1}, {**good, "name": "toolong"}):
        assert not valid(bad, SCHEMA), bad


def plain_constrained(plain: PlainSampler, engine: MTPEngine, ids: list[int], params: SamplingParams,
                      constraint: Constraint | None, n: int) -> list[int]:
    """Plain decoding with mlx-lm's model, one token per forward, each
    token chosen from the logits the row's grammar allows."""
    grammar = engine.grammars.row(constraint) if constraint is not None else None
    cache = make_prompt_cache(plain.model)
    logits = plain.model(mx.array(ids)[None], cache=cache)[:, -1:, :]
    tokens = []
    for t in range(n):
        if grammar is not None:
            logits = constrain(logits, engine.grammars.masks([grammar]))
        token = int(choose(logits, [params], mx.array([[t]]))[0, 0].item())
        if token in plain.eos:
            break
        tokens.append(token)
        if grammar is not None and grammar.commit([token]):
            break
        logits = plain.model(mx.array([[token]]), cache=cache)[:, -1:, :]
    return tokens


@pytest.fixture(scope="module", params=sorted(HELD_OUT))
def held_out(request, checkpoint_factory):
    config, kwargs, _ = HELD_OUT[request.param]
    path = checkpoint_factory(f"sampling-{request.param}", config, **kwargs)
    return request.param, MTPEngine.load(path), PlainSampler(path)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "exact"])
def test_constrained_speculation_equals_plain_constrained_decoding(held_out, temperature):
    name, engine, plain = held_out
    prompts = [engine.encode(p) for p in PROMPTS[:10]]
    constraints = [CONSTRAINTS[i % len(CONSTRAINTS)] for i in range(len(prompts))]
    params = [SamplingParams(temperature, top_p=0.95, seed=40 + i) for i in range(len(prompts))]
    want = [plain_constrained(plain, engine, ids, p, c, N_TOKENS) for ids, p, c in zip(prompts, params, constraints)]
    for mode in MODES:
        decoder = Decoder(engine, DecodeConfig(mode=mode, draft_tokens=3, batch_size=4))
        for i, (ids, p, c) in enumerate(zip(prompts, params, constraints)):
            decoder.add(i, ids, [p], max_tokens=N_TOKENS, constraint=c)
        results, fallbacks, steps = {}, engine.grammars.fallbacks, 0
        while decoder.pending:  # mode auto: every other step K drafts, the others as its controller chooses
            steps += 1
            results.update({key: r for (key, _), r in decoder.step(decoder.k if steps % 2 else None)})
        for i, r in results.items():
            assert r.tokens == want[i], f"{name} {mode} T={temperature}: row {i} ({constraints[i]})"
            c = constraints[i]
            if r.finish_reason == "stop":
                assert matches(r.text, c), (mode, i, r.text)
            elif c is not None and not matches(r.text, c):
                assert r.note and "max_tokens (40)" in r.note, r.note
        finished = {constraints[i].kind for i, r in results.items() if constraints[i] and r.finish_reason == "stop"}
        assert {"regex", "choice"} <= finished, finished  # the tiny models' JSON rarely ends in 40 tokens
        if mode != "baseline":
            assert sum(r.stats.accepted for r in results.values()) > 0, (name, mode)
        if mode in ("tree", "adaptive_tree", "paths"):  # branches past what the grammar allows took the top token
            assert engine.grammars.fallbacks > fallbacks, (name, mode)
            FALLBACKS[f"{name} {mode} T={temperature}"] = engine.grammars.fallbacks - fallbacks
    assert any(len(w) == N_TOKENS for w in want) and any(len(w) < N_TOKENS for w in want)


def _masked_joint(plain: PlainSampler, engine: MTPEngine, ids: list[int], params: SamplingParams,
                  constraint: Constraint) -> dict[tuple, float]:
    """Exact probabilities of the first three tokens of plain sampling from
    the distribution the grammar allows."""
    def dist(prefix):
        grammar = engine.grammars.row(constraint)
        grammar.commit(list(prefix))
        logits = constrain(plain.last_logits(ids + list(prefix)), engine.grammars.masks([grammar]))
        lp = filtered_logprobs(logits, params)[0, 0] / params.temperature
        return {t: p for t, p in enumerate(mx.softmax(lp).tolist()) if p > 0}

    joint = Counter()

    def walk(prefix: tuple, p: float) -> None:
        if len(prefix) == 3:
            joint[prefix] += p
            return
        for t, q in dist(prefix).items():
            if t in plain.eos:
                joint[prefix + ("eos",)] += p * q
            else:
                walk(prefix + (t,), p * q)

    walk((), 1.0)
    return joint


def test_rejection_sampler_under_a_constraint_is_lossless_in_distribution(checkpoint_factory):
    name = "l6_fai2_kv1_e8k3"  # one held-out config: the test takes seconds
    config, kwargs, _ = HELD_OUT[name]
    path = checkpoint_factory(f"sampling-{name}", config, **kwargs)
    engine, plain = MTPEngine.load(path), PlainSampler(path)
    constraint = Constraint("regex", r"[a-z ]{1,8}")
    ids = engine.encode(PROMPTS[HELD_OUT[name][2]])
    expected = _masked_joint(plain, engine, ids, SamplingParams(1.0, top_k=3), constraint)
    n, chunk = 2000, 500
    observed, accepted, drafted = Counter(), 0, 0
    for start in range(0, n, chunk):
        decoder = Decoder(engine, DecodeConfig(draft_tokens=2, batch_size=chunk))
        decoder.add("p", ids, [SamplingParams(1.0, top_k=3, seed=s, sampler="rejection")
                               for s in range(start, start + chunk)], max_tokens=3, constraint=constraint)
        while decoder.pending:
            for _, result in decoder.step():
                tokens = tuple(result.tokens)
                observed[tokens + ("eos",) if len(tokens) < 3 else tokens] += 1
                accepted += result.stats.accepted
                drafted += result.stats.drafted
    assert 0 < accepted < drafted, f"{name}: the test needs drafts both accepted and rejected"
    stat, df = chi2(observed, expected, n)
    assert df >= 3 and stat < chi2_critical(df), f"{name}: chi-square {stat:.1f} over {df} degrees of freedom"


def test_bad_constraints_are_named(tiny_engine):
    decoder = Decoder(tiny_engine, DecodeConfig(mode="chain", draft_tokens=2, batch_size=2))
    with pytest.raises(ConstraintError, match="regex"):
        decoder.add(0, "x", [GREEDY], constraint=Constraint("regex", "(unclosed"))
    with pytest.raises(ConstraintError, match="json_schema"):
        decoder.add(0, "x", [GREEDY], constraint=Constraint.json_schema({"type": "nonsense"}))
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{type: object")
    with pytest.raises(ConstraintError, match="choices"):
        Constraint.choice([])
    with pytest.raises(ConstraintError, match="response_format type"):
        Constraint.from_response_format({"type": "yaml"})
    assert not decoder.queue  # nothing was queued


def test_the_engine_takes_constraints_per_prompt_and_for_samples(tiny_engine):
    prompts = ["x", "def f():", "y = "]
    constraints = [Constraint.choice(CHOICES), None, Constraint("regex", REGEX)]
    alone = [tiny_engine.generate(p, mode="baseline", max_tokens=40, constraint=c) for p, c in zip(prompts, constraints)]
    for mode in ("tree", "chain"):
        batch = tiny_engine.generate_batch(prompts, mode=mode, draft_tokens=3, batch_size=3, max_tokens=40,
                                           constraint=constraints)
        assert [r.tokens for r in batch] == [r.tokens for r in alone], mode
    assert batch[0].finish_reason == "stop" and batch[0].text in CHOICES
    assert not matches(batch[1].text, constraints[2]) and (batch[2].finish_reason != "stop"
                                                           or matches(batch[2].text, constraints[2]))
    every = tiny_engine.generate_batch(prompts, mode="adaptive_tree", max_tokens=40, constraint=constraints[0])
    assert all(r.text in CHOICES for r in every)
    regex = Constraint("regex", REGEX)
    samples = tiny_engine.generate_samples("x", seeds=[1, 2, 3], mode="paths", temperature=0.9, max_tokens=40,
                                           constraint=regex)
    for seed, r in zip([1, 2, 3], samples):
        plain = tiny_engine.generate("x", mode="baseline", temperature=0.9, seed=seed, max_tokens=40, constraint=regex)
        assert r.tokens == plain.tokens and (r.finish_reason != "stop" or matches(r.text, regex)), seed
    with pytest.raises(ValueError, match="2 constraints for 3 prompts"):
        list(tiny_engine.generate_batch_iter(prompts, constraint=constraints[:2]))


def test_a_complete_grammar_stops_and_a_cut_one_says_so(tiny_engine):
    decoder = Decoder(tiny_engine, DecodeConfig(mode="chain", draft_tokens=3, batch_size=2))
    decoder.add("choice", "x", [GREEDY], max_tokens=50, constraint=Constraint.choice(CHOICES))
    decoder.add("cut", "x", [GREEDY], max_tokens=3, constraint=Constraint.json_schema(SCHEMA))
    results = {}
    while decoder.pending:
        results.update({key: r for (key, _), r in decoder.step()})
    assert results["choice"].finish_reason == "stop" and results["choice"].text in CHOICES
    assert results["choice"].note is None
    cut = results["cut"]
    assert cut.finish_reason == "length" and len(cut.tokens) == 3
    assert cut.note == "max_tokens (3) ended the output before it matched the JSON schema"
    assert tiny_engine.generate("x", max_tokens=50, constraint=Constraint.choice(CHOICES)).text == results["choice"].text
