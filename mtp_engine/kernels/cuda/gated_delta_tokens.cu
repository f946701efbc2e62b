// The gated-delta recurrence over T tokens in one launch (mtp_engine/kernels/cuda_recurrence.py).
// The body of an mx.fast.cuda_kernel: MLX wraps it in a kernel whose arguments are
// the inputs (q, k, v, g, beta, state_in, n_tokens) and outputs (y, states), with the
// template constants InT, Dk, Dv, Hk, Hv and KEEP.
// grid (32, Dv, B*Hv), blocks of (32, 4, 1): each warp owns one row (b, hv, dv) of
// the state, each lane Dk/32 of its columns.
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
