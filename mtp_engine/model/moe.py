"""The MoE block with its routing indices made contiguous once.

mlx-lm's ``Qwen3NextSparseMoeBlock`` takes the top-k experts as a slice of
``argpartition``'s output, ``[..., -k:]``. Over one token that slice is
contiguous; over the K+1 tokens of a verify forward it is a strided view,
and each of the ops that read it (the score gather, and the three expert
products of ``SwitchGLU``) copies it to a contiguous buffer on MLX's CUDA
backend: about five small copy kernels per layer and verify forward, on a
GPU where a speculative step is bound by kernel launches. Copying the
indices once before those reads gives the same values, so the block's
arithmetic is unchanged (tested bit for bit against mlx-lm's block).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

from mtp_engine.model.swap import share_weights, swap_modules


class EngineSparseMoeBlock(Qwen3NextSparseMoeBlock):
    """``Qwen3NextSparseMoeBlock`` with contiguous routing indices."""

    def __call__(self, x: mx.array) -> mx.array:
        if self.sharding_group is not None:  # the distributed path stays mlx-lm's
            return super().__call__(x)
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.contiguous(mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]))
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def install_moe_blocks(*modules: nn.Module) -> int:
    """Swap every ``Qwen3NextSparseMoeBlock`` under ``modules`` for an
    `EngineSparseMoeBlock` sharing its weights; returns how many."""
    return swap_modules(modules, {Qwen3NextSparseMoeBlock: lambda m: share_weights(EngineSparseMoeBlock, m)})
