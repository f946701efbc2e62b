"""The MTP head's draft steps in C++ (`native/cpp_drafter.cpp`,
`mtp_engine.drafters.cpp_head`): the same logits as the MLX head (to float32
rounding), the same drafts, decoding still equal to plain decoding, its cache
bookkeeping, bad input named, and heads it cannot run left to MLX."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtp_engine import MTPEngine
from mtp_engine.cache.capture import make_main_cache
from mtp_engine.drafters import cpp_head
from mtp_engine.model.head_weights import UnsupportedHead, head_weights
from mtp_engine.io.tiny import tiny_config
from mtp_engine.model.mtp_head import build_models
from mtp_engine.modes import DecodeConfig
from mtp_engine.sampling import GREEDY

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or cpp_head.extension() is None,
    reason="needs MLX's CPU backend and the _mtp_cpp_drafter extension (make install builds it)",
)

CONFIGS = {
    "default": tiny_config(),
    "two_mtp_layers": tiny_config(mtp_num_hidden_layers=2),
    "tied_one_kv_head": tiny_config(tie_word_embeddings=True, num_key_value_heads=1),
    "wide_heads_top1": tiny_config(head_dim=32, num_experts_per_tok=1, norm_topk_prob=False,
                                   partial_rotary_factor=0.5),
}


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    return {name: MTPEngine.load(checkpoint_factory(f"drafter-{name}", cfg, seed=3))
            for name, cfg in CONFIGS.items()}


def prompt_hidden(engine, text):
    ids = engine.encode(text)
    hidden = engine.model.model(mx.array(ids)[None], cache=make_main_cache(engine.model))
    mx.eval(hidden)
    return ids, hidden


def drafter_with(engine, kind, hidden, pairs):
    """A fresh drafter of ``kind`` with one row whose prompt pairs are ``pairs``."""
    drafter = engine.make_drafter(kind)
    drafter.add_row(None, hidden, pairs)
    return drafter


def propose(drafter, k, mode="chain", tau=0.5):
    """Each row's drafts (the ones it uses), greedy."""
    rows = drafter.rows
    p = drafter.propose(DecodeConfig(mode=mode, tau=tau), k, [GREEDY] * rows, [0] * rows, [k] * rows)
    return [t[:u] for t, u in zip(p.tokens.tolist(), p.uses or [k] * rows)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_the_mlx_heads_to_float_rounding(engines, name):
    engine = engines[name]
    assert engine.drafters.cpp is not None, "the engine should draft in C++ on the CPU"
    ids, hidden = prompt_hidden(engine, "def add(a, b):\n    return a + b\n")
    pairs = ids[1:] + [5]
    head, embed = engine.checkpoint.head, engine.model.model.embed_tokens
    cache = head.make_cache()
    m = head(hidden, embed(mx.array(pairs)[None]), cache)[:, -1:]
    want = engine.lm_head(m)[0, 0]
    session = engine.drafters.cpp.session()
    m_native, got = session.logits(hidden[0], pairs)
    assert mx.allclose(mx.array(got), want, rtol=1e-4, atol=1e-4).item()
    assert mx.allclose(mx.array(m_native), m.reshape(-1), rtol=1e-4, atol=1e-4).item()
    # Two more steps from the head's own hidden, at the next positions.
    token = int(mx.argmax(want))
    for _ in range(2):
        m = head(m, embed(mx.array([[token]])), cache)
        want = engine.lm_head(m)[0, 0]
        m_in = mx.array(m_native)[None]
        m_native, got = session.logits(m_in, [token])
        assert mx.allclose(mx.array(got), want, rtol=1e-4, atol=1e-4).item()
        token = int(mx.argmax(want))
    assert session.offset == cache[0].offset


@pytest.mark.parametrize("name", ["default", "two_mtp_layers"])
def test_chain_and_adaptive_drafts_equal_the_mlx_drafters(engines, name):
    engine = engines[name]
    for text in ("class Point:", "for i in range(10):", "Hello"):
        ids, hidden = prompt_hidden(engine, text)
        pairs = ids[1:] + [7]
        assert propose(drafter_with(engine, "cpp", hidden, pairs), 5) == \
            propose(drafter_with(engine, "mlx", hidden, pairs), 5)
        for tau in (0.9, 0.3, 0.01):
            assert propose(drafter_with(engine, "cpp", hidden, pairs), 6, "adaptive", tau) == \
                propose(drafter_with(engine, "mlx", hidden, pairs), 6, "adaptive", tau)


@pytest.mark.parametrize("name", ["default", "two_mtp_layers"])
def test_drafting_several_generations_together_drafts_what_each_drafts_alone(engines, name):
    engine = engines[name]
    # Nine: from eight on, each half of the rows drafts on a thread of its own.
    texts = ("class Point:", "for i in range(10):\n    print(i)", "Hello", "import os", "x = 1", "def f(a):",
             "while True:\n    pass", "# a comment", "print('hi')")
    prompts = [prompt_hidden(engine, t) for t in texts]
    alone = [drafter_with(engine, "cpp", hidden, ids[1:] + [7]) for ids, hidden in prompts]
    together = engine.make_drafter("cpp")
    for ids, hidden in prompts:
        together.add_row(None, hidden, ids[1:] + [7])  # prompts of different lengths, own arrays
    want = [propose(d, 4)[0] for d in alone]
    got = together.propose(DecodeConfig(), 4, [GREEDY] * len(texts), [0] * len(texts), [4] * len(texts)).tokens
    assert got.shape == (len(texts), 4) and got.tolist() == want
    assert [s.session.offset for s in together.states] == [d.states[0].session.offset for d in alone]
    # Next round: every row's pairs from one verify-like [B, W, dim] array,
    # a different row and count each.
    dim = engine.model.args.hidden_size
    verify = mx.random.normal((len(texts), 3, dim), key=mx.random.key(1))
    emitted = [[11 + row, 5, 9][: 1 + row % 3] for row in range(len(texts))]  # different counts
    for row, d in enumerate(alone):
        d.commit(verify, [emitted[row]], [row])
    together.commit(verify, emitted, list(range(len(texts))))
    want = [propose(d, 3)[0] for d in alone]
    assert propose(together, 3) == want


def test_drafting_together_names_bad_input(tiny_engine):
    native = tiny_engine.drafters.cpp
    ext = cpp_head.extension()
    ids, hidden = prompt_hidden(tiny_engine, "Hello")
    a, b = native.session(), native.session()
    with pytest.raises(ValueError, match="session 1 repeats"):
        ext.draft_batch([a, a], [hidden], [0, 0], [0, 0], [ids, ids], 2)
    with pytest.raises(ValueError, match="one entry per session"):
        ext.draft_batch([a, b], [hidden], [0], [0, 0], [ids, ids], 2)
    with pytest.raises(ValueError, match="source 1 of 1 hiddens"):
        ext.draft_batch([a, b], [hidden], [0, 1], [0, 0], [ids, ids], 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        ext.draft_batch([a, b], [hidden], [0, 0], [0, 0], [ids, ids], 0)
    assert a.offset == b.offset == 0  # nothing was written


@pytest.mark.parametrize("mode, k", [("chain", 3), ("chain", 4), ("adaptive", 5)])
def test_decoding_with_cpp_drafts_equals_plain_decoding(tiny_path, mode, k):
    engine = MTPEngine.load(tiny_path)
    assert engine.pick_drafter(mode) == "cpp"
    for prompt in ("def add(a, b):", "import os\nimport sys", "x"):
        plain = engine.generate(prompt, max_tokens=40, mode="baseline")
        fast = engine.generate(prompt, max_tokens=40, mode=mode, draft_tokens=k)
        assert fast.tokens == plain.tokens
        slow = engine.generate(prompt, max_tokens=40, mode=mode, draft_tokens=k, drafter="mlx")
        # Same drafts, so the same verify steps and acceptance.
        assert (fast.stats.steps, fast.stats.accepted) == (slow.stats.steps, slow.stats.accepted)
        assert fast.stats.accepted > 0


def test_tree_modes_keep_the_mlx_drafter(tiny_engine):
    for mode in ("tree", "adaptive_tree", "paths"):
        assert tiny_engine.pick_drafter(mode) == "mlx"
        with pytest.raises(ValueError, match=f"no C\\+\\+ drafter for mode '{mode}'"):
            tiny_engine.generate("x", max_tokens=4, mode=mode, drafter="cpp")
    with pytest.raises(ValueError, match="drafter must be one of 'auto', 'mlx', 'mlx-eager', 'cpp', 'cuda', got 'gpu'"):
        tiny_engine.generate("x", max_tokens=4, mode="baseline", drafter="gpu")


def test_commit_rewinds_the_drafted_entries(tiny_engine):
    ids, hidden = prompt_hidden(tiny_engine, "Hello, world!")
    drafter = drafter_with(tiny_engine, "cpp", hidden, ids[1:] + [3])
    state = drafter.states[0]
    drafts = propose(drafter, 4)[0]
    n = len(ids)
    assert len(drafts) == 4
    assert state.base == n and state.session.offset == n + 3  # the last draft is not consumed
    drafter.commit(hidden[:, :2], [[drafts[0], 9]], [0])
    assert state.session.offset == n
    mx.eval(drafter.propose(DecodeConfig(), 2, [GREEDY], [0], [2]).tokens)
    assert state.base == n + 2 and state.session.offset == n + 3
    with pytest.raises(ValueError, match="rewind to 99"):
        state.session.rewind(99)


def test_bad_input_is_named(tiny_engine):
    session = tiny_engine.drafters.cpp.session()
    dim = tiny_engine.model.args.hidden_size
    vocab = tiny_engine.model.args.vocab_size
    h = mx.zeros((1, dim))
    with pytest.raises(ValueError, match=f"token {vocab} outside the vocabulary"):
        session.draft(h, [vocab], 2)
    with pytest.raises(ValueError, match=r"hidden must be \[rows, positions, \d+\].*got shape \(1, 65\)"):
        session.draft(mx.zeros((1, dim + 1)), [1], 2)
    with pytest.raises(ValueError, match="a position for each of the 2 pairs"):
        session.draft(h, [1, 2], 2)
    with pytest.raises(ValueError, match="row 3 of hidden with 2 rows"):
        session.draft(mx.zeros((2, 1, dim)), [1], 2, 0.0, 3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        session.draft(h, [1], 0)
    # The lazy chain checks when it is made, not on MLX's stream.
    with pytest.raises(ValueError, match=f"token {vocab} outside the vocabulary"):
        session.draft_lazy(h, [vocab], 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        session.draft_lazy(h, [1], 0)
    assert session.offset == 0  # nothing was written


def test_heads_it_cannot_run_are_left_to_mlx(tiny_engine):
    head = tiny_engine.checkpoint.head
    embed = tiny_engine.model.model.embed_tokens
    lm_head = tiny_engine.model.lm_head
    head_weights(head, embed, lm_head)
    # A bfloat16 head, a quantized one: refused with the reason.
    _, other = build_models(tiny_engine.config)
    other.set_dtype(mx.bfloat16)
    with pytest.raises(UnsupportedHead, match="is mlx.core.bfloat16, not mlx.core.float32"):
        head_weights(other, embed, lm_head)
    _, other = build_models(tiny_engine.config)
    nn.quantize(other, group_size=32, bits=4)
    with pytest.raises(UnsupportedHead, match="is quantized"):
        head_weights(other, embed, lm_head)


def test_switched_off_by_option_and_by_environment(tiny_path):
    engine = MTPEngine.load(tiny_path, cpp_drafter=False)
    assert engine.drafters.cpp is None and engine.pick_drafter("chain") == "mlx"
    assert "fast path cpp_drafter: off (by choice)" in [s.line() for s in engine.fast_paths]
    script = (
        "from mtp_engine import MTPEngine\n"
        f"e = MTPEngine.load({str(tiny_path)!r})\n"
        "print(e.drafters.cpp is None, e.pick_drafter('chain') == 'mlx')\n"
    )
    env = {**os.environ, "MTP_CPP_DRAFTER": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_cpp_drafter_on_gpu_changes_nothing_on_the_cpu_backend(tiny_path):
    # cpp_drafter_on_gpu only matters on a GPU; on the CPU the C++ head is used anyway.
    engine = MTPEngine.load(tiny_path, cpp_drafter_on_gpu=True)
    assert engine.pick_drafter("chain") == "cpp" and engine.drafters.cpp is not None
    plain = engine.generate("class Point:", max_tokens=24, mode="baseline")
    assert engine.generate("class Point:", max_tokens=24, mode="chain").tokens == plain.tokens


def test_a_lazy_draft_keeps_its_session_alive(tiny_engine):
    import gc

    ids, hidden = prompt_hidden(tiny_engine, "for i in range(10):")
    pairs = ids[1:] + [4]
    eng_head = tiny_engine.checkpoint.head
    embed = tiny_engine.model.model.embed_tokens
    want = tiny_engine.drafters.cpp.session().draft(hidden[0], pairs, 3)[0]
    head, why = cpp_head.build_cpp_head(eng_head, embed, tiny_engine.model.lm_head)
    assert why is None
    session = head.session()
    lazy = session.draft_lazy(hidden[0], pairs, 3)
    del head, session
    gc.collect()
    assert lazy.tolist() == [want]


def test_pairs_are_read_from_any_row_dtype_and_layout(tiny_engine):
    # The verify forward's hiddens are [P, K+1, dim]; the head reads the winning
    # row's first positions in place, whatever the dtype or strides.
    ids, hidden = prompt_hidden(tiny_engine, "import os\nimport sys")
    pairs = ids[1:5]
    head = tiny_engine.drafters.cpp
    _, want = head.session().logits(hidden[0, :4], pairs)
    padded = mx.concatenate([mx.zeros_like(hidden), hidden, mx.ones_like(hidden)])  # rows 0..2, ours is 1
    strided = mx.swapaxes(mx.contiguous(mx.swapaxes(padded, 1, 2)), 1, 2)  # same values, other strides
    for source in (padded, strided):
        _, got = head.session().logits(source, pairs, 1)
        assert got == want
        assert head.session().draft_lazy(source, pairs, 3, 1).tolist()[0] == head.session().draft(hidden[0], pairs, 3)[0]
    _, half = head.session().logits(padded.astype(mx.bfloat16), pairs, 1)
    _, rounded = head.session().logits(hidden[0, :4].astype(mx.bfloat16).astype(mx.float32), pairs)
    assert half == rounded
