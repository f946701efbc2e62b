// A small SIMT emulator: runs a CUDA kernel body on the CPU, one block after
// another and one std::thread per CUDA thread of a block, so the tests can
// check a kernel's logic (indexing, phases, warp reductions) on machines
// without a GPU. __syncthreads is a barrier of the block, __syncwarp and the
// warp shuffles barriers of the warp (32 consecutive threads of the block, x
// fastest, as CUDA numbers them); __shared__ variables are function statics
// (one copy, seen by every thread). Only what the engine's kernels use.

#pragma once

#define MTP_SIMT_EMULATOR 1

#include <algorithm>
#include <barrier>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct simt_dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local simt_dim3 threadIdx;
inline simt_dim3 blockDim, blockIdx, gridDim;

struct uint4 {
  uint32_t x, y, z, w;
};
struct uint2 {
  uint32_t x, y;
};

// bfloat16 storage with float conversions (round to nearest even), as CUDA's.
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = static_cast<uint16_t>(u >> 16);
  }
  operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max;
using std::min;

namespace simt {
inline std::unique_ptr<std::barrier<>> block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<uint64_t> slots;  // 32 per warp
inline std::vector<uint32_t> mma_slots;  // 6 registers per thread
inline thread_local int tid;         // the thread's number in its block

// Every block of grid (gx, gy, gz) blocks of (bx, by) threads, one after another.
inline void run(int gx, int gy, int gz, int bx, int by, const std::function<void()>& body) {
  const int threads = bx * by;
  blockDim.x = bx;
  blockDim.y = by;
  blockDim.z = 1;
  gridDim.x = gx;
  gridDim.y = gy;
  gridDim.z = gz;
  for (int z = 0; z < gz; z++) {
    for (int y = 0; y < gy; y++) {
      for (int x = 0; x < gx; x++) {
        blockIdx.x = x;
        blockIdx.y = y;
        blockIdx.z = z;
        block_barrier = std::make_unique<std::barrier<>>(threads);
        warp_barriers.clear();
        for (int w = 0; w < threads / 32; w++) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
        slots.assign(threads, 0);
        mma_slots.assign(threads * 6, 0);
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; t++) {
          pool.emplace_back([t, bx, &body] {
            tid = t;
            threadIdx.x = t % bx;
            threadIdx.y = t / bx;
            threadIdx.z = 0;
            body();
          });
        }
        for (auto& th : pool) th.join();
      }
    }
  }
}

inline void run(int threads, const std::function<void()>& body) { run(1, 1, 1, threads, 1, body); }
}  // namespace simt

inline void __syncthreads() { simt::block_barrier->arrive_and_wait(); }
inline void __syncwarp() { simt::warp_barriers[simt::tid >> 5]->arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  const int lane = simt::tid & 31, warp = simt::tid >> 5;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  simt::slots[warp * 32 + lane] = bits;
  simt::warp_barriers[warp]->arrive_and_wait();
  const uint64_t other = simt::slots[warp * 32 + (lane ^ lane_mask)];
  simt::warp_barriers[warp]->arrive_and_wait();
  T out;
  std::memcpy(&out, &other, sizeof(T));
  return out;
}

// mtp_moe_mma (moe_products.cuh): a warp's m16n8k16 bfloat16 product with float
// accumulators, each lane's registers laid out as PTX's mma.sync takes them (A rows
// groupID and groupID + 8, B column groupID, C rows groupID and groupID + 8, columns
// 2 * (lane % 4) and the next). Sums in k order; the tensor cores' rounding may differ.
inline void mtp_moe_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int lane = simt::tid & 31, warp = simt::tid >> 5;
  uint32_t* mine = &simt::mma_slots[(warp * 32 + lane) * 6];
  for (int r = 0; r < 4; r++) mine[r] = a[r];
  mine[4] = b0;
  mine[5] = b1;
  simt::warp_barriers[warp]->arrive_and_wait();
  auto half = [&](int src, int reg, int k) {
    const uint32_t word = simt::mma_slots[(warp * 32 + src) * 6 + reg];
    const uint32_t bits = ((k & 1) ? word >> 16 : word & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  const int g = lane >> 2, t = lane & 3;
  float out[4];
  for (int idx = 0; idx < 4; idx++) {
    const int row = g + 8 * (idx >> 1), col = 2 * t + (idx & 1);
    float sum = 0.0f;
    for (int k = 0; k < 16; k++) {
      const float av = half((row & 7) * 4 + (k & 7) / 2, (row >= 8) + 2 * (k >= 8), k);
      const float bv = half(col * 4 + (k & 7) / 2, 4 + (k >= 8), k);
      sum += av * bv;
    }
    out[idx] = c[idx] + sum;
  }
  simt::warp_barriers[warp]->arrive_and_wait();
  for (int idx = 0; idx < 4; idx++) c[idx] = out[idx];
}
