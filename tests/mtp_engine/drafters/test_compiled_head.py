"""The compiled draft forward (`mtp_engine.compiled_head`) drafts what the
eager head drafts, keeps the head's KV cache the same, and falls back where
it cannot run."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtp_engine import MTPEngine
from mtp_engine.cache.batch import BatchKVCache
from mtp_engine.drafters.compiled_head import CompiledHead, can_compile_head
from mtp_engine.drafters.head import HeadDrafter
from mtp_engine.io.tiny import tiny_config
from mtp_engine.modes import DecodeConfig
from mtp_engine.options import MAX_VERIFY_WIDTH
from mtp_engine.sampling import GREEDY
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def two_layer_engine(checkpoint_factory):
    """A head with two MTP layers, so the pieces between layers run too."""
    path = checkpoint_factory("mtp2", tiny_config(mtp_num_hidden_layers=2), seed=3, predictability=0.4)
    return MTPEngine.load(path)


def forwards(engine):
    """The head's forward eager, and as the drafter runs it with its compiled
    pieces (forwards of up to MAX_VERIFY_WIDTH pairs)."""
    head, embed = engine.checkpoint.head, engine.model.model.embed_tokens
    compiled = CompiledHead(head, embed)

    def eager(hidden, ids, cache):
        return head(hidden, embed(ids), cache)

    def fast(hidden, ids, cache):
        return compiled.hiddens(hidden, ids, cache) if ids.shape[1] <= MAX_VERIFY_WIDTH else eager(hidden, ids, cache)
    return eager, fast


def run_chain(forward, engine, prompt_ids: list[int], pending: int, steps: int):
    """Prefill the head over the prompt less its last ``pending`` pairs, then
    one forward over those pairs and ``steps`` single-pair steps. Returns the
    logits and tokens of every forward and the head's cache arrays."""
    model = engine.model
    hidden = model.model(mx.array(prompt_ids)[None], cache=model.make_cache())
    pairs = prompt_ids[1:] + [5]
    cache = [BatchKVCache(1) for _ in engine.checkpoint.head.layers]
    split = len(pairs) - pending
    forward(hidden[:, :split], mx.array(pairs[:split])[None], cache)
    m = forward(hidden[:, split:], mx.array(pairs[split:])[None], cache)[:, -1:]
    out_logits, out_tokens = [], []
    for _ in range(steps + 1):
        logits = engine.lm_head(m)[0, 0]
        out_logits.append(logits)
        out_tokens.append(int(mx.argmax(logits)))
        m = forward(m, mx.array([[out_tokens[-1]]]), cache)
    kv = [a[..., : c.idx, :] for c in cache for a in (c.keys, c.values)]
    return out_logits, out_tokens, kv


@pytest.mark.parametrize("engine_name", ["tiny_engine", "two_layer_engine"])
@pytest.mark.parametrize("pending", [1, 4])
def test_compiled_head_drafts_what_the_eager_head_drafts(request, engine_name, pending):
    engine = request.getfixturevalue(engine_name)
    eager, compiled = forwards(engine)
    ids = engine.encode(PROMPTS[0] + " " + PROMPTS[2])
    want = run_chain(eager, engine, ids, pending, steps=6)
    got = run_chain(compiled, engine, ids, pending, steps=6)
    assert got[1] == want[1]
    for a, b in zip(got[0], want[0]):
        assert mx.allclose(a, b, atol=1e-5).item()
    # The head's KV cache ends the same: both forwards wrote the same entries.
    assert len(got[2]) == len(want[2])
    for a, b in zip(got[2], want[2]):
        assert a.shape == b.shape
        assert mx.allclose(a, b, atol=1e-5).item()


def test_wide_forwards_run_eagerly(tiny_engine):
    """A head forward wider than MAX_VERIFY_WIDTH takes the eager path (a
    new trace per prompt length would cost more than it saves)."""
    engine = tiny_engine
    compiled = CompiledHead(engine.checkpoint.head, engine.model.model.embed_tokens)
    drafter = HeadDrafter(engine.checkpoint.head, engine.model.model.embed_tokens, engine.lm_head, compiled=compiled)
    calls = []
    original = compiled._enter

    def counting(*args):
        calls.append(args[1].shape[1])
        return original(*args)

    compiled._enter = counting
    ids = list(range(3, 3 + MAX_VERIFY_WIDTH + 8))
    hidden = engine.model.model(mx.array(ids)[None], cache=engine.model.make_cache())
    drafter.add_row(None, hidden, ids[1:] + [5])  # the prompt's head prefill: eager
    for pending, want in ((3, [3, 1, 1]), (MAX_VERIFY_WIDTH + 2, [1, 1])):
        calls.clear()
        drafter.commit(hidden[:, :pending], [ids[1 : pending + 1]], [0])
        drafter.propose(DecodeConfig(), 3, [GREEDY], [0], [3]).tokens.tolist()
        assert calls == want


@pytest.mark.parametrize("mode", [dict(mode="chain", draft_tokens=4), dict(mode="tree", draft_tokens=3),
                                  dict(mode="paths", draft_tokens=3, paths=2)])
def test_engine_with_compiled_head_equals_the_eager_head(tiny_path, tiny_engine, mode):
    eager = MTPEngine.load(tiny_path, compile_head=False)
    assert tiny_engine.drafters.compiled is not None and eager.drafters.compiled is None
    assert tiny_engine.make_drafter(tiny_engine.pick_drafter(mode["mode"], "mlx-eager")).compiled is None
    for prompt in PROMPTS[:4]:
        a = tiny_engine.generate(prompt, max_tokens=32, drafter="mlx", trace=True, **mode)
        b = eager.generate(prompt, max_tokens=32, drafter="mlx", trace=True, **mode)
        c = tiny_engine.generate(prompt, max_tokens=32, drafter="mlx-eager", trace=True, **mode)
        assert a.tokens == b.tokens == c.tokens
        assert [s.drafts for s in a.trace] == [s.drafts for s in b.trace] == [s.drafts for s in c.trace]


def test_heads_with_scaled_rope_draft_eagerly(checkpoint_factory):
    """RoPE variants that may not take an array position keep the eager head."""
    config = tiny_config(rope_scaling={"type": "dynamic", "factor": 2.0})
    engine = MTPEngine.load(checkpoint_factory("dynamic-rope", config, seed=4))
    assert not can_compile_head(engine.checkpoint.head)
    assert engine.drafters.compiled is None
    with pytest.raises(ValueError, match="nn.RoPE"):
        CompiledHead(engine.checkpoint.head, engine.model.model.embed_tokens)
    result = engine.generate(PROMPTS[0], max_tokens=8, mode="tree", draft_tokens=2)
    assert len(result.tokens) == 8
