"""A whole chain of MTP drafts in one CUDA kernel launch.

On a GPU a small model's decoding is host-bound: every kernel costs a few
microseconds of host time (Python building the graph, MLX encoding the
launch) and the GPU idles between them. A draft step of the shipped model's
head is about fifty kernels even compiled (`compiled_head`), so a chain of
eight drafts launched about as many kernels as the verify forward it feeds,
and drafting took two fifths of a decoding step on the H200 (README, H200).

`ChainKernel` runs the head's whole chain in one launch of one thread block:
the pending pairs (the accepted tokens against the trunk's true hiddens),
then K-1 greedy steps, each feeding its token and hidden to the next. The
block works through each step in phases separated by ``__syncthreads``:
norms, the ``fc``, the attention projections, RMS-normed queries and keys
with RoPE, attention over the head's KV cache and the new positions, the
gated output projection, the MoE block (softmax router, top-k, SwiGLU
experts, sigmoid-gated shared expert), the final norm, the LM head and an
argmax. Products are warp-per-output dot products over 16-byte weight
loads; everything accumulates in float32.

What it keeps: the pending pairs' keys and values come back in the cache's
dtype and join the head's KV cache (those positions are committed text, as
with the MLX head); the drafted positions' keys and values live only in
the kernel's scratch, since the next commit drops them anyway.

Drafts only propose tokens: the verify forward decides every emitted token,
so this arithmetic (float32 throughout, where the MLX head rounds each op to
the model's dtype) changes acceptance at most, never the output. The tests
run this source on the CPU under a small SIMT emulator
(``tests/mtp_engine/simt_emu.h``) against the MLX head, and on CUDA
machines for real (`tests/mtp_engine/test_cuda_drafter.py`).

It serves one-layer heads with the MoE block and unquantized weights of one
float dtype, and only where one thread block can stream the head fast
enough: small heads (see `MAX_STEP_BYTES`). Larger heads keep the MLX head.
"""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.cpu_drafter import FLOATS, head_weights
from mtp_engine.drafter import MTPDrafter, MTPDraftState
from mtp_engine.mtp_head import MTPHead

MAX_PENDING = 16
"""Pending pairs the kernel consumes at most; a prompt's head prefill (more
pairs) runs through the MLX head first, all but its last pair."""

MAX_DRAFTS = 32
"""Deepest chain the kernel drafts in one launch."""

MAX_STEP_BYTES = 32 << 20
"""Weight bytes one draft step may read for the kernel to serve the head.
One block streams them (mostly from L2 after the first step): the shipped
model's head reads about 3 MB a step; a Qwen3-Next-80B head, whose LM head
alone is 600 MB in bfloat16, keeps the MLX head."""

THREADS = 512
"""Threads of the one block (16 warps). MLX's custom kernels cannot declare
launch bounds, so 1024 threads launch only while the compiler keeps to 64
registers a thread: it did for the shipped model's bfloat16 head (56 as
NVCC 13 compiles it for sm_90) but not for a float32 test head ("too many
resources requested for launch"). 512 allows 128. On the H200, chains of
8 took 1.23 ms with either (`benchmarks/chain_kernel_probe.py`)."""

WEIGHT_ORDER = (
    "embed", "lm_head", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm",
    "layers.0.input_layernorm", "layers.0.post_attention_layernorm",
    "layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj", "layers.0.o_proj",
    "layers.0.q_norm", "layers.0.k_norm", "layers.0.router",
    "layers.0.experts.gate_proj", "layers.0.experts.up_proj", "layers.0.experts.down_proj",
    "layers.0.shared.gate_proj", "layers.0.shared.up_proj", "layers.0.shared.down_proj",
    "layers.0.shared_gate",
)
"""Head weights in the kernel's argument order (names of `head_weights`)."""

WEIGHT_ARGS = (
    "embed", "lm_head", "norm_e", "norm_h", "fc", "norm_f", "in_norm", "post_norm",
    "q_w", "k_w", "v_w", "o_w", "q_norm", "k_norm", "router",
    "e_gate", "e_up", "e_down", "s_gate", "s_up", "s_down", "s_weight",
)
"""The kernel's names for them."""

INPUT_NAMES = ("hidden", "tokens", "meta", "fparams", "inv_freq", "k_cache", "v_cache") + WEIGHT_ARGS
OUTPUT_NAMES = ("drafts", "new_k", "new_v", "work")

HEADER = r"""
#define MTP_FULL_MASK 0xffffffffu
#define MTP_NEG_MAX (-3.402823466e38f)

__device__ __forceinline__ float mtp_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MTP_FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ float mtp_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MTP_FULL_MASK, v, o));
  return v;
}

// The warp's largest (value, index), the lowest index among equal values.
__device__ __forceinline__ void mtp_warp_argmax(float& value, int& index) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(MTP_FULL_MASK, value, o);
    const int oi = __shfl_xor_sync(MTP_FULL_MASK, index, o);
    if (ov > value || (ov == value && oi < index)) {
      value = ov;
      index = oi;
    }
  }
}

__device__ __forceinline__ float mtp_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float mtp_silu(float x) { return x * mtp_sigmoid(x); }

// 16 bytes of T (8 bfloat16 / float16 or 4 float32) from a 16-byte aligned address.
template <typename T>
__device__ __forceinline__ void mtp_load(const T* p, float* out) {
  constexpr int N = 16 / sizeof(T);
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = static_cast<float>(v[i]);
}

// One warp: out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i] for i < n.
template <typename X, typename T>
__device__ void mtp_rms_row(const X* x, const T* w, int n, float eps, float* out, int lane) {
  float ss = 0.0f;
  for (int i = lane; i < n; i += 32) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float r = rsqrtf(mtp_warp_sum(ss) / static_cast<float>(n) + eps);
  for (int i = lane; i < n; i += 32) out[i] = static_cast<float>(x[i]) * r * static_cast<float>(w[i]);
}

// One warp: dst = RoPE(rms(src) * w) over one head of HD values; RoPE
// (not traditional) rotates pairs (i, i + RD/2) for i < RD/2 by pos * inv_freq[i].
template <int HD, int RD, typename T>
__device__ void mtp_norm_rope(const float* src, const T* w, float* dst, float pos, const float* inv_freq,
                              float eps, int lane) {
  mtp_rms_row(src, w, HD, eps, dst, lane);
  __syncwarp();
  for (int i = lane; i < RD / 2; i += 32) {
    const float angle = pos * inv_freq[i];
    const float c = cosf(angle), s = sinf(angle);
    const float a = dst[i], b = dst[i + RD / 2];
    dst[i] = a * c - b * s;
    dst[i + RD / 2] = a * s + b * c;
  }
  __syncwarp();
}

template <typename T, int IN>
__device__ void mtp_matvec(const T* w, int out, const float* x, float* y, const float* resid);

// The block: y[r * ys + o] = w[o] . x[r * xs .. + IN] for o < out, r < rows
// (w row-major [out][IN]); a warp per output, four rows at a time (one row:
// `mtp_matvec`).
template <typename T, int IN>
__device__ void mtp_matvec_rows(const T* w, int out, const float* x, int xs, int rows, float* y, int ys) {
  if (rows == 1) {
    mtp_matvec<T, IN>(w, out, x, y, nullptr);
    return;
  }
  constexpr int N = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o = warp; o < out; o += warps) {
    const T* wr = w + static_cast<size_t>(o) * IN;
    for (int r0 = 0; r0 < rows; r0 += 4) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int k = lane * N; k < IN; k += 32 * N) {
        float wv[N];
        mtp_load<T>(wr + k, wv);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if (r0 + r < rows) {
            const float* xr = x + (r0 + r) * xs + k;
#pragma unroll
            for (int i = 0; i < N; ++i) acc[r] += wv[i] * xr[i];
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (r0 + r < rows) {  // the same for the whole warp
          const float s = mtp_warp_sum(acc[r]);
          if (lane == 0) y[(r0 + r) * ys + o] = s;
        }
      }
    }
  }
}

// The block: y[o] = (resid ? resid[o] : 0) + w[o] . x for o < out; each
// warp takes four outputs at a time, their loads in flight together.
template <typename T, int IN>
__device__ void mtp_matvec(const T* w, int out, const float* x, float* y, const float* resid) {
  constexpr int N = 16 / sizeof(T);
  constexpr int U = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o0 = warp * U; o0 < out; o0 += warps * U) {
    float acc[U] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k = lane * N; k < IN; k += 32 * N) {
      float xv[N];
#pragma unroll
      for (int i = 0; i < N; ++i) xv[i] = x[k + i];
      uint4 raw[U];
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const int o = o0 + j < out ? o0 + j : o0;
        raw[j] = *reinterpret_cast<const uint4*>(w + static_cast<size_t>(o) * IN + k);
      }
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const T* v = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[j] += static_cast<float>(v[i]) * xv[i];
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const float s = mtp_warp_sum(acc[j]);
      if (lane == 0 && o0 + j < out) y[o0 + j] = (resid != nullptr ? resid[o0 + j] : 0.0f) + s;
    }
  }
}
"""

SOURCE = r"""
  // Template constants: W (weights), HT (hidden), CT (KV cache) dtypes; DIM,
  // H, KVH, HD, RD (rotated dims), V (vocabulary), E, TOPK, ED (expert
  // width), SD (shared expert width), NORM_TOPK, MAXM (pending pairs at
  // most), MAXK (drafts at most). The draft count is read at run time, so
  // one compiled kernel serves every chain depth (the last steps of a
  // generation draft fewer than K).
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int offset = meta[0];  // head cache entries before this call
  const int m = meta[1];       // pending pairs
  const int cap = meta[2];     // positions allocated in k_cache / v_cache
  const int pmax = meta[3];    // positions a score row holds (offset + m + drafts)
  const int K = meta[4];       // drafts, 1..MAXK
  const float eps = fparams[0], rope_scale = fparams[1], attn_scale = fparams[2];
  constexpr int QO = H * HD;
  constexpr int KVO = KVH * HD;
  constexpr int GROUP = H / KVH;
  constexpr int PARTS = 32;

  float* both = work;                      // MAXM x 2 DIM: normed [embedding, hidden]
  float* xs = both + MAXM * 2 * DIM;       // MAXM x DIM: fc output, then the residual stream
  float* as = xs + MAXM * DIM;             // MAXM x DIM: input-normed
  float* kv = as + MAXM * DIM;             // MAXM x 2 KVO: raw keys, values
  float* qg = kv + MAXM * 2 * KVO;         // 2 QO: query and gate per head (last row)
  float* qs = qg + 2 * QO;                 // QO: normed, rotated queries
  float* att = qs + QO;                    // QO: gated attention output
  float* a2 = att + QO;                    // DIM: post-attention-normed
  float* rt = a2 + DIM;                    // E: router logits, then probabilities
  float* sgate = rt + E;                   // 4: the shared expert's gate logit
  float* sg = sgate + 4;                   // SD: shared gate_proj, then SwiGLU
  float* su = sg + SD;                     // SD: shared up_proj
  float* ys = su + SD;                     // DIM: shared expert output
  float* eg = ys + DIM;                    // TOPK x ED: experts' gate_proj, then SwiGLU
  float* eu = eg + TOPK * ED;              // TOPK x ED: experts' up_proj
  float* ye = eu + TOPK * ED;              // TOPK x DIM: experts' outputs
  float* mb = ye + TOPK * DIM;             // DIM: the head's normed hidden M
  float* logits = mb + DIM;                // V
  float* knew = logits + V;                // (MAXM + MAXK) x KVO: keys of the new positions
  float* vnew = knew + (MAXM + MAXK) * KVO;  // (MAXM + MAXK) x KVO: their values
  float* part = vnew + (MAXM + MAXK) * KVO;  // PARTS x QO: partial attention sums
  float* scores = part + PARTS * QO;       // H x pmax

  __shared__ int tok_sh;
  __shared__ int sel_e[TOPK];
  __shared__ float sel_w[TOPK];
  __shared__ float sgw_sh;
  __shared__ float red_v[32];
  __shared__ int red_i[32];

  for (int step = 0; step < K; ++step) {
    const int rows = step == 0 ? m : 1;
    const int first_new = step == 0 ? 0 : m + step - 1;  // index in knew of row 0
    const int pos0 = offset + first_new;                  // its position
    const int last = rows - 1;
    const int plast = pos0 + last;
    const int npos = plast + 1;                           // visible positions

    // Normed embeddings and hiddens of the rows.
    for (int t = warp; t < 2 * rows; t += warps) {
      const int r = t >> 1;
      float* dst = both + r * 2 * DIM + (t & 1) * DIM;
      if ((t & 1) == 0) {
        const int token = step == 0 ? tokens[r] : tok_sh;
        mtp_rms_row(embed + static_cast<size_t>(token) * DIM, norm_e, DIM, eps, dst, lane);
      } else if (step == 0) {
        mtp_rms_row(hidden + static_cast<size_t>(r) * DIM, norm_h, DIM, eps, dst, lane);
      } else {
        mtp_rms_row(mb, norm_h, DIM, eps, dst, lane);
      }
    }
    __syncthreads();
    mtp_matvec_rows<W, 2 * DIM>(fc, DIM, both, 2 * DIM, rows, xs, DIM);
    __syncthreads();
    for (int r = warp; r < rows; r += warps) mtp_rms_row(xs + r * DIM, in_norm, DIM, eps, as + r * DIM, lane);
    __syncthreads();
    mtp_matvec_rows<W, DIM>(k_w, KVO, as, DIM, rows, kv, 2 * KVO);
    mtp_matvec_rows<W, DIM>(v_w, KVO, as, DIM, rows, kv + KVO, 2 * KVO);
    mtp_matvec<W, DIM>(q_w, 2 * QO, as + last * DIM, qg, nullptr);
    __syncthreads();

    // Keys (normed, rotated) and values of every row; the last row's queries.
    for (int t = warp; t < rows * KVH + H; t += warps) {
      if (t < rows * KVH) {
        const int r = t / KVH, h = t % KVH;
        const int ni = first_new + r;
        float* kd = knew + (ni * KVH + h) * HD;
        float* vd = vnew + (ni * KVH + h) * HD;
        mtp_norm_rope<HD, RD>(kv + r * 2 * KVO + h * HD, k_norm, kd, static_cast<float>(pos0 + r) * rope_scale,
                              inv_freq, eps, lane);
        for (int d = lane; d < HD; d += 32) vd[d] = kv[r * 2 * KVO + KVO + h * HD + d];
        if (step == 0) {
          for (int d = lane; d < HD; d += 32) {
            new_k[(h * m + r) * HD + d] = static_cast<CT>(kd[d]);
            new_v[(h * m + r) * HD + d] = static_cast<CT>(vd[d]);
          }
        }
      } else {
        const int h = t - rows * KVH;
        mtp_norm_rope<HD, RD>(qg + h * 2 * HD, q_norm, qs + h * HD, static_cast<float>(plast) * rope_scale,
                              inv_freq, eps, lane);
      }
    }
    __syncthreads();

    // Attention of the last row over positions 0..plast: scores, softmax, sums.
    for (int it = tid; it < H * npos; it += blockDim.x) {
      const int h = it / npos, p = it % npos, kvh = h / GROUP;
      const float* q = qs + h * HD;
      float s = 0.0f;
      if (p < offset) {
        const CT* kp = k_cache + (static_cast<size_t>(kvh) * cap + p) * HD;
        for (int d = 0; d < HD; ++d) s += q[d] * static_cast<float>(kp[d]);
      } else {
        const float* kp = knew + ((p - offset) * KVH + kvh) * HD;
        for (int d = 0; d < HD; ++d) s += q[d] * kp[d];
      }
      scores[h * pmax + p] = s * attn_scale;
    }
    __syncthreads();
    for (int h = warp; h < H; h += warps) {
      float* srow = scores + h * pmax;
      float top = MTP_NEG_MAX;
      for (int p = lane; p < npos; p += 32) top = fmaxf(top, srow[p]);
      top = mtp_warp_max(top);
      float total = 0.0f;
      for (int p = lane; p < npos; p += 32) {
        const float e = expf(srow[p] - top);
        srow[p] = e;
        total += e;
      }
      const float inv = 1.0f / mtp_warp_sum(total);
      for (int p = lane; p < npos; p += 32) srow[p] *= inv;
    }
    __syncthreads();
    const int groups = max(1, min(PARTS, static_cast<int>(blockDim.x) / QO));
    for (int it = tid; it < QO * groups; it += blockDim.x) {
      const int item = it % QO, g = it / QO;
      const int h = item / HD, d = item % HD, kvh = h / GROUP;
      const float* prob = scores + h * pmax;
      float s = 0.0f;
      for (int p = g; p < npos; p += groups) {
        const float v = p < offset ? static_cast<float>(v_cache[(static_cast<size_t>(kvh) * cap + p) * HD + d])
                                   : vnew[((p - offset) * KVH + kvh) * HD + d];
        s += prob[p] * v;
      }
      part[g * QO + item] = s;
    }
    __syncthreads();
    for (int item = tid; item < QO; item += blockDim.x) {
      float s = 0.0f;
      for (int g = 0; g < groups; ++g) s += part[g * QO + item];
      const int h = item / HD, d = item % HD;
      att[item] = s * mtp_sigmoid(qg[h * 2 * HD + HD + d]);
    }
    __syncthreads();

    // Residual: x += o_proj(att); then the MoE half.
    float* x = xs + last * DIM;
    mtp_matvec<W, QO>(o_w, DIM, att, x, x);
    __syncthreads();
    if (warp == 0) mtp_rms_row(x, post_norm, DIM, eps, a2, lane);
    __syncthreads();
    mtp_matvec<W, DIM>(router, E, a2, rt, nullptr);
    mtp_matvec<W, DIM>(s_weight, 1, a2, sgate, nullptr);
    mtp_matvec<W, DIM>(s_gate, SD, a2, sg, nullptr);
    mtp_matvec<W, DIM>(s_up, SD, a2, su, nullptr);
    __syncthreads();
    if (tid == 0) {
      // Softmax over the experts, then the TOPK likeliest (ties: lower index).
      float top = rt[0];
      for (int e = 1; e < E; ++e) top = fmaxf(top, rt[e]);
      float total = 0.0f;
      for (int e = 0; e < E; ++e) {
        rt[e] = expf(rt[e] - top);
        total += rt[e];
      }
      float chosen = 0.0f;
      for (int j = 0; j < TOPK; ++j) {
        int best = -1;
        for (int e = 0; e < E; ++e) {
          bool taken = false;
          for (int i = 0; i < j; ++i) taken = taken || sel_e[i] == e;
          if (!taken && (best < 0 || rt[e] > rt[best])) best = e;
        }
        sel_e[j] = best;
        sel_w[j] = rt[best] / total;
        chosen += sel_w[j];
      }
      if (NORM_TOPK) {
        for (int j = 0; j < TOPK; ++j) sel_w[j] /= chosen;
      }
      sgw_sh = mtp_sigmoid(sgate[0]);
    }
    for (int i = tid; i < SD; i += blockDim.x) sg[i] = mtp_silu(sg[i]) * su[i];
    __syncthreads();
    for (int j = 0; j < TOPK; ++j) {
      const size_t e = static_cast<size_t>(sel_e[j]);
      mtp_matvec<W, DIM>(e_gate + e * ED * DIM, ED, a2, eg + j * ED, nullptr);
      mtp_matvec<W, DIM>(e_up + e * ED * DIM, ED, a2, eu + j * ED, nullptr);
    }
    mtp_matvec<W, SD>(s_down, DIM, sg, ys, nullptr);
    __syncthreads();
    for (int i = tid; i < TOPK * ED; i += blockDim.x) eg[i] = mtp_silu(eg[i]) * eu[i];
    __syncthreads();
    for (int j = 0; j < TOPK; ++j) {
      const size_t e = static_cast<size_t>(sel_e[j]);
      mtp_matvec<W, ED>(e_down + e * DIM * ED, DIM, eg + j * ED, ye + j * DIM, nullptr);
    }
    __syncthreads();
    if (warp == 0) {
      // x += experts + gated shared expert; M = rms(x) * norm.
      float ss = 0.0f;
      for (int o = lane; o < DIM; o += 32) {
        float v = x[o] + sgw_sh * ys[o];
        for (int j = 0; j < TOPK; ++j) v += sel_w[j] * ye[j * DIM + o];
        x[o] = v;
        ss += v * v;
      }
      const float r = rsqrtf(mtp_warp_sum(ss) / static_cast<float>(DIM) + eps);
      for (int o = lane; o < DIM; o += 32) mb[o] = x[o] * r * static_cast<float>(norm_f[o]);
    }
    __syncthreads();
    mtp_matvec<W, DIM>(lm_head, V, mb, logits, nullptr);
    __syncthreads();

    // Greedy token: the largest logit, the lowest index among equals.
    float bv = MTP_NEG_MAX;
    int bi = 0x7fffffff;
    for (int i = tid; i < V; i += blockDim.x) {
      if (logits[i] > bv) {
        bv = logits[i];
        bi = i;
      }
    }
    mtp_warp_argmax(bv, bi);
    if (lane == 0) {
      red_v[warp] = bv;
      red_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
      bv = lane < warps ? red_v[lane] : MTP_NEG_MAX;
      bi = lane < warps ? red_i[lane] : 0x7fffffff;
      mtp_warp_argmax(bv, bi);
      if (lane == 0) {
        tok_sh = bi;
        drafts[step] = bi;
      }
    }
    __syncthreads();
  }
"""


def work_offsets(config: dict) -> dict[str, int]:
    """Where each scratch buffer of the kernel starts, in floats (the layout
    at the top of `SOURCE`); ``"scores"`` is last and holds ``heads x pmax``."""
    dim, qo = config["dim"], config["heads"] * config["head_dim"]
    kvo = config["kv_heads"] * config["head_dim"]
    ed, sd, topk = config["expert_dim"], config["shared_dim"], config["top_k"]
    sizes = [
        ("both", MAX_PENDING * 2 * dim), ("xs", MAX_PENDING * dim), ("as", MAX_PENDING * dim),
        ("kv", MAX_PENDING * 2 * kvo), ("qg", 2 * qo), ("qs", qo), ("att", qo), ("a2", dim),
        ("rt", config["experts"]), ("sgate", 4), ("sg", sd), ("su", sd), ("ys", dim),
        ("eg", topk * ed), ("eu", topk * ed), ("ye", topk * dim), ("mb", dim), ("logits", config["vocab"]),
        ("knew", (MAX_PENDING + MAX_DRAFTS) * kvo), ("vnew", (MAX_PENDING + MAX_DRAFTS) * kvo), ("part", 32 * qo),
        ("scores", 0),
    ]
    offsets, at = {}, 0
    for name, size in sizes:
        offsets[name] = at
        at += size
    return offsets


def kernel_weights(head: MTPHead, embed: nn.Module, lm_head: nn.Module) -> tuple[list[mx.array], dict] | None:
    """The kernel's weights (in `WEIGHT_ARGS` order) and configuration, or
    None where it cannot serve the head: several MTP layers, quantized or
    mixed-dtype weights, a dense MLP, a scaled or traditional RoPE, widths
    that are not whole 16-byte loads, or a head too large for one block
    (`MAX_STEP_BYTES`)."""
    if len(head.layers) != 1:
        return None
    found = head_weights(head, embed, lm_head, FLOATS)
    if found is None:
        return None
    named, config = found
    dtypes = {w.dtype for w in named.values()}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    lanes = 16 // dtype.size
    widths = (config["dim"], config["heads"] * config["head_dim"], config["expert_dim"], config["shared_dim"])
    if any(w % lanes for w in widths):
        return None
    if config["heads"] % config["kv_heads"] or config["rope_dims"] % 2 or config["top_k"] > config["experts"]:
        return None
    dim = config["dim"]
    step_bytes = dtype.size * (
        config["vocab"] * dim + 2 * dim * dim
        + dim * (2 * config["heads"] + 2 * config["kv_heads"]) * config["head_dim"]
        + config["heads"] * config["head_dim"] * dim
        + 3 * dim * (config["top_k"] * config["expert_dim"] + config["shared_dim"])
    )
    if step_bytes > MAX_STEP_BYTES:
        return None
    return [mx.contiguous(named[name]) for name in WEIGHT_ORDER], config


@cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="mtp_draft_chain",
        input_names=list(INPUT_NAMES),
        output_names=list(OUTPUT_NAMES),
        source=SOURCE,
        header=HEADER,
    )


class ChainKernel:
    """The chain kernel bound to one head's weights.

    Args:
        weights, config: What `kernel_weights` returned. The weights' dtype
            is also the KV cache's while the cache is empty.
    """

    def __init__(self, weights: list[mx.array], config: dict):
        self.weights = weights
        self.config = config
        self.dtype = weights[0].dtype
        self.fixed_work = work_offsets(config)["scores"]  # scratch floats ahead of the score rows
        c = config
        half = c["rope_dims"] // 2
        self.inv_freq = mx.array(
            [float(c["rope_base"]) ** (-2.0 * i / c["rope_dims"]) for i in range(half)] or [0.0],
            dtype=mx.float32,
        )
        self.fparams = mx.array([c["eps"], c["rope_scale"], 1.0 / math.sqrt(c["head_dim"])], dtype=mx.float32)

    def template(self, hidden_dtype: mx.Dtype, cache_dtype: mx.Dtype) -> list[tuple]:
        c = self.config
        return [
            ("W", self.dtype), ("HT", hidden_dtype), ("CT", cache_dtype),
            ("DIM", c["dim"]), ("H", c["heads"]), ("KVH", c["kv_heads"]), ("HD", c["head_dim"]),
            ("RD", c["rope_dims"]), ("V", c["vocab"]), ("E", c["experts"]), ("TOPK", c["top_k"]),
            ("ED", c["expert_dim"]), ("SD", c["shared_dim"]), ("NORM_TOPK", bool(c["norm_topk"])),
            ("MAXM", MAX_PENDING), ("MAXK", MAX_DRAFTS),
        ]

    def arguments(self, hidden: mx.array, tokens: list[int], keys, values, offset: int, k: int):
        """Inputs, template, output shapes and dtypes of one launch (shared
        with the tests' emulator)."""
        c = self.config
        m = len(tokens)
        cache_dtype = keys.dtype if keys is not None else self.dtype
        if keys is None:
            keys = values = mx.zeros((1, c["kv_heads"], 1, c["head_dim"]), dtype=cache_dtype)
        pmax = offset + m + k
        if not 1 <= m <= MAX_PENDING or not 1 <= k <= MAX_DRAFTS:
            raise ValueError(f"the chain kernel takes 1..{MAX_PENDING} pairs and 1..{MAX_DRAFTS} drafts, "
                             f"got {m} and {k}")
        meta = mx.array([offset, m, keys.shape[2], pmax, k], dtype=mx.int32)
        inputs = [hidden, mx.array(tokens, dtype=mx.int32), meta, self.fparams, self.inv_freq, keys, values]
        inputs += self.weights
        shapes = [(k,), (c["kv_heads"], m, c["head_dim"]), (c["kv_heads"], m, c["head_dim"]),
                  (self.fixed_work + c["heads"] * pmax,)]
        dtypes = [mx.int32, cache_dtype, cache_dtype, mx.float32]
        return inputs, self.template(hidden.dtype, cache_dtype), shapes, dtypes

    def __call__(self, hidden: mx.array, tokens: list[int], keys, values, offset: int, k: int):
        """Launch the chain: ``hidden`` ``[m, dim]`` and ``tokens`` (m pending
        pairs, m <= `MAX_PENDING`) at positions ``offset..``, over a KV cache
        (``keys``/``values`` ``[1, kv_heads, cap, head_dim]`` holding
        ``offset`` entries, or None when empty). Returns the drafts ``[k]``
        int32 and the pairs' keys and values ``[kv_heads, m, head_dim]``."""
        inputs, template, shapes, dtypes = self.arguments(hidden, tokens, keys, values, offset, k)
        drafts, new_k, new_v, _ = _kernel()(
            inputs=inputs, template=template, grid=(THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=shapes, output_dtypes=dtypes,
        )
        return drafts, new_k, new_v


def chain_kernel(head: MTPHead, embed: nn.Module, lm_head: nn.Module) -> ChainKernel | None:
    """A `ChainKernel` for this head, or None off CUDA or where the kernel
    cannot serve it (see `kernel_weights`)."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return None
    found = kernel_weights(head, embed, lm_head)
    if found is None:
        return None
    weights, config = found
    return ChainKernel(weights, config)


class KernelDrafter(MTPDrafter):
    """`MTPDrafter` whose chain drafts run as one `ChainKernel` launch.

    The other strategies (adaptive, trees, paths) branch on each step's
    result on the host and stay with the MLX head; the engine uses this
    drafter for chain mode only. The head's KV cache and pending pairs are
    the MLX drafter's, so the two can take turns on one state.
    """

    def __init__(self, head: MTPHead, embed: nn.Module, lm_head, kernel, prefill_step_size: int = 2048):
        # Not compiled: here the MLX head only consumes the pairs of a prompt
        # ahead of its last when there are more than 16, once per generation;
        # a second `CompiledHead` would trace each such width for one use.
        super().__init__(head, embed, lm_head, prefill_step_size)
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
        if self.dispatch_drafts:
            mx.async_eval(drafts)
        return drafts.reshape(1, k)
