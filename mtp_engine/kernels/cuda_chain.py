"""Whole chains of MTP drafts, every row of a batch, in one CUDA kernel launch.

On a GPU a small model's decoding is host-bound: every kernel costs a few
microseconds of host time (Python building the graph, MLX encoding the
launch) and the GPU idles between them. A draft step of a small head is
about fifty kernels even compiled, so a chain of drafts launches about as
many kernels as the verify forward it feeds.

`ChainKernel` runs the head's whole chain for every row in one launch, one
thread block a row: the row's pending pairs (the accepted tokens against the
trunk's true hiddens), then K-1 more steps, each feeding its token and
hidden to the next. A draft is the argmax of the LM head's logits, plus the
step's ``noise`` where rows sample (`mtp_engine.sampling.draft_noise`: the
exact sampler's Gumbel-max choice, what the MLX head drafts for them). A
row attends to its own entries of the head's batched KV cache
(`mtp_engine.cache.batch.BatchKVCache`: its holes masked, its own RoPE
positions). A block works through each step in phases separated by
``__syncthreads``:
norms, the ``fc``, the attention projections, RMS-normed queries and keys
with RoPE, attention over the head's KV cache and the new positions, the
gated output projection, the MoE block (softmax router, top-k, SwiGLU
experts, sigmoid-gated shared expert), the final norm, the LM head and an
argmax (of logits plus noise, where given). Products are warp-per-output
dot products over 16-byte weight loads; everything accumulates in float32.

What it keeps: the pending pairs' keys and values come back in the cache's
dtype, ``[rows, kv_heads, width, head_dim]`` (zeros past a row's own pairs,
which the cache then holds as holes, as with the MLX head), and join the
head's KV cache (those positions are committed text); the drafted
positions' keys and values live only in the kernel's scratch, since the
next commit drops them anyway.

Drafts only propose tokens: the verify forward decides every emitted token,
so this arithmetic (float32 throughout, where the MLX head rounds each op to
the model's dtype) changes acceptance at most, never the output. The tests
run this source on the CPU under a small SIMT emulator
(``tests/mtp_engine/kernels/simt_emu.h``) against the MLX head, and on CUDA
machines for real (``tests/mtp_engine/drafters/test_cuda_chain.py``).

The source is ``cuda/draft_chain.cu`` (body) and ``cuda/draft_chain.cuh``
(device helpers); the drafter that launches it is
`mtp_engine.drafters.cuda_chain`.

It serves one-layer heads with the MoE block and unquantized weights of one
float dtype, and only where one thread block can stream the head fast
enough: small heads (see `MAX_STEP_BYTES`). Larger heads keep the MLX head.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import mlx.core as mx

from mtp_engine.backend import is_cuda_backend
from mtp_engine.kernels.cuda_build import CudaKernel

SOURCES = Path(__file__).parent / "cuda"

PAIRS_AT_ONCE = 16
"""Pending pairs a block feeds through the head at once (its scratch holds
that many rows); a row with more (a long run of plain steps under mode
"auto") feeds them in chunks of this many."""

MAX_DRAFTS = 32
"""Deepest chain the kernel drafts in one launch."""

MAX_STEP_BYTES = 32 << 20
"""Weight bytes one draft step may read for the kernel to serve the head.
One block streams them (mostly from L2 after the first step): a small head
reads a few MB a step; a Qwen3-Next-80B head, whose LM head alone is 600 MB
in bfloat16, keeps the MLX head."""

THREADS = 512
"""Threads of a row's block (16 warps). MLX's custom kernels cannot declare
launch bounds, so 1024 threads launch only while the compiler keeps to 64
registers a thread, which a float32 head exceeds; 512 allows 128 and was
as fast (docs/BENCHMARKS.md)."""

WEIGHT_ORDER = (
    "embed", "lm_head", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm",
    "layers.0.input_layernorm", "layers.0.post_attention_layernorm",
    "layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj", "layers.0.o_proj",
    "layers.0.q_norm", "layers.0.k_norm", "layers.0.router",
    "layers.0.experts.gate_proj", "layers.0.experts.up_proj", "layers.0.experts.down_proj",
    "layers.0.shared.gate_proj", "layers.0.shared.up_proj", "layers.0.shared.down_proj",
    "layers.0.shared_gate",
)
"""Head weights in the kernel's argument order (names of `mtp_engine.model.head_weights`)."""

WEIGHT_ARGS = (
    "embed", "lm_head", "norm_e", "norm_h", "fc", "norm_f", "in_norm", "post_norm",
    "q_w", "k_w", "v_w", "o_w", "q_norm", "k_norm", "router",
    "e_gate", "e_up", "e_down", "s_gate", "s_up", "s_down", "s_weight",
)
"""The kernel's names for them."""

INPUT_NAMES = ("hidden", "tokens", "meta", "rows_meta", "fparams", "inv_freq", "k_cache", "v_cache", "valid",
               "noise") + WEIGHT_ARGS
OUTPUT_NAMES = ("drafts", "new_k", "new_v", "work")

def work_offsets(config: dict, width: int = 1) -> dict[str, int]:
    """Where each scratch buffer of a row's block starts, in floats, for
    pending pairs ``width`` wide (the layout at the top of
    ``cuda/draft_chain.cu``); ``"scores"`` is last and holds ``heads x pmax``."""
    dim, qo = config["dim"], config["heads"] * config["head_dim"]
    kvo = config["kv_heads"] * config["head_dim"]
    ed, sd, topk = config["expert_dim"], config["shared_dim"], config["top_k"]
    sizes = [
        ("both", PAIRS_AT_ONCE * 2 * dim), ("xs", PAIRS_AT_ONCE * dim), ("as", PAIRS_AT_ONCE * dim),
        ("kv", PAIRS_AT_ONCE * 2 * kvo), ("qg", 2 * qo), ("qs", qo), ("att", qo), ("a2", dim),
        ("rt", config["experts"]), ("sgate", 4), ("sg", sd), ("su", sd), ("ys", dim),
        ("eg", topk * ed), ("eu", topk * ed), ("ye", topk * dim), ("mb", dim), ("logits", config["vocab"]),
        ("part", 32 * qo), ("knew", (width + MAX_DRAFTS) * kvo), ("vnew", (width + MAX_DRAFTS) * kvo),
        ("scores", 0),
    ]
    offsets, at = {}, 0
    for name, size in sizes:
        offsets[name] = at
        at += size
    return offsets


def header() -> str:
    """The kernel's device helpers (``cuda/draft_chain.cuh``)."""
    return (SOURCES / "draft_chain.cuh").read_text()


def source() -> str:
    """The kernel's body (``cuda/draft_chain.cu``)."""
    return (SOURCES / "draft_chain.cu").read_text()


@cache
def _kernel():
    return CudaKernel(
        name="draft_chain",
        input_names=list(INPUT_NAMES),
        output_names=list(OUTPUT_NAMES),
        source=source(),
        header=header(),
    )


class ChainKernel:
    """The chain kernel bound to one head's weights.

    Args:
        weights, config: What `mtp_engine.drafters.cuda_chain.kernel_weights` returned. The weights' dtype
            is also the KV cache's while the cache is empty.
    """

    def __init__(self, weights: list[mx.array], config: dict):
        self.weights = weights
        self.config = config
        self.dtype = weights[0].dtype
        c = config
        half = c["rope_dims"] // 2
        self.inv_freq = mx.array(
            [float(c["rope_base"]) ** (-2.0 * i / c["rope_dims"]) for i in range(half)] or [0.0],
            dtype=mx.float32,
        )
        self.fparams = mx.array([c["eps"], c["rope_scale"], 1.0 / math.sqrt(c["head_dim"])], dtype=mx.float32)

    def template(self, hidden_dtype: mx.Dtype, cache_dtype: mx.Dtype) -> list[tuple]:
        c = self.config
        return [
            ("W", self.dtype), ("HT", hidden_dtype), ("CT", cache_dtype),
            ("DIM", c["dim"]), ("H", c["heads"]), ("KVH", c["kv_heads"]), ("HD", c["head_dim"]),
            ("RD", c["rope_dims"]), ("V", c["vocab"]), ("E", c["experts"]), ("TOPK", c["top_k"]),
            ("ED", c["expert_dim"]), ("SD", c["shared_dim"]), ("NORM_TOPK", bool(c["norm_topk"])),
            ("MAXM", PAIRS_AT_ONCE), ("MAXK", MAX_DRAFTS),
        ]

    def arguments(self, hidden: mx.array, tokens: list[list[int]], counts: list[int], positions: list[int],
                  keys, values, valid, offset: int, k: int, noise: mx.array | None = None):
        """Inputs, template, output shapes and dtypes of one launch (shared
        with the tests' emulator); the arguments are `__call__`'s."""
        c = self.config
        rows, width = len(tokens), hidden.shape[1]
        cache_dtype = keys.dtype if keys is not None else self.dtype
        if keys is not None and offset > keys.shape[2] or valid is not None and (
                valid.shape[0] != rows or valid.shape[1] < offset):
            raise ValueError(f"{offset} cache entries of {rows} rows do not fit keys of shape "
                             f"{None if keys is None else keys.shape} and a mask of {None if valid is None else valid.shape}")
        if keys is None:
            keys = values = mx.zeros((rows, c["kv_heads"], 1, c["head_dim"]), dtype=cache_dtype)
        if not 1 <= k <= MAX_DRAFTS:
            raise ValueError(f"the chain kernel drafts 1..{MAX_DRAFTS} tokens, got {k}")
        if not rows == hidden.shape[0] == len(counts) == len(positions) == keys.shape[0]:
            raise ValueError(f"{rows} rows of tokens against {hidden.shape[0]} of hiddens, {len(counts)} counts, "
                             f"{len(positions)} positions and {keys.shape[0]} of the cache")
        if not all(1 <= n <= width for n in counts) or {len(t) for t in tokens} != {width}:
            raise ValueError(f"each row needs 1..{width} pairs and {width} tokens, got {counts}")
        if noise is not None and (noise.shape != (rows, k, c["vocab"]) or noise.dtype != mx.float32):
            raise ValueError(f"noise must be float32 [rows, k, vocab] = [{rows}, {k}, {c['vocab']}], got "
                             f"{noise.dtype} {list(noise.shape)}")
        pmax = offset + width + k
        work = work_offsets(c, width)["scores"] + c["heads"] * pmax
        vcap = 0 if valid is None else valid.shape[1]
        meta = mx.array([offset, width, keys.shape[2], pmax, k, vcap, work, noise is not None],
                        dtype=mx.int32)
        rows_meta = mx.array([[n, p] for n, p in zip(counts, positions)], dtype=mx.int32)
        inputs = [hidden, mx.array(tokens, dtype=mx.int32), meta, rows_meta, self.fparams, self.inv_freq, keys, values,
                  valid if valid is not None else mx.zeros((1,), dtype=mx.bool_),
                  noise if noise is not None else mx.zeros((1,), dtype=mx.float32)]
        inputs += self.weights
        new = (rows, c["kv_heads"], width, c["head_dim"])
        shapes = [(rows, k), new, new, (rows * work,)]
        dtypes = [mx.int32, cache_dtype, cache_dtype, mx.float32]
        return inputs, self.template(hidden.dtype, cache_dtype), shapes, dtypes

    def __call__(self, hidden: mx.array, tokens: list[list[int]], counts: list[int], positions: list[int],
                 keys, values, valid, offset: int, k: int, noise: mx.array | None = None):
        """Launch every row's chain. Row ``r`` has ``counts[r]`` pending pairs,
        ``hidden[r]`` and ``tokens[r]`` right-padded
        to the width of ``hidden`` ``[rows, width, dim]``, at RoPE positions
        ``positions[r]..``, after a KV cache (``keys``/``values`` ``[rows,
        kv_heads, cap, head_dim]`` holding ``offset`` entries, or None when
        empty) whose entries it attends where ``valid`` ``[rows, >= offset]``
        (None: all). Draft ``j`` of row ``r`` is the argmax of the logits plus
        ``noise[r, j]`` (float32 ``[rows, k, vocab]``; None: the logits alone).
        Returns the drafts ``[rows, k]`` int32 and the pairs'
        keys and values ``[rows, kv_heads, width, head_dim]``."""
        inputs, template, shapes, dtypes = self.arguments(hidden, tokens, counts, positions, keys, values, valid,
                                                          offset, k, noise)
        drafts, new_k, new_v, _ = _kernel()(
            inputs=inputs, template=template, grid=(THREADS, len(tokens), 1), threadgroup=(THREADS, 1, 1),
            output_shapes=shapes, output_dtypes=dtypes,
        )
        return drafts, new_k, new_v


def availability() -> str | None:
    """None on MLX's CUDA backend, else why the kernel cannot run."""
    if not is_cuda_backend():
        return "not MLX's CUDA backend"
    return None
