// A whole chain of MTP drafts per row of a batch in one launch: one thread
// block a row (mtp_engine/kernels/cuda_chain.py). The body of an mx.fast.cuda_kernel: MLX wraps it
// in a kernel whose arguments are the inputs and outputs named in cuda_chain.py.
  // Template constants: W (weights), HT (hidden), CT (KV cache) dtypes; DIM,
  // H, KVH, HD, RD (rotated dims), V (vocabulary), E, TOPK, ED (expert
  // width), SD (shared expert width), NORM_TOPK, MAXM (pending pairs fed
  // at once), MAXK (drafts at most). The draft count, the rows and their pairs
  // are read at run time, so one compiled kernel serves every chain depth
  // (the last steps of a generation draft fewer than K) and batch.
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int row = blockIdx.y;   // this block's row of the batch
  const int offset = meta[0];   // head cache entries before this call (every row's; some may be holes)
  const int P = meta[1];        // pending pairs a row holds at most: the width of hidden, tokens, new_k, new_v
  const int cap = meta[2];      // positions allocated in k_cache / v_cache
  const int pmax = meta[3];     // positions a score row holds (offset + P + drafts)
  const int K = meta[4];        // drafts, 1..MAXK
  const int vcap = meta[5];     // entries a row of `valid` holds; 0: no cache entry is a hole
  const int wrow = meta[6];     // scratch floats a row
  const bool noisy = meta[7];   // `noise` holds [rows, K, V]: each draft is the argmax of logits + noise
  const int m = rows_meta[2 * row];          // this row's pending pairs, 1..P
  const int rope0 = rows_meta[2 * row + 1];  // RoPE position of its first pending pair
  const float eps = fparams[0], rope_scale = fparams[1], attn_scale = fparams[2];
  constexpr int QO = H * HD;
  constexpr int KVO = KVH * HD;
  constexpr int GROUP = H / KVH;
  constexpr int PARTS = 32;
  // This row's slices of the inputs and outputs.
  const HT* hid = hidden + static_cast<size_t>(row) * P * DIM;
  const int* toks = tokens + row * P;
  const CT* kc = k_cache + static_cast<size_t>(row) * KVH * cap * HD;
  const CT* vc = v_cache + static_cast<size_t>(row) * KVH * cap * HD;
  const bool* ok = valid + static_cast<size_t>(row) * vcap;
  int* out = drafts + row * K;
  CT* nk = new_k + static_cast<size_t>(row) * KVH * P * HD;
  CT* nv = new_v + static_cast<size_t>(row) * KVH * P * HD;
  float* ws = work + static_cast<size_t>(row) * wrow;
  const float* nz = noisy ? noise + static_cast<size_t>(row) * K * V : nullptr;

  // The padding past this row's pairs: zeros (holes the caller's cache keeps; MLX's attention weighs them 0, so
  // they must be finite).
  for (int i = tid; i < KVH * (P - m) * HD; i += blockDim.x) {
    const int h = i / ((P - m) * HD), r = m + i / HD % (P - m), d = i % HD;
    nk[(h * P + r) * HD + d] = static_cast<CT>(0.0f);
    nv[(h * P + r) * HD + d] = static_cast<CT>(0.0f);
  }

  float* both = ws;                        // MAXM x 2 DIM: normed [embedding, hidden]
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
  float* part = logits + V;                // PARTS x QO: partial attention sums
  float* knew = part + PARTS * QO;         // (P + MAXK) x KVO: keys of the new positions
  float* vnew = knew + (P + MAXK) * KVO;   // (P + MAXK) x KVO: their values
  float* scores = vnew + (P + MAXK) * KVO;  // H x pmax

  __shared__ int tok_sh;
  __shared__ int sel_e[TOPK];
  __shared__ float sel_w[TOPK];
  __shared__ float sgw_sh;
  __shared__ float red_v[32];
  __shared__ int red_i[32];

  for (int step = 0; step < K; ++step) {
    // Step 0 feeds the row's pending pairs, MAXM at a time; a later step its last draft.
    int rows = 1, first_new = m + step - 1;  // the chunk's rows and the index in knew of its first
    for (int chunk = 0; chunk < (step == 0 ? (m + MAXM - 1) / MAXM : 1); ++chunk) {
      if (step == 0) {
        first_new = chunk * MAXM;
        rows = min(MAXM, m - first_new);
      }
      const int pos0 = rope0 + first_new;  // RoPE position of the chunk's first row
      const int last = rows - 1;

      // Normed embeddings and hiddens of the rows.
      for (int t = warp; t < 2 * rows; t += warps) {
        const int r = t >> 1;
        float* dst = both + r * 2 * DIM + (t & 1) * DIM;
        if ((t & 1) == 0) {
          const int token = step == 0 ? toks[first_new + r] : tok_sh;
          mtp_rms_row(embed + static_cast<size_t>(token) * DIM, norm_e, DIM, eps, dst, lane);
        } else if (step == 0) {
          mtp_rms_row(hid + static_cast<size_t>(first_new + r) * DIM, norm_h, DIM, eps, dst, lane);
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

      // Keys (normed, rotated) and values of every row; the last row's queries (the last chunk's are kept).
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
              nk[(h * P + ni) * HD + d] = static_cast<CT>(kd[d]);
              nv[(h * P + ni) * HD + d] = static_cast<CT>(vd[d]);
            }
          }
        } else {
          const int h = t - rows * KVH;
          mtp_norm_rope<HD, RD>(qg + h * 2 * HD, q_norm, qs + h * HD, static_cast<float>(pos0 + last) * rope_scale,
                                inv_freq, eps, lane);
        }
      }
      __syncthreads();
    }
    const int last = rows - 1;                  // the last row fed: the one whose next token this step drafts
    const int npos = offset + first_new + rows;  // entries it sees (cache, then new)

    // Attention of the last row over its cache entries (not its holes) and the new ones: scores, softmax, sums.
    for (int it = tid; it < H * npos; it += blockDim.x) {
      const int h = it / npos, p = it % npos, kvh = h / GROUP;
      const float* q = qs + h * HD;
      float s = 0.0f;
      if (p < offset) {
        const CT* kp = kc + (static_cast<size_t>(kvh) * cap + p) * HD;
        for (int d = 0; d < HD; ++d) s += q[d] * static_cast<float>(kp[d]);
      } else {
        const float* kp = knew + ((p - offset) * KVH + kvh) * HD;
        for (int d = 0; d < HD; ++d) s += q[d] * kp[d];
      }
      scores[h * pmax + p] = p < offset && vcap && !ok[p] ? MTP_NEG_MAX : s * attn_scale;
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
        if (p < offset && vcap && !ok[p]) continue;  // a hole: weight 0, and its value is never read
        const float v = p < offset ? static_cast<float>(vc[(static_cast<size_t>(kvh) * cap + p) * HD + d])
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

    // The draft: the largest logit (with the step's noise, the exact sampler's choice: temperature x Gumbel
    // noise; sampling.draft_noise), the lowest index among equals.
    float bv = MTP_NEG_MAX;
    int bi = 0x7fffffff;
    for (int i = tid; i < V; i += blockDim.x) {
      const float score = nz ? logits[i] + nz[step * V + i] : logits[i];
      if (score > bv) {
        bv = score;
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
        bi = bi < V ? bi : 0;  // logits all NaN: token 0 (a draft only proposes), never an index past the vocabulary
        tok_sh = bi;
        out[step] = bi;
      }
    }
    __syncthreads();
  }
