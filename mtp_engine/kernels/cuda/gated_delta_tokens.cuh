// Device helpers of the recurrence kernel (gated_delta_tokens.cu), passed to MLX as its header.
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return x;
}
