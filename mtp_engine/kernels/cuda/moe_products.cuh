// Device helpers of the expert-product kernel (moe_products.cu), passed to MLX as its header.
__device__ __forceinline__ float mtp_moe_warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return x;
}

// N consecutive values of T from p (aligned to their size), as floats.
template <typename T, int N>
__device__ __forceinline__ void mtp_moe_load(const T* p, float* out) {
  constexpr int BYTES = N * sizeof(T);
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int c = 0; c < BYTES / 16; ++c) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[c];
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < 16 / (int)sizeof(T); ++i) out[c * (16 / sizeof(T)) + i] = static_cast<float>(v[i]);
    }
  } else if constexpr (BYTES == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = static_cast<float>(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = static_cast<float>(p[i]);
  }
}
