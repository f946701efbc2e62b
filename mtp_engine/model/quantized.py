"""Batched rows of 4-bit products as one matrix (CUDA).

MLX's CUDA backend runs ``quantized_matmul`` over ``[B, L, dim]`` inputs
with ``B > 1`` as ``B`` separate products: a batched decoding step
(``[B, 1, dim]``) or a batched verify (``[B, K+1, dim]``) reads every weight
once per row. Viewed as one ``[B*L, dim]`` matrix the same product reads the
weights once, with the same bits (figures: docs/BACKENDS.md).

`FlatQuantizedLinear` flattens the leading axes before the product and
restores them after. `EngineOptions.flat_quantized` defaults to CUDA only.

Prompt prefill (forwards wider than `MAX_VERIFY_WIDTH` tokens a row) is
compute, not weight reads: with `EngineOptions.prefill_dequantized` a
`FlatQuantizedLinear` dequantizes its weights to the input's dtype and
takes a dense product (the tensor cores, through cuBLAS), which MLX 0.32's
4-bit product over many rows does not. Prefill is the same forward in every
mode, so every mode still decodes from the same caches; decoding and
verify widths keep ``quantized_matmul``. Only products of at least
`DENSE_MIN_WEIGHTS` weights take it.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.model.swap import share_weights, swap_modules
from mtp_engine.options import MAX_VERIFY_WIDTH

DENSE_MIN_WEIGHTS = 1 << 22
"""Fewest weights (inputs x outputs) of a product that `prefill_dequantized`
makes dense: smaller ones are faster as MLX's 4-bit product (figures:
docs/BACKENDS.md, "Tuning constants")."""


class FlatQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose batched inputs run as one matrix.

    Attributes:
        dequantize_wide: Forwards wider than `MAX_VERIFY_WIDTH` tokens a row
            whose input has the scales' dtype run as a dense product of the
            dequantized weights.
    """

    dequantize_wide: bool = False

    def __call__(self, x: mx.array) -> mx.array:
        if self.dequantize_wide and x.ndim >= 2 and x.shape[-2] > MAX_VERIFY_WIDTH and x.dtype == self.scales.dtype:
            w = mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
            y = x @ w.T
            return y + self["bias"] if "bias" in self else y
        if x.ndim <= 2 or math.prod(x.shape[:-2]) == 1:
            return super().__call__(x)
        return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def install_flat_quantized(*modules: nn.Module, dequantize_wide: bool = False) -> int:
    """Swap every ``nn.QuantizedLinear`` under ``modules`` for a
    `FlatQuantizedLinear` sharing its weights (``dequantize_wide`` for
    affine-quantized ones of at least `DENSE_MIN_WEIGHTS` weights); returns
    how many."""

    def swap(layer):
        new = share_weights(FlatQuantizedLinear, layer)
        outputs, packed = layer.weight.shape[-2:]
        affine = getattr(layer, "mode", "affine") == "affine"
        new.dequantize_wide = dequantize_wide and affine and outputs * packed * 32 // layer.bits >= DENSE_MIN_WEIGHTS
        return new

    return swap_modules(modules, {nn.QuantizedLinear: swap})
