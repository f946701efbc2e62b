"""Chain drafts from the CUDA chain kernel (`mtp_engine.kernels.cuda_chain`):
a whole chain of K drafts in one launch, where the MLX head would launch
about fifty kernels per draft step."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.drafters.head_weights import UnsupportedHead
from mtp_engine.drafters.mlx_head import MLXDrafter, MTPDraftState
from mtp_engine.kernels.cuda_chain import (
    MAX_DRAFTS,
    MAX_PENDING,
    ChainKernel,
    availability,
    kernel_weights,
)
from mtp_engine.model.mtp_head import MTPHead


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


class CudaChainDrafter(MLXDrafter):
    """`MLXDrafter` whose chain drafts run as one `ChainKernel` launch.

    The other strategies (adaptive, trees, paths) branch on each step's
    result on the host and stay with the MLX head; the engine uses this
    drafter for chain mode only. The head's KV cache and pending pairs are
    the MLX drafter's, so the two can take turns on one state.
    """

    modes = frozenset({"chain"})

    def __init__(self, head: MTPHead, embed: nn.Module, lm_head, kernel, prefill_step_size: int = 2048):
        # Not compiled: here the MLX head only consumes the pairs of a prompt
        # ahead of its last when there are more than 16, once per generation;
        # a second `CompiledHead` would trace each such width for one use.
        super().__init__(head, embed, lm_head, prefill_step_size)
        self.name = "cuda"
        self.kernel = kernel

    def draft(self, state: MTPDraftState, k: int) -> mx.array:
        """K greedy draft tokens, ``[1, k]`` int32, from one kernel launch
        (its evaluation starts at once; not read back)."""
        if k < 1:
            raise ValueError(f"a chain draft needs k >= 1 tokens, got {k}")
        if k > MAX_DRAFTS:
            return super().draft(state, k)
        hidden, tokens = self.pending(state)
        if len(tokens) > MAX_PENDING:
            # A prompt's pairs: all but the last through the MLX head (chunked).
            self.set_pending(state, hidden[:, :-1], tokens[:-1])
            self.first_step(state)
            hidden, tokens = hidden[:, -1:], tokens[-1:]
        c = state.cache[0]
        drafts, new_k, new_v = self.kernel(
            hidden.reshape(-1, hidden.shape[-1]), tokens, c.keys, c.values, c.offset, k
        )
        shape = (1, new_k.shape[0], len(tokens), new_k.shape[2])
        c.update_and_fetch(new_k.reshape(shape), new_v.reshape(shape))
        state.pending_hidden, state.pending_tokens = None, []
        state.base = c.offset
        mx.async_eval(drafts)
        return drafts.reshape(1, k)
