// One quantized product of every expert over the tokens routed to it
// (mtp_engine/kernels/cuda_moe.py). The body of an mx.fast.cuda_kernel: MLX wraps it in a
// kernel whose arguments are the inputs (x, perm, experts, w0, s0, b0, w1, s1, b1) and
// the output y, with the template constants InT, ST (the scales' type), K, N, BITS,
// GROUP, NW, R and GLU.
//
// The selections are sorted by expert: experts[s] is selection s's expert.
// GLU = 1: y[s] = silu(x[perm[s]] W0^T) * (x[perm[s]] W1^T)  (gate, up; y in sorted order)
// GLU = 0: y[perm[s]] = x[s] W0^T                            (down; y back in routing order)
// grid (32, N / NW, ceil(selections / R)), blocks of (32, warps, 1): each warp owns NW output
// features and R consecutive sorted selections, and reads each expert's weights among them
// once; each lane takes 8 bytes of packed weights per step. A selection's value does not
// depend on which others share its launch (same words, same order, same sums).
  constexpr int EPT = BITS == 4 ? 16 : 8;       // weights per lane and step: 8 bytes
  constexpr int PER_WORD = 32 / BITS;           // quantized values per packed uint32
  constexpr int STEPS = K / (32 * EPT);
  constexpr int WORDS = K / PER_WORD;           // packed words per weight row
  constexpr int GROUPS = K / GROUP;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr int MATS = GLU ? 2 : 1;
  const int lane = threadIdx.x;
  const int n0 = (blockIdx.y * blockDim.y + threadIdx.y) * NW;
  const int end = min((int)(blockIdx.z + 1) * R, (int)experts_shape[0]);
  const uint32_t* wq[2] = {w0, w1};
  const ST* sc[2] = {s0, s1};
  const ST* bi[2] = {b0, b1};

  for (int r0 = blockIdx.z * R; r0 < end;) {
    const int e = experts[r0];
    int nr = 1;
    while (r0 + nr < end && experts[r0 + nr] == e) {
      ++nr;
    }
    int xrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int s = r0 + (r < nr ? r : 0);
      xrow[r] = GLU ? perm[s] : s;
    }
    float acc[MATS][NW][R];
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][j][r] = 0.0f;

#pragma unroll
    for (int step = 0; step < STEPS; ++step) {
      const int k0 = (step * 32 + lane) * EPT;
      float wf[MATS][NW][EPT];
#pragma unroll
      for (int m = 0; m < MATS; ++m) {
#pragma unroll
        for (int j = 0; j < NW; ++j) {
          const size_t row = (size_t)e * N + n0 + j;
          const uint2 raw = *reinterpret_cast<const uint2*>(wq[m] + row * WORDS + k0 / PER_WORD);
          const float scale = static_cast<float>(sc[m][row * GROUPS + k0 / GROUP]);
          const float bias = static_cast<float>(bi[m][row * GROUPS + k0 / GROUP]);
#pragma unroll
          for (int v = 0; v < EPT; ++v) {
            const uint32_t word = v < PER_WORD ? raw.x : raw.y;
            const float q = static_cast<float>((word >> (BITS * (v % PER_WORD))) & MASK);
            wf[m][j][v] = fmaf(scale, q, bias);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < nr) {
          float xv[EPT];
          mtp_moe_load<InT, EPT>(x + (size_t)xrow[r] * K + k0, xv);
#pragma unroll
          for (int m = 0; m < MATS; ++m) {
#pragma unroll
            for (int j = 0; j < NW; ++j) {
              float dot = 0.0f;
#pragma unroll
              for (int v = 0; v < EPT; ++v) dot = fmaf(xv[v], wf[m][j][v], dot);
              acc[m][j][r] += dot;
            }
          }
        }
      }
    }

#pragma unroll
    for (int j = 0; j < NW; ++j) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < nr) {
          const int s = r0 + r;
          const float a0 = mtp_moe_warp_sum(acc[0][j][r]);
          if (GLU) {
            const float a1 = mtp_moe_warp_sum(acc[MATS - 1][j][r]);
            if (lane == 0) {
              // mlx-lm's swiglu as MLX's ops round it: each product, silu's sigmoid and both
              // multiplications round to InT.
              const float gate = static_cast<float>(static_cast<InT>(a0));
              const float up = static_cast<float>(static_cast<InT>(a1));
              const float sig = static_cast<float>(static_cast<InT>(1.0f / (1.0f + expf(-gate))));
              const float act = static_cast<float>(static_cast<InT>(gate * sig));
              y[(size_t)s * N + n0 + j] = static_cast<InT>(act * up);
            }
          } else if (lane == 0) {
            y[(size_t)perm[s] * N + n0 + j] = static_cast<InT>(a0);
          }
        }
      }
    }
    r0 += nr;
  }
