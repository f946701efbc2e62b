"""Few-row dense products as one matrix-vector product per row (CUDA).

MLX's CUDA backend runs a one-row product ``x @ W.T`` with its own
matrix-vector kernel, but a product over a few rows (the K+1 tokens of a
verify forward) goes to cuBLASLt. The GEMM itself is cheap; what costs is
the host side of each cuBLASLt call, which a verify forward pays for every
dense layer and plain decoding never does.

`RowwiseLinear` hands MLX the rows as a batch of one-row products. It does
this with strides alone: ``[rows, K]`` is viewed as ``[rows, 1, K]`` with a
unit stride on the length-one axis, and the weight gets a batch axis of one.
MLX then reads each row as a transposed one-row matrix. It does not fold the
batch back into a GEMM, and it runs its batched matrix-vector kernel: one
launch, no cuBLASLt call, no copy.

That kernel computes every row the way the one-token product does. So the
linear layers of a verify forward give, row for row, the same bits as
one-token decoding, where the GEMM rounded differently.

Batched one-token decoding (``[B, 1, dim]``) keeps the GEMM: only products
whose rows hold several tokens take the route (docs/BENCHMARKS.md has the
measurements behind both choices).

Only dense ``nn.Linear`` layers without bias are swapped. Quantized layers
already use a few-row kernel, and MoE experts go through ``gather_mm``.
`EngineOptions.rowwise_linears` defaults to CUDA only: MLX's CPU matmul
takes no such shortcut (the CPU's few-row products have their own route,
`mtp_engine.kernels.cpu_blas`), and on Metal it is unmeasured.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.model.swap import share_weights, swap_modules

MAX_ROWWISE_ROWS = 16
"""Most rows a product may have to take the row-by-row route (verify
forwards); wider ones (prefill) stay GEMMs."""

MAX_EXTRA_READ_BYTES = 64 * 2**20
"""Row by row, each row reads the whole weight again. A product takes the
route only while those extra reads, ``(rows - 1) * weight bytes``, stay
under this (a few microseconds of memory traffic on a data-centre GPU, below
a cuBLASLt call's host time), so a large dense layer (a paths-mode verify of a big bfloat16 model)
keeps its GEMM."""


def takes_rowwise_route(shape: tuple[int, ...], weight_bytes: int) -> bool:
    """Whether a product over inputs of ``shape`` (``[..., tokens, dim]``)
    with a weight of ``weight_bytes`` runs row by row: several tokens per
    row (a verify forward, not a batch of one-token decodes), 2 to
    `MAX_ROWWISE_ROWS` rows in all, extra reads within `MAX_EXTRA_READ_BYTES`."""
    if len(shape) < 2 or shape[-2] < 2:
        return False
    rows = math.prod(shape[:-1])
    return rows <= MAX_ROWWISE_ROWS and (rows - 1) * weight_bytes <= MAX_EXTRA_READ_BYTES


class RowwiseLinear(nn.Linear):
    """``nn.Linear`` whose few-row products run row by row (see module doc)."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        # One output feature: MLX already runs its matrix-vector kernel over
        # the rows (each row a dot product, as over one row).
        if "bias" in self or weight.shape[0] == 1 or not takes_rowwise_route(x.shape, weight.nbytes):
            return super().__call__(x)
        dim = x.shape[-1]
        rows = x.size // dim
        # [rows, dim, 1] -> [rows, 1, dim] with strides (dim, 1, 1): each row
        # is a one-row matrix that MLX sees as transposed. The weight goes in
        # with a batch axis: against a 2-D one, matmul flattens the rows into
        # one GEMM.
        vectors = x.reshape(rows, dim, 1).swapaxes(-1, -2)
        return (vectors @ weight.T[None]).reshape(*x.shape[:-1], -1)


def install_rowwise_linears(*modules: nn.Module) -> int:
    """Swap every dense, bias-free ``nn.Linear`` under ``modules`` for a
    `RowwiseLinear` sharing its weight; returns how many."""
    def swap(layer: nn.Linear):
        return None if "bias" in layer else share_weights(RowwiseLinear, layer)

    return swap_modules(modules, {nn.Linear: swap})

