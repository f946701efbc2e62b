"""The gated-delta recurrence over T tokens in one CUDA kernel launch.

On CUDA, mlx-lm's gated-delta recurrence runs as ops, one step per token
(its fused kernel is Metal-only): a verify forward over K+1 tokens builds and
launches K+1 copies of the step in each of the model's gated-delta layers,
and a long prefill runs a Python loop over its tokens. This kernel runs all
T steps in one launch, one warp per row of the recurrent state (as mlx-lm's
Metal kernel does), and can write the state after every token, which is what
a verify forward's checkpoints need.

Every token gets the same arithmetic whether it comes alone or among T, so
the checkpoints of a verify forward equal the states of one-token decoding
through this kernel bit for bit. The engine therefore uses it for all its
own forwards on CUDA (decode, verify, prefill); mlx-lm's decoding of the same
model (the lossless reference) keeps mlx-lm's ops, whose sums round in
another order, so the two may part on numerical near-ties (what
`mtp_engine.lossless` checks).

Only runs where ``mx.cuda.is_available()``; this module is exercised by
``tests/mtp_engine/test_cuda_recurrence.py`` on a CUDA machine.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g

_HEADER = """
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return x;
}
"""

# grid (32, Dv, B*Hv), blocks of (32, 4, 1): each warp owns one row
# (b, hv, dv) of the state, each lane Dk/32 of its columns.
_SOURCE = """
  constexpr int n_per_t = Dk / 32;
  const int NT = n_tokens[0];  // read at run time: one compiled kernel serves every T
  const int lane = threadIdx.x;
  const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
  const int n = blockIdx.z;  // b * Hv + hv
  const int rows = gridDim.z;  // B * Hv
  const int b_idx = n / Hv;
  const int hv_idx = n % Hv;
  const int hk_idx = hv_idx / (Hv / Hk);

  // q, k: [B, NT, Hk, Dk]; v, y: [B, NT, Hv, Dv]; g, beta: [B, NT, Hv]
  const auto* q_ = q + b_idx * NT * Hk * Dk + hk_idx * Dk;
  const auto* k_ = k + b_idx * NT * Hk * Dk + hk_idx * Dk;
  const auto* v_ = v + b_idx * NT * Hv * Dv + hv_idx * Dv;
  auto* y_ = y + b_idx * NT * Hv * Dv + hv_idx * Dv;
  const auto* g_ = g + b_idx * NT * Hv;
  const auto* beta_ = beta + b_idx * NT * Hv;

  // state_in: [B, Hv, Dv, Dk]; states: [NT or 1, B, Hv, Dv, Dk]
  const auto* s_in = state_in + (n * Dv + dv_idx) * Dk;
  float st[n_per_t];
  for (int i = 0; i < n_per_t; ++i) {
    st[i] = static_cast<float>(s_in[n_per_t * lane + i]);
  }

  for (int t = 0; t < NT; ++t) {
    const float decay = static_cast<float>(g_[hv_idx]);
    float kv_mem = 0.0f;
    for (int i = 0; i < n_per_t; ++i) {
      const int s_idx = n_per_t * lane + i;
      st[i] = st[i] * decay;
      kv_mem += st[i] * static_cast<float>(k_[s_idx]);
    }
    kv_mem = warp_sum(kv_mem);
    const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);
    float out = 0.0f;
    for (int i = 0; i < n_per_t; ++i) {
      const int s_idx = n_per_t * lane + i;
      st[i] = st[i] + static_cast<float>(k_[s_idx]) * delta;
      out += st[i] * static_cast<float>(q_[s_idx]);
    }
    out = warp_sum(out);
    if (lane == 0) {
      y_[dv_idx] = static_cast<InT>(out);
    }
    if (KEEP || t == NT - 1) {
      auto* s_out = states + ((KEEP ? t : 0) * rows + n) * Dv * Dk + dv_idx * Dk;
      for (int i = 0; i < n_per_t; ++i) {
        s_out[n_per_t * lane + i] = st[i];
      }
    }
    q_ += Hk * Dk;
    k_ += Hk * Dk;
    v_ += Hv * Dv;
    y_ += Hv * Dv;
    g_ += Hv;
    beta_ += Hv;
  }
"""


@cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="mtp_gated_delta_tokens",
        input_names=["q", "k", "v", "g", "beta", "state_in", "n_tokens"],
        output_names=["y", "states"],
        source=_SOURCE,
        header=_HEADER,
    )


def serves(layer) -> bool:
    """Whether the kernel runs this gated-delta layer's recurrence: on CUDA,
    for head dimensions that split over a warp (keys) and a block (values)."""
    return (
        mx.default_device() == mx.gpu
        and mx.cuda.is_available()
        and not layer.training
        and layer.head_k_dim % 32 == 0
        and layer.head_v_dim % 4 == 0
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
