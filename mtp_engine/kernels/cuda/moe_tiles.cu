// One 4-bit quantized product of every expert over all the tokens routed to it, on the
// tensor cores (mtp_engine/kernels/cuda_moe.py, prompt prefill). The body of an
// mx.fast.cuda_kernel: MLX wraps it in a kernel whose arguments are the inputs (x, perm,
// starts, counts, w0, s0, b0, w1, s1, b1) and the output y, with the template constants InT
// (bfloat16), ST (the scales' type), K, N, GROUP, GLU, FR and TILES.
//
// The selections are sorted by expert: expert e owns sorted places starts[e] ..
// starts[e] + counts[e] - 1.
// GLU = 1: y[s] = silu(x[perm[s]] W0^T) * (x[perm[s]] W1^T)  (gate, up; y in sorted order)
// GLU = 0: y[perm[s]] = x[s] W0^T                            (down; y back in routing order)
// grid (32, N / (16 FR), experts), blocks of (32, warps, 1): each warp owns 16 FR output
// features of one expert and runs all that expert's tokens, 8 * TILES at a time, as the 8
// columns of FR x TILES m16n8k16 products (features x tokens), so it dequantizes each of its
// weights once a pass and loads each token's fragment once for FR products. The next step's
// weights are loaded while the current step computes. Each lane reads 4 packed words (32
// weights) of each of its 2 FR feature rows a step; the k order inside a product is permuted
// to match (lane t's weights are k = 32t .. 32t + 31 of the step's 128), and each token
// column takes the same permutation of its row of x. An output depends only on its own
// token's row, so a token's values do not depend on which others share the launch.
  constexpr int WORDS = K / 8;     // packed words per weight row
  constexpr int GROUPS = K / GROUP;
  constexpr int MATS = GLU ? 2 : 1;
  constexpr int STEPS = K / 128;
  const int lane = threadIdx.x;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = (blockIdx.y * blockDim.y + threadIdx.y) * 16 * FR;
  const int e = blockIdx.z;
  const int count = counts[e];
  const int start = starts[e];
  const uint32_t* wq[2] = {w0, w1};
  const ST* sc[2] = {s0, s1};
  const ST* bi[2] = {b0, b1};
  // Row r of the lane's weights: feature n0 + 16 (r / 2) + g + 8 (r % 2) of expert e.
  constexpr int ROWS = 2 * FR;
  auto weight_row = [&](int r) { return (size_t)e * N + n0 + 16 * (r >> 1) + g + 8 * (r & 1); };

  for (int c0 = 0; c0 < count; c0 += 8 * TILES) {
    const int tiles = min(TILES, (count - c0 + 7) / 8);
    const InT* xr[TILES];  // this lane's token of each tile (column g); past the expert's last, its first
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
      const int j = c0 + 8 * i + g < count ? c0 + 8 * i + g : 0;
      xr[i] = x + (size_t)(GLU ? perm[start + j] : start + j) * K;
    }
    float acc[MATS][FR][TILES][4];
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int f = 0; f < FR; ++f)
#pragma unroll
        for (int i = 0; i < TILES; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[m][f][i][c] = 0.0f;

    uint4 raw[MATS][ROWS];
    auto load_weights = [&](int step) {
#pragma unroll
      for (int m = 0; m < MATS; ++m)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          raw[m][r] = *reinterpret_cast<const uint4*>(wq[m] + weight_row(r) * WORDS + step * 16 + 4 * t);
        }
    };
    load_weights(0);
    for (int step = 0; step < STEPS; ++step) {
      const int w = step * 16 + 4 * t;  // the lane's first word of each row this step
      uint4 cur[MATS][ROWS];
      float scale[MATS][ROWS], bias[MATS][ROWS];
#pragma unroll
      for (int m = 0; m < MATS; ++m)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          cur[m][r] = raw[m][r];
          const size_t row = weight_row(r);
          scale[m][r] = static_cast<float>(sc[m][row * GROUPS + (w * 8) / GROUP]);
          bias[m][r] = static_cast<float>(bi[m][row * GROUPS + (w * 8) / GROUP]);
        }
      if (step + 1 < STEPS) {
        load_weights(step + 1);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint4 xv[TILES];
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
          xv[i] = *reinterpret_cast<const uint4*>(xr[i] + step * 128 + 32 * t + 8 * q);
        }
        // Word q holds k = 32t + 8q + j (j = 0..7); product h takes j = 4h .. 4h + 3 as its
        // logical k (2t, 2t+1, 2t+8, 2t+9).
        uint32_t a[MATS][FR][2][4];
#pragma unroll
        for (int m = 0; m < MATS; ++m) {
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            const uint32_t word = q == 0 ? cur[m][r].x : q == 1 ? cur[m][r].y : q == 2 ? cur[m][r].z : cur[m][r].w;
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              v[j] = fmaf(scale[m][r], static_cast<float>((word >> (4 * j)) & 15u), bias[m][r]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              a[m][r >> 1][h][r & 1] = mtp_moe_pack2<InT>(v[4 * h], v[4 * h + 1]);
              a[m][r >> 1][h][2 + (r & 1)] = mtp_moe_pack2<InT>(v[4 * h + 2], v[4 * h + 3]);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
          if (i < tiles) {
#pragma unroll
            for (int m = 0; m < MATS; ++m)
#pragma unroll
              for (int f = 0; f < FR; ++f) {
                mtp_moe_mma(acc[m][f][i], a[m][f][0], xv[i].x, xv[i].y);
                mtp_moe_mma(acc[m][f][i], a[m][f][1], xv[i].z, xv[i].w);
              }
          }
        }
      }
    }

    // acc[.][f][i][2 rr + cc]: feature n0 + 16 f + g + 8 rr, token c0 + 8 i + 2 t + cc.
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
      if (i < tiles) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int j = c0 + 8 * i + 2 * t + cc;
          if (j < count) {
            const int s = start + j;
#pragma unroll
            for (int f = 0; f < FR; ++f)
#pragma unroll
              for (int rr = 0; rr < 2; ++rr) {
                const int n = n0 + 16 * f + g + 8 * rr;
                const float a0 = acc[0][f][i][2 * rr + cc];
                if (GLU) {
                  // mlx-lm's swiglu as MLX's ops round it (as moe_products.cu).
                  const float gate = static_cast<float>(static_cast<InT>(a0));
                  const float up = static_cast<float>(static_cast<InT>(acc[MATS - 1][f][i][2 * rr + cc]));
                  const float sig = static_cast<float>(static_cast<InT>(1.0f / (1.0f + expf(-gate))));
                  const float act = static_cast<float>(static_cast<InT>(gate * sig));
                  y[(size_t)s * N + n] = static_cast<InT>(act * up);
                } else {
                  y[(size_t)perm[s] * N + n] = static_cast<InT>(a0);
                }
              }
          }
        }
      }
    }
  }
