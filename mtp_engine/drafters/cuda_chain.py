"""Chain drafts from the CUDA chain kernel (`mtp_engine.kernels.cuda_chain`):
every row's chain of K drafts in one launch."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.drafters.base import Proposal
from mtp_engine.drafters.head import HeadDrafter
from mtp_engine.model.head_weights import FLOATS, UnsupportedHead, head_weights
from mtp_engine.kernels.cuda_chain import MAX_DRAFTS, MAX_STEP_BYTES, WEIGHT_ORDER
from mtp_engine.kernels.cuda_chain import ChainKernel, availability
from mtp_engine.model.mtp_head import MTPHead
from mtp_engine.modes import CHAINS
from mtp_engine.sampling import draft_noise


def kernel_weights(head: MTPHead, embed: nn.Module, lm_head: nn.Module) -> tuple[list[mx.array], dict]:
    """The kernel's weights (in `WEIGHT_ARGS` order) and configuration.

    Raises:
        UnsupportedHead: several MTP layers, quantized or mixed-dtype
            weights, a dense MLP, a scaled or traditional RoPE, widths that
            are not whole 16-byte loads, or a head too large for one block
            (`MAX_STEP_BYTES`).
    """
    if len(head.layers) != 1:
        raise UnsupportedHead(f"it has {len(head.layers)} MTP layers; the kernel runs one")
    named, config = head_weights(head, embed, lm_head, FLOATS)
    dtypes = {w.dtype for w in named.values()}
    if len(dtypes) != 1:
        raise UnsupportedHead(f"its weights mix dtypes ({', '.join(sorted(map(str, dtypes)))})")
    dtype = dtypes.pop()
    lanes = 16 // dtype.size
    widths = (config["dim"], config["heads"] * config["head_dim"], config["expert_dim"], config["shared_dim"])
    if any(w % lanes for w in widths):
        raise UnsupportedHead(f"a width of {widths} is not a whole number of 16-byte loads")
    if config["heads"] % config["kv_heads"] or config["rope_dims"] % 2 or config["top_k"] > config["experts"]:
        raise UnsupportedHead("its head counts, rotary width or top-k do not fit the kernel")
    dim = config["dim"]
    step_bytes = dtype.size * (
        config["vocab"] * dim + 2 * dim * dim
        + dim * (2 * config["heads"] + 2 * config["kv_heads"]) * config["head_dim"]
        + config["heads"] * config["head_dim"] * dim
        + 3 * dim * (config["top_k"] * config["expert_dim"] + config["shared_dim"])
    )
    if step_bytes > MAX_STEP_BYTES:
        raise UnsupportedHead(f"a draft step reads {step_bytes >> 20} MB, over the kernel's {MAX_STEP_BYTES >> 20} MB")
    return [mx.contiguous(named[name]) for name in WEIGHT_ORDER], config


def build_chain_kernel(head: MTPHead, embed: nn.Module, lm_head: nn.Module) -> tuple[ChainKernel | None, str | None]:
    """A `ChainKernel` for this head, or ``(None, why)`` off CUDA or where
    the kernel cannot serve it (see `kernel_weights`)."""
    why = availability()
    if why is not None:
        return None, why
    try:
        weights, config = kernel_weights(head, embed, lm_head)
    except UnsupportedHead as e:
        return None, f"the head is not one it runs: {e}"
    return ChainKernel(weights, config), None


class CudaChainDrafter(HeadDrafter):
    """`HeadDrafter` whose chains of greedy and exact-sampler rows, every
    row's, run as one `ChainKernel` launch. Other modes and the rejection
    sampler draft with the MLX head (``compiled``: its compiled forward; the
    head's cache and pending pairs are the MLX drafter's, so the two take
    turns on one state)."""

    def __init__(self, head: MTPHead, embed: nn.Module, lm_head, prefill_step_size: int, kernel: ChainKernel,
                 compiled=None):
        super().__init__(head, embed, lm_head, prefill_step_size, compiled)
        self.name = "cuda"
        self.kernel = kernel

    def propose(self, decode, k: int, params, starts, caps) -> Proposal:
        """K drafts of every row, ``[rows, k]`` int32, from one kernel launch
        (its evaluation starts at once; not read back)."""
        if decode.mode not in CHAINS or any(p.rejects for p in params) or not 1 <= k <= MAX_DRAFTS:
            return super().propose(decode, k, params, starts, caps)
        hidden, tokens, counts = self._gather_pending()
        c, width = self.cache[0], hidden.shape[1]
        drafts, new_k, new_v = self.kernel(hidden, [t + [0] * (width - len(t)) for t in tokens], counts,
                                           c.positions, c.keys, c.values, c.valid if c.holes else None, c.idx, k,
                                           draft_noise(params, starts, k, self.kernel.config["vocab"]))
        c.update_and_fetch(new_k, new_v)  # the pairs' entries, each row keeping its own (as `_consume` keeps them)
        c.settle(counts, width)
        self._base = (c.idx, list(c.positions))
        mx.async_eval(drafts)
        return Proposal(drafts, uses=caps)
