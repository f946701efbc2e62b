"""The gated-delta recurrence over T tokens in one CUDA kernel launch.

On CUDA, mlx-lm's gated-delta recurrence runs as ops, one step per token
(its fused kernel is Metal-only): a verify forward over K+1 tokens launches
K+1 copies of the step in each gated-delta layer, and a long prefill runs a
Python loop over its tokens. This kernel (``cuda/gated_delta_tokens.cu``)
runs all T steps in one launch, one warp per row of the recurrent state (as
mlx-lm's Metal kernel does), and can write the state after every token, which
is what a verify forward's captured states need.

Every token gets the same arithmetic whether it comes alone or among T, so
the captured states of a verify forward equal the states of one-token
decoding through this kernel bit for bit; the engine therefore uses it for
all its own forwards on CUDA (decode, verify, prefill). mlx-lm's decoding of
the same model keeps mlx-lm's ops, whose sums round in another order, so the
two may part on numerical near-ties (what `mtp_engine.tools.lossless` checks).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g

SOURCES = Path(__file__).parent / "cuda"


def availability() -> str | None:
    """None on MLX's CUDA backend, else why the kernel cannot run."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return "not MLX's CUDA backend"
    return None


def fits(layer) -> bool:
    """Whether the kernel's launch shape fits this gated-delta layer: key
    heads that split over a warp, value heads over a block of four."""
    return layer.head_k_dim % 32 == 0 and layer.head_v_dim % 4 == 0


@cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="mtp_gated_delta_tokens",
        input_names=["q", "k", "v", "g", "beta", "state_in", "n_tokens"],
        output_names=["y", "states"],
        source=(SOURCES / "gated_delta_tokens.cu").read_text(),
        header=(SOURCES / "gated_delta_tokens.cuh").read_text(),
    )


def gated_delta_tokens(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    keep_states: bool,
) -> tuple[mx.array, mx.array]:
    """The recurrence of ``mlx_lm``'s ``gated_delta_update`` over all tokens.

    Args:
        q, k: Normalized queries and keys ``[B, T, Hk, Dk]``.
        v: Values ``[B, T, Hv, Dv]``.
        a, b: Gate inputs ``[B, T, Hv]``.
        A_log, dt_bias: The layer's gate parameters.
        state: Recurrent state ``[B, Hv, Dv, Dk]``, float32.
        keep_states: Return the state after every token (else the last only).

    Returns:
        ``(y, states)``: outputs ``[B, T, Hv, Dv]`` and float32 states
        ``[T, B, Hv, Dv, Dk]`` (``[1, ...]``, the final state, unless
        ``keep_states``).
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    beta = mx.sigmoid(b)
    g = compute_g(A_log, a, dt_bias)
    y, states = _kernel()(
        inputs=[q, k, v, g, beta, state, mx.array(T, dtype=mx.int32)],
        template=[("InT", q.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                  ("KEEP", int(keep_states))],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), (T if keep_states else 1, B, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
    )
    return y, states
