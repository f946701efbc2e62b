"""The MoE block with its routing indices made contiguous once, and its
experts' tokens sorted only past a set number of routed selections.

mlx-lm's ``Qwen3NextSparseMoeBlock`` takes the top-k experts as a slice of
``argpartition``'s output, ``[..., -k:]``. Over one token that slice is
contiguous; over the K+1 tokens of a verify forward it is a strided view,
and each of the ops that read it (the score gather, and the three expert
products of ``SwitchGLU``) copies it to a contiguous buffer on MLX's CUDA
backend: about five small copy kernels per layer and verify forward, on a
GPU where a speculative step is bound by kernel launches. Copying the
indices once before those reads gives the same values, so the block's
arithmetic is unchanged (tested bit for bit against mlx-lm's block).

mlx-lm's ``SwitchGLU`` sorts the tokens by expert once ``tokens x top_k``
reaches 64, which turns the expert products into grouped GEMMs: right for a
prompt's prefill, but a verify forward of an 80B-A3B-shaped model (top-10)
crosses 64 at 7 tokens, and batched decoding always does.
`EngineSparseMoeBlock.sort_min` sets that threshold (`EngineOptions.moe_sort_min`;
by default mlx-lm's on the CPU, where the outputs stay bit for bit the same,
and higher on GPUs: docs/BENCHMARKS.md).

Sorted or not, MLX's CUDA ``gather_qmm`` runs one single-row product per
(token, expert) selection, re-reading the expert's weights for each: a
1K-token prompt's MoE block of the 80B-A3B shapes took 15 ms. From
`EngineSparseMoeBlock.group_min` selections (`EngineOptions.grouped_moe`, on
CUDA) `grouped_switch_glu` lays each expert's tokens out as blocks of
`GROUP_ROWS` rows, so each product reads an expert's weights once per block.
With `EngineSparseMoeBlock.expert_kernel` (`EngineOptions.moe_kernel`, on
CUDA) forwards of up to `MAX_VERIFY_WIDTH` tokens a row run the engine's
own kernel (`mtp_engine.kernels.cuda_moe`) instead, whose per-token
arithmetic does not depend on the batch; with
`EngineSparseMoeBlock.prefill_kernel` (`EngineOptions.prefill_moe_kernel`)
wider forwards (prompt prefill) of bfloat16 models run its tensor-core
kernel, else the above.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import (  # mlx-lm is pinned to 0.32.x
    SwitchGLU,
    _gather_sort,
    _scatter_unsort,
)

from mtp_engine.model.swap import share_weights, swap_modules
from mtp_engine.options import MAX_VERIFY_WIDTH

MLX_LM_SORT_MIN = 64
"""mlx-lm's threshold: sort once this many (token, expert) selections are routed."""

GPU_MOE_SORT_MIN = 1024
"""Routed selections from which a GPU's MoE blocks sort their tokens by
expert: prefill chunks do, verify forwards and decoding batches do not."""

GPU_MOE_GROUP_MIN = 1024
"""Routed selections from which `EngineOptions.grouped_moe` runs each
expert's tokens in blocks: prompt prefill chunks do, decoding batches (where
MLX's own products are faster) do not (docs/BACKENDS.md)."""


def switch_glu(switch: SwitchGLU, x: mx.array, indices: mx.array, sort_min: int,
               group_min: int | None = None) -> mx.array:
    """mlx-lm 0.32's ``SwitchGLU.__call__`` with the sort threshold as a
    parameter; from ``group_min`` selections, `grouped_switch_glu`."""
    if group_min is not None and indices.size >= group_min:
        return grouped_switch_glu(switch, x, indices)
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    do_sort = indices.size >= sort_min
    idx, inv_order = indices, None
    if do_sort:
        x, idx, inv_order = _gather_sort(x, indices)
    x_up = switch.up_proj(x, idx, sorted_indices=do_sort)
    x_gate = switch.gate_proj(x, idx, sorted_indices=do_sort)
    x = switch.down_proj(switch.activation(x_up, x_gate), idx, sorted_indices=do_sort)
    if do_sort:
        x = _scatter_unsort(x, inv_order, indices.shape)
    return x.squeeze(-2)


GROUP_ROWS = 16
"""Rows per grouped expert product: each expert's tokens are cut into
blocks of this many (the last zero-padded)."""


def grouped_switch_glu(switch: SwitchGLU, x: mx.array, indices: mx.array, rows: int = GROUP_ROWS) -> mx.array:
    """``SwitchGLU`` over ``x`` ``[..., dim]`` routed to ``indices``
    ``[..., k]``, each expert's products over blocks of ``rows`` of its
    tokens: the selections, sorted by expert, become the rows of ``[blocks,
    rows, dim]``, each block one expert's (zero rows pad its last), so an
    expert's weights are read once per block, not once per selection.
    Returns ``[..., k, dim]``.

    The layout is computed on the device (no read-back, so compiled code can
    run it): ``selections // rows + experts + 1`` blocks bound what any
    routing needs, and the spare blocks (all zero rows) go to the last
    expert."""
    k, dim = indices.shape[-1], x.shape[-1]
    experts = switch.up_proj.num_experts
    flat = indices.flatten().astype(mx.int32)
    n = flat.size
    n_blocks = n // rows + min(experts, n) + 1
    counts = mx.zeros((experts,), mx.int32).at[flat].add(1)
    blocks = (counts + rows - 1) // rows
    first_block = mx.cumsum(blocks) - blocks  # each expert's first block
    first_place = mx.cumsum(counts) - counts  # and its first place in the sorted order
    order = mx.argsort(flat)
    sorted_experts = flat[order]
    # Sorted place j of expert e lands on row first_block[e] * rows + j - first_place[e].
    row = mx.arange(n, dtype=mx.int32) + (first_block * rows - first_place)[sorted_experts]
    slots = mx.zeros_like(flat).at[order].add(row)  # each selection's row, in routing order
    # Block b belongs to the last expert whose first block is at or before it
    # (experts without tokens share their successor's first block).
    starts = mx.zeros((n_blocks + 1,), mx.int32).at[first_block].add(1)
    block_expert = (mx.cumsum(starts)[:n_blocks] - 1).astype(mx.uint32)
    grouped = mx.zeros((n_blocks * rows, dim), x.dtype)
    grouped[slots] = mx.repeat(x.reshape(-1, dim), k, axis=0)
    grouped = grouped.reshape(n_blocks, rows, dim)
    y = switch.down_proj(switch.activation(switch.up_proj(grouped, block_expert),
                                           switch.gate_proj(grouped, block_expert)), block_expert)
    return y.reshape(-1, y.shape[-1])[slots].reshape(*indices.shape, -1)


class EngineSparseMoeBlock(Qwen3NextSparseMoeBlock):
    """``Qwen3NextSparseMoeBlock`` with contiguous routing indices.

    Attributes:
        sort_min: Routed selections from which the experts' tokens are sorted.
        group_min: Routed selections from which each expert's tokens run in
            blocks (`grouped_switch_glu`), or None: never.
        expert_kernel: Forwards of up to `MAX_VERIFY_WIDTH` tokens a row
            run their expert products in the CUDA kernel
            (`mtp_engine.kernels.cuda_moe`).
        prefill_kernel: Wider bfloat16 forwards run them in its tensor-core
            kernel (``cuda_moe.tiles_switch_glu``).
    """

    sort_min: int = MLX_LM_SORT_MIN
    group_min: int | None = None
    expert_kernel: bool = False
    prefill_kernel: bool = False

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Each token's ``top_k`` experts (contiguous ``[..., k]`` indices)
        and their scores, as mlx-lm's block routes."""
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.contiguous(mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]))
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores

    def __call__(self, x: mx.array) -> mx.array:
        if self.sharding_group is not None:  # the distributed path stays mlx-lm's
            return super().__call__(x)
        inds, scores = self.route(x)
        narrow = x.ndim < 2 or x.shape[-2] <= MAX_VERIFY_WIDTH
        if self.expert_kernel and narrow:
            # Imported here: the kernels are only installed on CUDA backends.
            from mtp_engine.kernels import cuda_moe

            y = cuda_moe.switch_glu(self.switch_mlp, x, inds)
        elif self.prefill_kernel and not narrow and x.dtype == mx.bfloat16:
            from mtp_engine.kernels import cuda_moe

            y = cuda_moe.tiles_switch_glu(self.switch_mlp, x, inds)
        else:
            y = switch_glu(self.switch_mlp, x, inds, self.sort_min, self.group_min)
        y = (y * scores[..., None]).sum(axis=-2)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def install_moe_blocks(*modules: nn.Module, sort_min: int = MLX_LM_SORT_MIN, group_min: int | None = None) -> int:
    """Swap every ``Qwen3NextSparseMoeBlock`` under ``modules`` for an
    `EngineSparseMoeBlock` sharing its weights; returns how many."""

    def swap(block):
        new = share_weights(EngineSparseMoeBlock, block)
        new.sort_min = sort_min
        new.group_min = group_min
        return new

    return swap_modules(modules, {Qwen3NextSparseMoeBlock: swap})
