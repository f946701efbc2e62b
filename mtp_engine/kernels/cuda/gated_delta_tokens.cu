// The gated-delta recurrence over T tokens in one launch (mtp_engine/kernels/cuda_recurrence.py).
// The body of an mx.fast.cuda_kernel: MLX wraps it in a kernel whose arguments are
// the inputs (q, k, v, g, beta, state_in, n_tokens, mode, last) and outputs (y, states), with
// the template constants InT, Dk, Dv, Hk, Hv. The mode, read at run time (one compiled kernel
// serves them all, so a process compiles it once, not once a mode):
//   0: y for every token and the state after the last ([1, B, Hv, Dv, Dk]);
//   1: y and the state after every token ([T, B, Hv, Dv, Dk]);
//   2: y only (states is not written);
//   3: the state after token last[b] of each row b only ([1, B, Hv, Dv, Dk]; y is not written).
// Every mode runs the same steps, so a state is the same bit for bit in all of them.
// grid (32, Dv, B*Hv), blocks of (32, 4, 1): each warp owns one row (b, hv, dv) of
// the state, each lane Dk/32 of its columns.
  constexpr int n_per_t = Dk / 32;
  const int NT = n_tokens[0];  // read at run time: one compiled kernel serves every T
  const int MODE = mode[0];  // and every mode
  const int lane = threadIdx.x;
  const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
  const int n = blockIdx.z;  // b * Hv + hv
  const int rows = gridDim.z;  // B * Hv
  const int b_idx = n / Hv;
  const int hv_idx = n % Hv;
  const int hk_idx = hv_idx / (Hv / Hk);
  const int stop = MODE == 3 ? last[b_idx] : NT - 1;  // the last token this row runs

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

  for (int t = 0; t <= stop; ++t) {
    const float decay = static_cast<float>(g_[hv_idx]);
    float kv_mem = 0.0f;
    for (int i = 0; i < n_per_t; ++i) {
      const int s_idx = n_per_t * lane + i;
      st[i] = st[i] * decay;
      kv_mem += st[i] * static_cast<float>(k_[s_idx]);
    }
    kv_mem = warp_sum(kv_mem);
    const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);
    for (int i = 0; i < n_per_t; ++i) {
      const int s_idx = n_per_t * lane + i;
      st[i] = st[i] + static_cast<float>(k_[s_idx]) * delta;
    }
    if (MODE != 3) {
      float out = 0.0f;
      for (int i = 0; i < n_per_t; ++i) {
        out += st[i] * static_cast<float>(q_[n_per_t * lane + i]);
      }
      out = warp_sum(out);
      if (lane == 0) {
        y_[dv_idx] = static_cast<InT>(out);
      }
    }
    if (MODE == 1 || (MODE != 2 && t == stop)) {
      auto* s_out = states + ((MODE == 1 ? t : 0) * rows + n) * Dv * Dk + dv_idx * Dk;
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
