// Device helpers of the chain kernel (draft_chain.cu), passed to MLX as its header.
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
