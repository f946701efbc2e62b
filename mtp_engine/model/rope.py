"""RoPE over a batch of rows, in launches MLX's CUDA backend can make.

MLX 0.32's CUDA RoPE gives each thread one rotated pair of one token, for
four heads of one row: a grid of ``dims/2 x L x rows*ceil(heads/4)``
threads, whose thread block it sizes with `mlx_block_z`'s rule. That rule
does not cap the block's z at CUDA's 64, so with few rotated dimensions (the
tiny models' 4, the shipped model's 16) and one token per row the launch
fails from 128 rows of 4 heads ("cudaGraphAddKernelNode ... invalid
argument"; found at 128 rows of one prompt's rejection samples). On the
H200 the rule predicted all 120 shapes tried (rows 16-256, heads 1-16, 1 or
4 tokens, 4/16/64 rotated dimensions), and the 80B shapes (64 dimensions)
never reach it. `install_batch_rope` gives each attention block a
`BatchRoPE`, which rotates the rows of a launch that would fail in slices
that fit: the same kernel and numbers, row by row.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.model.swap import share_weights, swap_modules

BLOCK_Z_MAX = 64  # CUDA's largest thread block z
HEADS_PER_THREAD = 4  # heads of one row a RoPE thread rotates


def mlx_block_z(x: int, y: int, z: int) -> int:
    """The z of the thread block MLX 0.32's CUDA backend picks for a grid of
    ``x * y * z`` threads (``get_block_dims``): 1024 threads, a power of two
    per axis no larger than it, the axes grown in turn x, y, z."""
    pows, total = [0, 0, 0], 0
    while True:
        before = total
        for axis, size in enumerate((x, y, z)):
            if total < 10 and size >= 1 << (pows[axis] + 1):
                pows[axis] += 1
                total += 1
        if total in (before, 10):
            return 1 << pows[2]


def rows_per_launch(shape: tuple[int, ...], dims: int) -> int:
    """How many rows of ``shape`` ``[rows, heads..., L, head_dim]`` one CUDA
    RoPE launch of ``dims`` rotated dimensions can take."""
    rows, length = shape[0], shape[-2]
    per_row = -(-math.prod(shape[1:-2]) // HEADS_PER_THREAD)
    if mlx_block_z(dims // 2, length, rows * per_row) <= BLOCK_Z_MAX:
        return rows
    return max(1, BLOCK_Z_MAX // per_row)


class BatchRoPE(nn.RoPE):
    """``nn.RoPE`` that splits a batch whose launch would fail into slices of rows."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        rows = x.shape[0]
        n = rows_per_launch(x.shape, self.dims)
        if n >= rows:
            return super().__call__(x, offset)
        per_row = isinstance(offset, mx.array) and offset.ndim > 0  # [rows] positions
        rope = super().__call__
        return mx.concatenate([rope(x[i : i + n], offset[i : i + n] if per_row else offset)
                               for i in range(0, rows, n)], axis=0)


def is_plain_rope(rope: nn.Module) -> bool:
    """mlx's own RoPE (or `BatchRoPE`): one base, one scale, positions as
    an int or an array; mlx-lm's scaled variants are other classes."""
    return type(rope) in (nn.RoPE, BatchRoPE)


def install_batch_rope(*models: nn.Module) -> int:
    """Swap every ``nn.RoPE`` under ``models`` for a `BatchRoPE` sharing its
    settings. Returns how many were swapped."""
    return swap_modules(models, {nn.RoPE: lambda rope: share_weights(BatchRoPE, rope)})
