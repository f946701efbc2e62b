"""The gated-delta recurrence over T tokens in one CUDA kernel launch.

On CUDA, mlx-lm's gated-delta recurrence runs as ops, one step per token
(its fused kernel is Metal-only): a verify forward over K+1 tokens launches
K+1 copies of the step in each gated-delta layer, and a long prefill runs a
Python loop over its tokens. This kernel (``cuda/gated_delta_tokens.cu``)
runs all T steps in one launch, one warp per row of the recurrent state (as
mlx-lm's Metal kernel does). A single sequence's verify forward writes the
state after every token, and its commit slices one out. A batch's verify
forward does not (B rows x T tokens of states, 9.4 GB for the 80B-A3B shapes
at B=32, T=4): `DeferredStates` keeps the recurrence's inputs, and the
commit runs the kernel again to each row's last kept token (`AT`), a few
steps per row instead of holding every token's state.

Every token gets the same arithmetic whether it comes alone or among T, so
the captured states of a verify forward equal the states of one-token
decoding through this kernel bit for bit; the engine therefore uses it for
all its own forwards on CUDA (decode, verify, prefill). mlx-lm's decoding of
the same model keeps mlx-lm's ops, whose sums round in another order, so the
two may part on numerical near-ties (what `mtp_engine.tools.lossless` checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g

from mtp_engine.cache.capture import StackedStates
from mtp_engine.backend import is_cuda_backend
from mtp_engine.kernels.cuda_build import CudaKernel

SOURCES = Path(__file__).parent / "cuda"


def availability() -> str | None:
    """None on MLX's CUDA backend, else why the kernel cannot run."""
    if not is_cuda_backend():
        return "not MLX's CUDA backend"
    return None


def fits(layer) -> bool:
    """Whether the kernel's launch shape fits this gated-delta layer: key
    heads that split over a warp, value heads over a block of four."""
    return layer.head_k_dim % 32 == 0 and layer.head_v_dim % 4 == 0


FINAL, EVERY, OUTPUTS, AT = 0, 1, 2, 3
"""The kernel's modes (its ``mode`` input): outputs and the last state;
outputs and every token's state; outputs only; each row's state after its
own token. An input, not a template constant: one compiled kernel serves
prefill, decode, verify and commit (a compile is about 1.3 s on the H100,
where the cache of `cuda_build` does not hold it yet)."""


@cache
def _kernel():
    return CudaKernel(
        name="gated_delta_tokens",
        input_names=["q", "k", "v", "g", "beta", "state_in", "n_tokens", "mode", "last"],
        output_names=["y", "states"],
        source=(SOURCES / "gated_delta_tokens.cu").read_text(),
        header=(SOURCES / "gated_delta_tokens.cuh").read_text(),
    )


@cache
def _int32(*values: int) -> mx.array:
    """A small constant input (token counts, indices), made once."""
    return mx.array(values, dtype=mx.int32)


def _launch(q, k, v, g, beta, state, mode: int, last: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """One launch of the kernel in ``mode``; ``last`` ``[B]`` (int32) is each
    row's last token in mode `AT`. Returns ``(y, states)`` (either a
    placeholder where the mode writes none)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    n_states = {FINAL: 1, EVERY: T, AT: 1}.get(mode)  # None: the mode writes no state
    return _kernel()(
        inputs=[q, k, v, g, beta, state, _int32(T), _int32(mode), _int32(0) if last is None else last],
        template=[("InT", q.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(1,) if mode == AT else (B, T, Hv, Dv),
                       (1,) if n_states is None else (n_states, B, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
    )


class DeferredStates(Sequence):
    """The state after each token of a verify forward, computed only for the
    token a commit keeps.

    A verify forward of B rows x T tokens would write T states of ``Hv x Dv x
    Dk`` floats per row and layer and hold them until its commit (9.4 GB for
    the 80B-A3B shapes at B=32, T=4), then keep one per row. Instead it
    writes its outputs only, and this keeps the recurrence's inputs (about
    1/128 of those states' size); the commit runs the kernel again over each
    row's kept tokens (`AT`), the same steps bit for bit. The commit thus
    replays the recurrence alone (a few steps per row in one launch), not
    the layer."""

    def __init__(self, q, k, v, g, beta, state):
        self.inputs = (q, k, v, g, beta, state)

    def __len__(self) -> int:
        return self.inputs[0].shape[1]

    def __getitem__(self, t: int) -> mx.array:
        t = range(len(self))[t]  # negative indices; IndexError past the end
        return self.rows(_int32(*[t] * self.inputs[0].shape[0]))

    def rows(self, last: mx.array) -> mx.array:
        """``[B, Hv, Dv, Dk]``: row b's state after its token ``last[b]``."""
        return _launch(*self.inputs, AT, last.astype(mx.int32))[1][0]

    def stacked(self) -> mx.array:
        """Every token's state, ``[T, B, Hv, Dv, Dk]``."""
        return _launch(*self.inputs, EVERY)[1]


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
) -> tuple[mx.array, Sequence]:
    """The recurrence of ``mlx_lm``'s ``gated_delta_update`` over all tokens.

    Args:
        q, k: Normalized queries and keys ``[B, T, Hk, Dk]``.
        v: Values ``[B, T, Hv, Dv]``.
        a, b: Gate inputs ``[B, T, Hv]``.
        A_log, dt_bias: The layer's gate parameters.
        state: Recurrent state ``[B, Hv, Dv, Dk]``, float32.
        keep_states: Give the state after every token (else the last only).

    Returns:
        ``(y, states)``: outputs ``[B, T, Hv, Dv]`` and the float32 states
        ``[B, Hv, Dv, Dk]`` after every token, or after the last only. One
        row writes its T states (a few MB a layer; its commit is a slice);
        a batch of rows defers them (`DeferredStates`), whose size grows
        with the batch.
    """
    beta = mx.sigmoid(b)
    g = compute_g(A_log, a, dt_bias)
    if keep_states and q.shape[0] > 1:
        y, _ = _launch(q, k, v, g, beta, state, OUTPUTS)
        return y, DeferredStates(q, k, v, g, beta, state)
    y, states = _launch(q, k, v, g, beta, state, EVERY if keep_states else FINAL)
    return y, StackedStates(states)
