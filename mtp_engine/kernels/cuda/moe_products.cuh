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

// Two values rounded to T (16 bits), packed as one 32-bit register of a tensor-core
// fragment: the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t mtp_moe_pack2(float lo, float hi) {
  const T l = static_cast<T>(lo), h = static_cast<T>(hi);
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&l)) |
         (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&h)) << 16);
}

#ifndef MTP_SIMT_EMULATOR
// c += A B, one warp's m16n8k16 product of bfloat16 fragments with float accumulators
// (moe_tiles.cu; PTX's register layout). The tests' emulator defines its own.
__device__ __forceinline__ void mtp_moe_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
