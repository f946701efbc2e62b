"""The chain-draft kernel (`mtp_engine.kernels.cuda_chain`) and its drafter
(`mtp_engine.drafters.cuda_chain`).

Everywhere: its CUDA source runs on the CPU under the SIMT emulator
(`tests/mtp_engine/kernels/simt_emu.h`) and must give the MLX head's drafts, the
pending pairs' keys and values and the last step's logits (to float32
rounding); decoding with it must equal plain decoding. On a CUDA machine
the same checks run on the GPU, and on the shipped model in bfloat16.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from mtp_engine import MTPEngine
from mtp_engine.cache.capture import make_main_cache
from mtp_engine.constraints import Constraint
from mtp_engine.drafters import cuda_chain as chain_drafter
from mtp_engine.drafters import select
from mtp_engine.decoder import Decoder
from mtp_engine.drafters.cuda_chain import build_chain_kernel
from mtp_engine.drafters.head import HeadDrafter
from mtp_engine.modes import DecodeConfig
from mtp_engine.sampling import GREEDY, SamplingParams
from mtp_engine.model.head_weights import UnsupportedHead
from mtp_engine.io.tiny import tiny_config
from mtp_engine.kernels import cuda_chain
from mtp_engine.backend import is_cuda_backend
from tests.conftest import PROMPTS
from tests.mtp_engine.kernels import simt

ON_CUDA = is_cuda_backend()
needs_compiler = pytest.mark.skipif(simt.compiler() is None, reason="needs a C++20 compiler for the emulator")
# The emulator computes in float32 on the host. Against the MLX head on the
# CPU they agree to float32 rounding; on CUDA the head's products sum in
# another order (logits differed by just over 1e-4 on the H200).
TOL = 1e-3 if ON_CUDA else 1e-4

CONFIGS = {
    "default": tiny_config(),
    "wide_heads_top1_tied": tiny_config(head_dim=32, num_experts_per_tok=1, norm_topk_prob=False,
                                        partial_rotary_factor=0.5, tie_word_embeddings=True,
                                        num_key_value_heads=1),
}


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    planted = {"default": dict(predictability=0.4)}  # (planting needs an untied LM head)
    return {name: MTPEngine.load(checkpoint_factory(f"kernel-{name}", cfg, seed=5, **planted.get(name, {})))
            for name, cfg in CONFIGS.items()}


class EmulatedKernel(cuda_chain.ChainKernel):
    """The kernel's source, run by the SIMT emulator instead of the GPU."""

    threads = 64

    launches = 0

    def __call__(self, hidden, tokens, counts, positions, keys, values, valid, offset, k, noise=None):
        inputs, template, shapes, dtypes = self.arguments(hidden, tokens, counts, positions, keys, values, valid,
                                                          offset, k, noise)
        self.last = simt.run(cuda_chain.header(), cuda_chain.source(), cuda_chain.INPUT_NAMES, inputs,
                             cuda_chain.OUTPUT_NAMES, template, shapes, dtypes,
                             grid=(self.threads, len(tokens), 1), threadgroup=(self.threads, 1, 1))
        self.launches += 1
        drafts, new_k, new_v, _ = self.last
        return drafts, new_k, new_v


class GpuKernel(cuda_chain.ChainKernel):
    """The kernel on the GPU, its scratch kept (the last step's logits) and
    its launches counted, as `EmulatedKernel` does."""

    launches = 0

    def __call__(self, *args):
        inputs, template, shapes, dtypes = self.arguments(*args)
        self.last = cuda_chain._kernel()(inputs=inputs, template=template, grid=(cuda_chain.THREADS, len(args[1]), 1),
                                         threadgroup=(cuda_chain.THREADS, 1, 1), output_shapes=shapes,
                                         output_dtypes=dtypes)
        self.launches += 1
        return self.last[:3]


KINDS = [pytest.param(EmulatedKernel, id="emulated", marks=needs_compiler),
         pytest.param(GpuKernel, id="gpu", marks=pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend"))]


def one_row(kernel, hidden, tokens, keys, values, offset, k):
    """The kernel over one row with ``offset`` cache entries, none a hole:
    its drafts ``[k]`` and the pairs' keys and values ``[kv_heads, m, head_dim]``."""
    drafts, new_k, new_v = kernel(hidden[None], [tokens], [len(tokens)], [offset], keys, values, None, offset, k)
    return drafts[0], new_k[0], new_v[0]


def make_kernel(engine, cls=None):
    head, embed = engine.checkpoint.head, engine.model.model.embed_tokens
    lm_head = embed if engine.model.args.tie_word_embeddings else engine.model.lm_head
    if cls is None:
        kernel, why = build_chain_kernel(head, embed, lm_head)
        assert kernel is not None, f"the kernel should serve the tiny heads on CUDA: {why}"
        return kernel
    return cls(*chain_drafter.kernel_weights(head, embed, lm_head))


def reference_chain(engine, ids, pending, k):
    """The MLX head's chain after a prefill of all but ``pending`` pairs:
    the cache before the pending forward, the pending rows' keys and
    values, the drafts and the last step's logits."""
    hidden = engine.model.model(mx.array(ids)[None], cache=make_main_cache(engine.model))
    pairs = ids[1:] + [5]
    head, embed = engine.checkpoint.head, engine.model.model.embed_tokens
    cache = head.make_cache()  # the head alone, eager, with mlx-lm's KV cache
    split = len(pairs) - pending
    c = cache[0]
    before = (None, None, 0)
    if split:
        head(hidden[:, :split], embed(mx.array(pairs[:split])[None]), cache)
        before = (c.keys + 0, c.values + 0, c.offset)
        mx.eval(before[:2])
    m = head(hidden[:, split:], embed(mx.array(pairs[split:])[None]), cache)[:, -1:]
    rows = (c.keys[0, :, before[2]:c.offset] + 0, c.values[0, :, before[2]:c.offset] + 0)
    drafts = []
    for j in range(k):
        logits = engine.lm_head(m)[0, 0]
        drafts.append(int(mx.argmax(logits)))
        if j + 1 < k:
            m = head(m, embed(mx.array([[drafts[-1]]])), cache)
    return hidden[0, split:], pairs[split:], before, rows, drafts, logits


def logits_of(kernel, work):
    c = kernel.config
    start = cuda_chain.work_offsets(c)["logits"]
    return work[start : start + c["vocab"]]


@needs_compiler
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("pending,k", [(1, 1), (1, 4), (5, 3), (16, 2), (37, 3)])  # 37: three chunks
def test_emulated_kernel_drafts_what_the_mlx_head_drafts(engines, name, pending, k):
    engine = engines[name]
    kernel = make_kernel(engine, EmulatedKernel)
    ids = engine.encode(PROMPTS[0] + " " + PROMPTS[2] + " " + PROMPTS[4] + " " + PROMPTS[9])
    assert len(ids) > pending + 1
    hidden, tokens, (keys, values, offset), (want_k, want_v), want, want_logits = reference_chain(
        engine, ids, pending, k)
    drafts, new_k, new_v = one_row(kernel, hidden, tokens, keys, values, offset, k)
    assert drafts.tolist() == want
    assert new_k.shape == want_k.shape and new_k.dtype == want_k.dtype
    assert mx.allclose(new_k, want_k, atol=TOL, rtol=TOL).item()
    assert mx.allclose(new_v, want_v, atol=TOL, rtol=TOL).item()
    got_logits = logits_of(kernel, kernel.last[3])
    assert mx.allclose(got_logits, want_logits, atol=TOL, rtol=TOL).item()


class WideEmulatedKernel(EmulatedKernel):
    """Twice a tiny head's attention outputs in threads: the attention's sums split over two groups of positions,
    as a GPU block's 512 threads split them for the shipped head."""

    threads = 128


@needs_compiler
def test_emulated_kernel_with_a_block_wider_than_the_attention_outputs(engines):
    engine = engines["default"]
    kernel = make_kernel(engine, WideEmulatedKernel)
    assert kernel.threads // (kernel.config["heads"] * kernel.config["head_dim"]) == 2
    ids = engine.encode(PROMPTS[0] + " " + PROMPTS[2] + " " + PROMPTS[4] + " " + PROMPTS[9])
    hidden, tokens, (keys, values, offset), _, want, want_logits = reference_chain(engine, ids, 5, 3)
    drafts, _, _ = one_row(kernel, hidden, tokens, keys, values, offset, 3)
    assert drafts.tolist() == want
    assert mx.allclose(logits_of(kernel, kernel.last[3]), want_logits, atol=TOL, rtol=TOL).item()


@needs_compiler
def test_emulated_kernel_from_an_empty_cache(engines):
    """A short prompt's pairs go straight into the kernel (no MLX prefill)."""
    engine = engines["default"]
    kernel = make_kernel(engine, EmulatedKernel)
    ids = engine.encode("x = 1")
    hidden, tokens, before, rows, want, _ = reference_chain(engine, ids, len(ids), 3)
    assert before == (None, None, 0) and len(tokens) <= cuda_chain.PAIRS_AT_ONCE
    drafts, new_k, _ = one_row(kernel, hidden, tokens, None, None, 0, 3)
    assert drafts.tolist() == want
    assert mx.allclose(new_k, rows[0], atol=TOL, rtol=TOL).item()


@needs_compiler
def test_decoding_with_the_emulated_kernel_equals_plain_decoding(engines):
    """The drafter's bookkeeping around the kernel: prompt prefill through
    the MLX head, pending pairs, cache commits. Output equals plain decoding
    and acceptance equals the MLX drafter's."""
    engine = engines["default"]
    own = engine.drafters.kernel  # the engine's GPU kernel on CUDA, else None
    engine.drafters.kernel = make_kernel(engine, EmulatedKernel)
    try:
        for prompt in (PROMPTS[3],):  # a batch of one (rows join and leave batches below)
            plain = engine.generate(prompt, max_tokens=12, mode="baseline")
            mlx_run = engine.generate(prompt, max_tokens=12, mode="chain", draft_tokens=3, drafter="mlx")
            kernel_run = engine.generate(prompt, max_tokens=12, mode="chain", draft_tokens=3, drafter="cuda")
            assert kernel_run.tokens == plain.tokens
            assert kernel_run.stats.histogram == mlx_run.stats.histogram
    finally:
        engine.drafters.kernel = own


@needs_compiler
def test_auto_drafts_greedy_and_sampled_rows_in_one_kernel_batch_and_constrained_rows_wait(engines):
    """With the kernel (as on CUDA, no C++ head), "auto" drafts greedy and
    sampled rows in one batch with it: the sampled row joins the greedy one.
    A constrained row waits for an empty batch, which the MLX head then
    drafts (the sampled row queued behind it joins it there). Every row
    equals plain decoding."""
    engine = engines["default"]
    kernel, own = make_kernel(engine, EmulatedKernel), (engine.drafters.kernel, engine.drafters.cpp)
    engine.drafters.kernel, engine.drafters.cpp = kernel, None
    try:
        rows = [(PROMPTS[0], GREEDY, None, 10), (PROMPTS[3], SamplingParams(temperature=0.9, seed=2), None, 8),
                (PROMPTS[5], GREEDY, Constraint("regex", "[a-z ]{1,8}"), 8),
                (PROMPTS[7], SamplingParams(temperature=1.2, seed=5), None, 6)]
        decoder = Decoder(engine, DecodeConfig(mode="chain", draft_tokens=3, batch_size=3))
        for i, (prompt, params, constraint, n) in enumerate(rows):
            decoder.add(i, prompt, [params], max_tokens=n, constraint=constraint)
        results, seen = {}, []
        while decoder.pending:
            results.update({key: r for (key, _), r in decoder.step()})
            seen.append((decoder.drafter.name, sorted(r.key[0] for r in decoder.rows)))
        plain = [engine.generate(p, max_tokens=n, mode="baseline", sampling=s, constraint=c).tokens
                 for p, s, c, n in rows]
    finally:
        engine.drafters.kernel, engine.drafters.cpp = own
    assert seen[0] == ("cuda", [0, 1]) and kernel.launches > 0  # the constrained row (and the one behind it) wait
    assert {d for d, keys in seen if keys and min(keys) >= 2} == {"mlx"}
    assert [results[i].tokens for i in range(len(rows))] == plain


def _join(engine, drafter, slot, ids):
    """A prompt's row joins the drafter (in place of row ``slot``, or at the end)."""
    hidden = engine.model.model(mx.array(ids)[None], cache=make_main_cache(engine.model))
    drafter.add_row(slot, hidden, ids[1:] + [5])


# Rows that sample draft the exact sampler's choice: a row of each temperature and a greedy one.
SAMPLED = [SamplingParams(temperature=0.8, seed=11), GREEDY, SamplingParams(temperature=1.3, seed=4)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("params", [[GREEDY] * 3, SAMPLED], ids=["greedy", "sampled"])
def test_kernel_drafts_every_rows_chain_over_its_own_entries(engines, kind, params):
    """Rows joined at different lengths (one in the place of a row that left)
    and kept different counts of pairs, so the head's cache has holes and
    each row its own RoPE positions. One launch drafts every row's chain:
    what the MLX head drafts from the same state (sampling rows: at their
    own generated positions), leaving the same cache."""
    engine = engines["default"]
    kernel = make_kernel(engine, kind)
    ours = chain_drafter.CudaChainDrafter(*engine.drafters.head_args, kernel=kernel)
    theirs = HeadDrafter(*engine.drafters.head_args)  # the eager MLX head
    probe = HeadDrafter(*engine.drafters.head_args)  # the same again, for its last draft's logits
    decode, k, dim = DecodeConfig(mode="chain", draft_tokens=3), 3, kernel.config["dim"]
    prompts = [engine.encode(p) for p in (PROMPTS[0], PROMPTS[3] + " " + PROMPTS[4], "x = 1", PROMPTS[6])]
    for drafter in (ours, theirs, probe):
        for ids in prompts[:3]:
            _join(engine, drafter, None, ids)
    keeps = [[1, 4, 2], [3, 1, 4], [2, 2, 1], [1, 3, 3], [2, 1, 4]]  # each row's emitted tokens at each step
    for step, keep in enumerate(keeps):
        if step == 2:  # row 1 left; a shorter prompt takes its place
            for drafter in (ours, theirs, probe):
                _join(engine, drafter, 1, prompts[3])
        if step == 4:  # 17 plain steps: more pending pairs than a block feeds at once
            for j in range(17):
                pair = mx.random.normal((3, 1, dim), key=mx.random.key(100 + j))
                for drafter in (ours, theirs, probe):
                    drafter.extend(pair, [[11 + j], [40 + j], [90 + j]])
        if step >= 2:
            assert ours.cache[0].holes
        launches = kernel.launches
        starts = [3 * step + 7 * r for r in range(3)]
        got = ours.propose(decode, k, params, starts, [k] * 3)
        want = theirs.propose(decode, k, params, starts, [k] * 3)
        assert kernel.launches == launches + 1  # the kernel drafted, not the MLX head
        assert got.tokens.tolist() == want.tokens.tolist(), step
        m = probe._consume()  # the MLX head's chain over the same drafts, step by step
        for j in range(k - 1):
            m = probe._forward(m, want.tokens[:, j : j + 1], probe.cache)
        rows = kernel.last[3].reshape(3, -1)
        start = cuda_chain.work_offsets(kernel.config)["logits"]
        assert mx.allclose(rows[:, start : start + kernel.config["vocab"]], engine.lm_head(m)[:, 0],
                           atol=TOL, rtol=TOL).item(), step
        hidden = mx.random.normal((3, k + 1, dim), key=mx.random.key(step))
        emitted = [[(7 * step + 3 * r + j) % 300 + 5 for j in range(n)] for r, n in enumerate(keep)]
        for drafter in (ours, theirs, probe):
            drafter.commit(hidden, emitted, [0, 1, 2])
        a, b = ours.cache[0], theirs.cache[0]
        assert (a.idx, a.positions, a.holes) == (b.idx, b.positions, b.holes)
        assert mx.array_equal(a.valid[:, : a.idx], b.valid[:, : b.idx]).item()
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            mask = a.valid[:, None, : a.idx, None]
            assert mx.allclose(mx.where(mask, x[..., : a.idx, :], 0), mx.where(mask, y[..., : b.idx, :], 0),
                               atol=TOL, rtol=TOL).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_batched_decoding_with_the_kernel_equals_plain_decoding(engines, kind, sampled):
    """Rows join and leave a batch; every speculative step's drafts come from
    one launch. Each row equals plain decoding of its prompt alone (sampled:
    at its seed, greedy rows among them), with the MLX drafter's acceptance;
    a row with a nucleus filter, which its drafts leave out, too."""
    engine = engines["default"]
    kernel = make_kernel(engine, kind)
    calls = []

    class Counting(chain_drafter.CudaChainDrafter):
        def propose(self, *args):
            calls.append(kernel.launches)
            return super().propose(*args)
    prompts = [PROMPTS[i] for i in (0, 3, 5, 7, 9)]
    budgets = [9, 5, 8, 3, 9]
    params = [GREEDY] * 5
    if sampled:  # hot rows: drafts that left out their noise would be accepted less often than the MLX head's
        params = [SamplingParams(temperature=1.5, seed=1), GREEDY, SamplingParams(temperature=2.0, seed=2),
                  SamplingParams(temperature=0.7, seed=3, top_p=0.8), SamplingParams(temperature=0.9, seed=4)]
    plain = [engine.generate(p, max_tokens=n, mode="baseline", sampling=s).tokens
             for p, n, s in zip(prompts, budgets, params)]
    decode = DecodeConfig(mode="chain", draft_tokens=3, batch_size=3)
    runs = {}
    for name, drafter in (("mlx", None), ("kernel", Counting(*engine.drafters.head_args, kernel=kernel))):
        decoder = Decoder(engine, replace(decode, drafter="mlx"), drafter=drafter)
        for i, (p, n, s) in enumerate(zip(prompts, budgets, params)):
            decoder.add(i, p, [s], max_tokens=n)
        results = {}
        while decoder.pending:
            results.update({key: r for (key, _), r in decoder.step()})
        runs[name] = [results[i] for i in range(len(prompts))]
    assert [r.tokens for r in runs["kernel"]] == plain
    unfiltered = [i for i, s in enumerate(params) if s.top_p == 1]  # (a filtered row's drafts may differ)
    assert [runs["kernel"][i].stats.histogram for i in unfiltered] == [runs["mlx"][i].stats.histogram
                                                                        for i in unfiltered]
    assert calls and kernel.launches == calls[-1] + 1 == len(calls)  # each step launched once


def test_heads_the_kernel_cannot_serve(checkpoint_factory, engines):
    engine = MTPEngine.load(checkpoint_factory("kernel-mtp2", tiny_config(mtp_num_hidden_layers=2), seed=3))
    head, embed = engine.checkpoint.head, engine.model.model.embed_tokens
    with pytest.raises(UnsupportedHead, match="2 MTP layers"):
        chain_drafter.kernel_weights(head, embed, engine.model.lm_head)
    default = engines["default"]
    chain_drafter.kernel_weights(default.checkpoint.head, default.model.model.embed_tokens, default.model.lm_head)
    if not ON_CUDA:
        kernel, why = build_chain_kernel(default.checkpoint.head, default.model.model.embed_tokens,
                                         default.model.lm_head)
        assert kernel is None and why == "not MLX's CUDA backend"
        assert default.drafters.kernel is None
        with pytest.raises(ValueError, match="cuda"):
            default.generate("x", max_tokens=4, mode="chain", drafter="cuda")


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("pending,k", [(1, 4), (5, 3), (16, 8), (37, 3)])
def test_gpu_kernel_drafts_what_the_mlx_head_drafts(engines, pending, k):
    engine = engines["default"]
    kernel = make_kernel(engine)
    ids = engine.encode(PROMPTS[0] + " " + PROMPTS[2] + " " + PROMPTS[4] + " " + PROMPTS[9])
    hidden, tokens, (keys, values, offset), (want_k, want_v), want, _ = reference_chain(engine, ids, pending, k)
    drafts, new_k, new_v = one_row(kernel, hidden, tokens, keys, values, offset, k)
    assert drafts.tolist() == want
    assert mx.allclose(new_k, want_k, atol=1e-3, rtol=1e-3).item()
    assert mx.allclose(new_v, want_v, atol=1e-3, rtol=1e-3).item()


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_decoding_with_the_kernel_equals_plain_decoding(engines, name):
    engine = engines[name]
    assert engine.drafters.kernel is not None
    for prompt in PROMPTS[:4]:
        plain = engine.generate(prompt, max_tokens=40, mode="baseline")
        for k in (1, 4, 9):
            run = engine.generate(prompt, max_tokens=40, mode="chain", draft_tokens=k)
            assert run.tokens == plain.tokens, (prompt, k)


def test_one_compiled_kernel_serves_every_depth_and_width(engines):
    """The depth and the pending pairs are run-time values: a template that
    changed with them would compile a new kernel (NVRTC, a second or so) at
    the tail of every generation, where the depth shrinks."""
    engine = engines["default"]
    kernel = make_kernel(engine, EmulatedKernel)
    hidden = mx.zeros((3, 40, kernel.config["dim"]))

    def template(rows, m, offset, k):
        return str(kernel.arguments(hidden[:rows, :m], [[1] * m] * rows, [m] * rows, [offset] * rows, None, None,
                                    None, offset, k)[1])
    assert len({template(*shape) for shape in ((1, 1, 0, 1), (3, 16, 40, 32), (2, 3, 7, 5), (1, 40, 9, 2))}) == 1
    with pytest.raises(ValueError, match="1..32 tokens"):
        template(1, 1, 0, 33)
    with pytest.raises(ValueError, match=r"each row needs 1..2 pairs"):
        kernel.arguments(hidden[:2, :2], [[1, 1], [1, 1]], [2, 0], [0, 0], None, None, None, 0, 1)
    with pytest.raises(ValueError, match="2 rows of tokens against 3 of hiddens"):
        kernel.arguments(hidden[:, :2], [[1, 1], [1, 1]], [2, 2], [0, 0], None, None, None, 0, 1)
    with pytest.raises(ValueError, match="5 cache entries of 1 rows do not fit"):
        kernel.arguments(hidden[:1, :1], [[1]], [1], [0], None, None, mx.ones((1, 3), dtype=mx.bool_), 5, 1)


def test_auto_picks_the_kernel_for_greedy_and_sampled_rows_and_the_mlx_head_for_constrained_ones(engines):
    """Where the kernel is built (CUDA), "auto" drafts chains of greedy and
    sampled rows with it (a batch of both then keeps one drafter); rows under a
    constraint need the MLX head, and naming the kernel for them is an error."""
    parts = replace(engines["default"].drafters, kernel=object(), cpp=None)  # a kernel, as on CUDA
    for greedy in (True, False):
        assert select.pick(parts, "chain", "auto", greedy) == "cuda"
        assert select.pick(parts, "auto", "auto", greedy) == "cuda"
        assert select.pick(parts, "chain", "auto", greedy, masked=True) in ("mlx", "mlx-eager")
        assert select.pick(parts, "tree", "auto", greedy) in ("mlx", "mlx-eager")
    with pytest.raises(ValueError, match="the cuda drafter drafts unmasked; constrained rows draft with the MLX head"):
        select.pick(parts, "chain", "cuda", masked=True)
    with pytest.raises(ValueError, match="the cpp drafter drafts greedily, unmasked; sampled and constrained rows"):
        select.pick(parts, "chain", "cpp", greedy=False)
