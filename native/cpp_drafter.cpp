// The MTP head's draft steps on the CPU, in plain C++ (module `_mtp_cpp_drafter`, `mtp_engine.drafters.cpp_head`).
//
// A draft step runs one full-attention decoder layer, an fc, three norms and
// the LM head for a single token. As an MLX graph that is about two hundred
// primitives, and on MLX's CPU backend each primitive costs a fixed dispatch
// far above its arithmetic: a draft step cost a fifth of a trunk forward,
// and a chain of K drafts most of what speculation saves. Here a step is a
// few dozen small loops over the same float32 weights (shared with the MLX
// model, not copied).
//
// Drafts only propose tokens: the trunk's verify forward decides what is
// emitted, so this arithmetic needs to match mlx-lm's closely (for the
// acceptance rate), not bit for bit. The tests compare its logits with the
// MLX head's and check that decoding stays identical to plain decoding.
//
// What it computes, for rows r at positions p (the head's KV cache offset):
//   x = fc([rms(embed(t_r)) * w_e, rms(h_r) * w_h])
//   per layer: x += o_proj(attn(rms(x) * w_in) * sigmoid(gate))
//              x += moe(rms(x) * w_post)
//   m = rms(x) * w_norm;  logits = lm_head(m)
// with Qwen3-Next's gated attention (q_proj gives query and gate per head,
// RMS-normed queries and keys, partial non-traditional RoPE, grouped KV
// heads, causal over the cache) and MoE (softmax router, top-k, optional
// renormalization, SwiGLU experts, sigmoid-gated shared expert).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

extern "C" {
#include "few_rows.h"
}

namespace nb = nanobind;
using namespace nb::literals;

namespace mtp {

namespace mx = mlx::core;

struct HeadConfig {
  int dim, layers, heads, kv_heads, head_dim, rope_dims, vocab;
  int experts, top_k, expert_dim, shared_dim;
  float rope_base, rope_scale, eps;
  bool norm_topk;
};

// y[rows][out] = x[rows][in] W^T, W row-major [out][in] (a Linear weight).
static void linear(const float* w, int out, int in, const float* x, int rows, float* y) {
  mtp_few_rows_sgemm(111, 112, rows, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
}

static void rms_norm(const float* x, const float* w, float eps, int n, float* out) {
  float ss = 0.0f;
  for (int i = 0; i < n; i++) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
static inline float silu(float x) { return x * sigmoid(x); }

static std::string shape_text(const mx::array& a) {
  std::string out = "(";
  for (int i = 0; i < static_cast<int>(a.ndim()); i++) out += (i ? ", " : "") + std::to_string(a.shape(i));
  return out + (a.ndim() == 1 ? ",)" : ")");
}

class DraftHead;

// One decoder layer's weights (pointers into the MLX model's buffers).
struct HeadLayer {
  const float *in_norm, *post_norm, *q, *k, *v, *o, *q_norm, *k_norm;
  const float *router, *e_gate, *e_up, *e_down;  // MoE: router and experts
  const float *s_gate, *s_up, *s_down, *s_weight;  // shared expert and its gate
};

// One generation's KV caches (layout [position][kv head][head dim]). Shared
// ownership: a lazy draft holds its session (and so the head) until MLX has
// evaluated or dropped it, whatever Python releases meanwhile.
class DraftSession : public std::enable_shared_from_this<DraftSession> {
 public:
  explicit DraftSession(std::shared_ptr<const DraftHead> head);

  // Drop entries from position `offset` on.
  void rewind(int offset) {
    if (offset < 0 || offset > offset_) {
      throw std::invalid_argument("rewind to " + std::to_string(offset) + " of " + std::to_string(offset_) +
                                  " cache entries");
    }
    offset_ = offset;
  }

  int offset() const { return offset_; }

  // A new session holding this one's entries (a shared prefix's head state,
  // copied for each row that starts from it).
  std::shared_ptr<DraftSession> copy() const { return std::make_shared<DraftSession>(*this); }

  // Bytes its entries take.
  size_t nbytes() const {
    size_t n = 0;
    for (size_t l = 0; l < keys_.size(); l++) n += keys_[l].size() + values_[l].size();
    return n * sizeof(float);
  }

  // Run rows (hidden[r], token[r]) at the next positions; write the head's
  // normed hidden of the last row to `m` and its logits to `logits`.
  void forward(const float* hidden, const std::vector<int>& tokens, float* m, float* logits);

  // One forward for several sessions of one head: session s runs the next
  // counts[s] rows of (hidden, tokens) at its next positions. Every product
  // takes all rows at once (each weight is streamed once per tile of rows,
  // not once per session); each row's arithmetic is the one forward() gives
  // it alone. Writes session s's last-row normed hidden to m[s * dim] and its
  // logits to logits[s * vocab].
  static void forward_many(const std::vector<DraftSession*>& sessions, const std::vector<int>& counts,
                           const float* hidden, const std::vector<int>& tokens, float* m, float* logits);

  // Greedy chains of k drafts for several sessions at once: each consumes its
  // pending pairs (as forward_many), then drafts k tokens, one forward_many
  // per draft position; session s's drafts go to out[s * k ..].
  static void greedy_many(const std::vector<DraftSession*>& sessions, const std::vector<int>& counts,
                          const float* hidden, const std::vector<int>& tokens, int k, int32_t* out);

  // Sessions per half from which greedy_many drafts the two halves on two
  // threads (8 sessions and more).
  static constexpr size_t kSplitSessions = 4;

  // Consume the pending pairs, then draft greedily: up to `k` tokens, stopping
  // early once the running product of top-1 probabilities is below `tau`
  // (tau 0: always k). Returns the drafts and each one's probability.
  // The pairs are (hidden[row, j], tokens[j]) for hidden [rows, >= n, dim]
  // (or [>= n, dim] with row 0), float32, bfloat16 or float16, any strides.
  std::tuple<std::vector<int>, std::vector<float>> draft(const mx::array& hidden, const std::vector<int>& tokens,
                                                         int k, float tau, int row);

  // The same greedy chain of k drafts (no early stop) as a lazy [1, k] int32
  // MLX array: it runs on MLX's CPU stream when evaluated, so the host can
  // build the verify forward on top of it meanwhile. The array keeps the
  // session alive; leave the session alone until the array is evaluated.
  mx::array draft_lazy(const mx::array& hidden, const std::vector<int>& tokens, int k, int row);

  // Lazy greedy chains of k drafts for several sessions of one head, drafted
  // together (`forward_many`): session s consumes the pairs
  // (hiddens[sources[s]][rows[s], j], tokens[s][j]). A [sessions, k] int32
  // array; the sessions are left alone until it is evaluated.
  static mx::array draft_batch(const std::vector<std::shared_ptr<DraftSession>>& sessions,
                               const std::vector<mx::array>& hiddens, const std::vector<int>& sources,
                               const std::vector<int>& rows, const std::vector<std::vector<int>>& tokens, int k);

  // The work of draft() (a lazy chain goes through greedy_many), without its checks: consume
  // the pairs, then draft greedily, up to k tokens, stopping early once the
  // running product of top-1 probabilities is below tau (tau 0: always k,
  // and no probability is computed unless `probs` asks for them).
  std::vector<int> greedy(const float* hidden, const std::vector<int>& tokens, int k, float tau,
                          std::vector<float>* probs);

  // One forward over pairs (hidden[r], tokens[r]): the last row's normed
  // hidden and logits (for tests and diagnostics).
  std::tuple<std::vector<float>, std::vector<float>> logits(const mx::array& hidden, const std::vector<int>& tokens,
                                                            int row);

 private:
  // Raise std::invalid_argument (Python's ValueError) unless `hidden` has a
  // row `row` with a position for every token, and every token is in the
  // vocabulary.
  void check_pairs(const mx::array& hidden, const std::vector<int>& tokens, int row) const;
  // The pairs' hiddens, checked, read into float32 on the host (`hidden` is
  // evaluated first if it is not yet).
  std::vector<float> rows_of(const mx::array& hidden, const std::vector<int>& tokens, int row) const;
  void reserve(int positions);
  // greedy_many's work on one thread.
  static void greedy_group(const std::vector<DraftSession*>& sessions, const std::vector<int>& counts,
                           const float* hidden, const std::vector<int>& tokens, int k, int32_t* out);

  std::shared_ptr<const DraftHead> owner_;
  const DraftHead& head_;
  int offset_ = 0;
  int capacity_ = 0;
  std::vector<std::vector<float>> keys_, values_;
};

class DraftHead : public std::enable_shared_from_this<DraftHead> {
 public:
  DraftHead(std::unordered_map<std::string, mx::array> weights, const HeadConfig& config)
      : config_(config), weights_(std::move(weights)) {
    const HeadConfig& c = config_;
    if (c.heads % c.kv_heads != 0 || c.rope_dims % 2 != 0 || c.rope_dims > c.head_dim || c.head_dim > 512) {
      throw std::invalid_argument("bad attention shape");
    }
    if (c.experts < 1 || c.top_k < 1 || c.top_k > c.experts) throw std::invalid_argument("bad expert counts");
    embed = take("embed", {c.vocab, c.dim});
    lm_head = take("lm_head", {c.vocab, c.dim});
    norm_e = take("pre_fc_norm_embedding", {c.dim});
    norm_h = take("pre_fc_norm_hidden", {c.dim});
    fc = take("fc", {c.dim, 2 * c.dim});
    norm = take("norm", {c.dim});
    const int q_out = c.heads * c.head_dim, kv_out = c.kv_heads * c.head_dim;
    for (int i = 0; i < c.layers; i++) {
      const std::string p = "layers." + std::to_string(i) + ".";
      HeadLayer l;
      l.in_norm = take(p + "input_layernorm", {c.dim});
      l.post_norm = take(p + "post_attention_layernorm", {c.dim});
      l.q = take(p + "q_proj", {2 * q_out, c.dim});
      l.k = take(p + "k_proj", {kv_out, c.dim});
      l.v = take(p + "v_proj", {kv_out, c.dim});
      l.o = take(p + "o_proj", {c.dim, q_out});
      l.q_norm = take(p + "q_norm", {c.head_dim});
      l.k_norm = take(p + "k_norm", {c.head_dim});
      l.router = take(p + "router", {c.experts, c.dim});
      l.e_gate = take(p + "experts.gate_proj", {c.experts, c.expert_dim, c.dim});
      l.e_up = take(p + "experts.up_proj", {c.experts, c.expert_dim, c.dim});
      l.e_down = take(p + "experts.down_proj", {c.experts, c.dim, c.expert_dim});
      l.s_gate = take(p + "shared.gate_proj", {c.shared_dim, c.dim});
      l.s_up = take(p + "shared.up_proj", {c.shared_dim, c.dim});
      l.s_down = take(p + "shared.down_proj", {c.dim, c.shared_dim});
      l.s_weight = take(p + "shared_gate", {1, c.dim});
      layers.push_back(l);
    }
    inv_freq.resize(c.rope_dims / 2);
    for (int i = 0; i < c.rope_dims / 2; i++) {
      inv_freq[i] = static_cast<float>(std::pow(static_cast<double>(c.rope_base), -2.0 * i / c.rope_dims));
    }
  }

  std::shared_ptr<DraftSession> session() const { return std::make_shared<DraftSession>(shared_from_this()); }
  const HeadConfig& config() const { return config_; }

  const float *embed, *lm_head, *norm_e, *norm_h, *fc, *norm;
  std::vector<HeadLayer> layers;
  std::vector<float> inv_freq;

 private:
  const float* take(const std::string& name, std::vector<int> shape) {
    auto it = weights_.find(name);
    if (it == weights_.end()) throw std::invalid_argument("missing weight " + name);
    const mx::array& a = it->second;
    if (a.dtype() != mx::float32) throw std::invalid_argument(name + " is not float32");
    if (!a.flags().row_contiguous) throw std::invalid_argument(name + " is not row-contiguous");
    if (std::vector<int>(a.shape().begin(), a.shape().end()) != shape) {
      throw std::invalid_argument(name + " has an unexpected shape");
    }
    if (!a.is_available() || a.data<float>() == nullptr) {
      throw std::invalid_argument(name + " is not evaluated");
    }
    return a.data<float>();
  }

  HeadConfig config_;
  std::unordered_map<std::string, mx::array> weights_;  // keeps the buffers alive
};

DraftSession::DraftSession(std::shared_ptr<const DraftHead> head)
    : owner_(std::move(head)), head_(*owner_), keys_(head_.config().layers), values_(head_.config().layers) {}

void DraftSession::reserve(int positions) {
  if (positions <= capacity_) return;
  capacity_ = std::max(positions, std::max(256, 2 * capacity_));
  const HeadConfig& c = head_.config();
  for (int l = 0; l < c.layers; l++) {
    keys_[l].resize(static_cast<size_t>(capacity_) * c.kv_heads * c.head_dim);
    values_[l].resize(static_cast<size_t>(capacity_) * c.kv_heads * c.head_dim);
  }
}

static void rope(float* x, int dims, const std::vector<float>& inv_freq, float position) {
  const int half = dims / 2;
  for (int i = 0; i < half; i++) {
    const float angle = position * inv_freq[i];
    const float cos_a = std::cos(angle), sin_a = std::sin(angle);
    const float a = x[i], b = x[i + half];
    x[i] = a * cos_a - b * sin_a;
    x[i + half] = a * sin_a + b * cos_a;
  }
}

// x[rows] += the MoE block of a[rows] (normed inputs).
static void moe(const DraftHead& head, const HeadLayer& L, const float* a, int rows, float* x) {
  const HeadConfig& c = head.config();
  const int dim = c.dim, sd = c.shared_dim, ed = c.expert_dim;
  // The shared expert and its sigmoid gate, all rows at once.
  std::vector<float> g(static_cast<size_t>(rows) * std::max(sd, ed)), u(g.size()), y(static_cast<size_t>(rows) * dim),
      gate(rows), probs(static_cast<size_t>(rows) * c.experts);
  linear(L.s_gate, sd, dim, a, rows, g.data());
  linear(L.s_up, sd, dim, a, rows, u.data());
  for (size_t i = 0; i < static_cast<size_t>(rows) * sd; i++) g[i] = silu(g[i]) * u[i];
  linear(L.s_down, dim, sd, g.data(), rows, y.data());
  linear(L.s_weight, 1, dim, a, rows, gate.data());
  for (int r = 0; r < rows; r++) {
    const float shared = sigmoid(gate[r]);
    for (int i = 0; i < dim; i++) x[(size_t)r * dim + i] += shared * y[(size_t)r * dim + i];
  }
  // Router: softmax over experts, each row's top_k, optionally renormalized;
  // then every expert once over the rows routed to it.
  linear(L.router, c.experts, dim, a, rows, probs.data());
  std::vector<std::vector<std::pair<int, float>>> routed(c.experts);
  std::vector<int> order(c.experts);
  for (int r = 0; r < rows; r++) {
    float* p = &probs[(size_t)r * c.experts];
    const float top = *std::max_element(p, p + c.experts);
    float total = 0.0f;
    for (int e = 0; e < c.experts; e++) total += (p[e] = std::exp(p[e] - top));
    for (int e = 0; e < c.experts; e++) p[e] /= total;
    for (int e = 0; e < c.experts; e++) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + c.top_k, order.end(),
                      [&](int i, int j) { return p[i] > p[j]; });
    float chosen = 0.0f;
    for (int i = 0; i < c.top_k; i++) chosen += p[order[i]];
    for (int i = 0; i < c.top_k; i++) {
      const int e = order[i];
      routed[e].emplace_back(r, c.norm_topk ? p[e] / chosen : p[e]);
    }
  }
  std::vector<float> in;
  for (int e = 0; e < c.experts; e++) {
    const int n = static_cast<int>(routed[e].size());
    if (n == 0) continue;
    in.resize(static_cast<size_t>(n) * dim);
    for (int i = 0; i < n; i++) std::memcpy(&in[(size_t)i * dim], &a[(size_t)routed[e][i].first * dim], sizeof(float) * dim);
    const size_t up = static_cast<size_t>(e) * ed * dim;
    linear(L.e_gate + up, ed, dim, in.data(), n, g.data());
    linear(L.e_up + up, ed, dim, in.data(), n, u.data());
    for (size_t i = 0; i < static_cast<size_t>(n) * ed; i++) g[i] = silu(g[i]) * u[i];
    linear(L.e_down + static_cast<size_t>(e) * dim * ed, dim, ed, g.data(), n, y.data());
    for (int i = 0; i < n; i++) {
      const auto [r, weight] = routed[e][i];
      for (int j = 0; j < dim; j++) x[(size_t)r * dim + j] += weight * y[(size_t)i * dim + j];
    }
  }
}

void DraftSession::forward(const float* hidden, const std::vector<int>& tokens, float* m, float* logits) {
  forward_many({this}, {static_cast<int>(tokens.size())}, hidden, tokens, m, logits);
}

void DraftSession::forward_many(const std::vector<DraftSession*>& sessions, const std::vector<int>& counts,
                                const float* hidden, const std::vector<int>& tokens, float* m, float* logits) {
  const DraftHead& head = sessions.at(0)->head_;
  const HeadConfig& c = head.config();
  int rows = static_cast<int>(tokens.size());
  const int dim = c.dim, hd = c.head_dim, q_out = c.heads * hd, kv_out = c.kv_heads * hd;
  // Row r belongs to session owner[r], at that session's position pos[r].
  std::vector<int> owner(rows), pos(rows), last(sessions.size());
  int r0 = 0, visible_max = 0;
  for (size_t s = 0; s < sessions.size(); s++) {
    DraftSession& S = *sessions[s];
    S.reserve(S.offset_ + counts[s]);
    for (int j = 0; j < counts[s]; j++, r0++) {
      owner[r0] = static_cast<int>(s);
      pos[r0] = S.offset_ + j;
    }
    last[s] = r0 - 1;
    visible_max = std::max(visible_max, S.offset_ + counts[s]);
  }

  std::vector<float> both(static_cast<size_t>(rows) * 2 * dim), x(static_cast<size_t>(rows) * dim);
  for (int r = 0; r < rows; r++) {
    const int t = tokens[r];  // in the vocabulary: checked by every entry point (check_pairs)
    rms_norm(head.embed + static_cast<size_t>(t) * dim, head.norm_e, c.eps, dim, &both[(size_t)r * 2 * dim]);
    rms_norm(hidden + static_cast<size_t>(r) * dim, head.norm_h, c.eps, dim, &both[(size_t)r * 2 * dim + dim]);
  }
  linear(head.fc, dim, 2 * dim, both.data(), rows, x.data());

  std::vector<float> a(static_cast<size_t>(rows) * dim), qg(static_cast<size_t>(rows) * 2 * q_out),
      k(static_cast<size_t>(rows) * kv_out), v(static_cast<size_t>(rows) * kv_out),
      attn(static_cast<size_t>(rows) * q_out), o(static_cast<size_t>(rows) * dim), scores(visible_max);
  const int group = c.heads / c.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  for (int li = 0; li < c.layers; li++) {
    const HeadLayer& L = head.layers[li];
    for (int r = 0; r < rows; r++) rms_norm(&x[(size_t)r * dim], L.in_norm, c.eps, dim, &a[(size_t)r * dim]);
    linear(L.k, kv_out, dim, a.data(), rows, k.data());
    linear(L.v, kv_out, dim, a.data(), rows, v.data());
    for (int r = 0; r < rows; r++) {
      DraftSession& S = *sessions[owner[r]];
      float* K = S.keys_[li].data();
      float* V = S.values_[li].data();
      const float position = static_cast<float>(pos[r]) * c.rope_scale;
      for (int h = 0; h < c.kv_heads; h++) {
        float* kh = &K[((size_t)pos[r] * c.kv_heads + h) * hd];
        rms_norm(&k[(size_t)r * kv_out + h * hd], L.k_norm, c.eps, hd, kh);
        rope(kh, c.rope_dims, head.inv_freq, position);
        std::memcpy(&V[((size_t)pos[r] * c.kv_heads + h) * hd], &v[(size_t)r * kv_out + h * hd], sizeof(float) * hd);
      }
    }
    if (li == c.layers - 1 && rows > static_cast<int>(sessions.size())) {
      // Past the last layer's cache writes only each session's last row is
      // read (its hidden and logits): the rest of the layer runs on those.
      for (size_t s = 0; s < sessions.size(); s++) {
        const int r = last[s];
        std::memmove(&x[s * dim], &x[(size_t)r * dim], sizeof(float) * dim);
        std::memmove(&a[s * dim], &a[(size_t)r * dim], sizeof(float) * dim);
        owner[s] = owner[r];
        pos[s] = pos[r];
        last[s] = static_cast<int>(s);
      }
      rows = static_cast<int>(sessions.size());
      x.resize(static_cast<size_t>(rows) * dim);
    }
    linear(L.q, 2 * q_out, dim, a.data(), rows, qg.data());
    for (int r = 0; r < rows; r++) {
      DraftSession& S = *sessions[owner[r]];
      const float* K = S.keys_[li].data();
      const float* V = S.values_[li].data();
      const int visible = pos[r] + 1;  // causal: the session's positions 0..pos[r]
      const float position = static_cast<float>(pos[r]) * c.rope_scale;
      for (int h = 0; h < c.heads; h++) {
        float q[512];  // head_dim <= 512 (checked at construction)
        // q_proj's output per head is [query (hd), gate (hd)].
        rms_norm(&qg[(size_t)r * 2 * q_out + (size_t)h * 2 * hd], L.q_norm, c.eps, hd, q);
        rope(q, c.rope_dims, head.inv_freq, position);
        // scores = scale * q K^T over the visible positions; out = softmax(scores) V.
        const int kvh = h / group, stride = c.kv_heads * hd;
        mtp_few_rows_sgemm(111, 112, 1, visible, hd, scale, q, hd, &K[(size_t)kvh * hd], stride, 0.0f,
                           scores.data(), visible);
        const float top = *std::max_element(scores.begin(), scores.begin() + visible);
        float total = 0.0f;
        for (int j = 0; j < visible; j++) total += (scores[j] = std::exp(scores[j] - top));
        for (int j = 0; j < visible; j++) scores[j] /= total;
        float* out = &attn[(size_t)r * q_out + (size_t)h * hd];
        mtp_few_rows_sgemm(111, 111, 1, hd, visible, 1.0f, scores.data(), visible, &V[(size_t)kvh * hd], stride, 0.0f,
                           out, hd);
        const float* gate = &qg[(size_t)r * 2 * q_out + (size_t)h * 2 * hd + hd];
        for (int d = 0; d < hd; d++) out[d] *= sigmoid(gate[d]);
      }
    }
    linear(L.o, dim, q_out, attn.data(), rows, o.data());
    for (size_t i = 0; i < x.size(); i++) x[i] += o[i];

    for (int r = 0; r < rows; r++) rms_norm(&x[(size_t)r * dim], L.post_norm, c.eps, dim, &a[(size_t)r * dim]);
    moe(head, L, a.data(), rows, x.data());
  }
  for (size_t s = 0; s < sessions.size(); s++) {
    sessions[s]->offset_ += counts[s];
    rms_norm(&x[(size_t)last[s] * dim], head.norm, c.eps, dim, m + s * dim);
  }
  linear(head.lm_head, c.vocab, dim, m, static_cast<int>(sessions.size()), logits);
}

void DraftSession::greedy_many(const std::vector<DraftSession*>& sessions, const std::vector<int>& counts,
                               const float* hidden, const std::vector<int>& tokens, int k, int32_t* out) {
  const size_t half = sessions.size() / 2;
  if (half < kSplitSessions) {
    greedy_group(sessions, counts, hidden, tokens, k, out);
    return;
  }
  // MLX's CPU stream runs on one thread: the second half of the sessions
  // drafts on another, meanwhile. The halves share no state.
  size_t pairs = 0;
  for (size_t s = 0; s < half; s++) pairs += counts[s];
  const int dim = sessions[0]->head_.config().dim;
  const std::vector<DraftSession*> first(sessions.begin(), sessions.begin() + half),
      second(sessions.begin() + half, sessions.end());
  const std::vector<int> first_counts(counts.begin(), counts.begin() + half),
      second_counts(counts.begin() + half, counts.end()), first_tokens(tokens.begin(), tokens.begin() + pairs),
      second_tokens(tokens.begin() + pairs, tokens.end());
  std::exception_ptr failed;
  std::thread other([&]() {
    try {
      greedy_group(second, second_counts, hidden + pairs * dim, second_tokens, k, out + half * k);
    } catch (...) {
      failed = std::current_exception();
    }
  });
  try {
    greedy_group(first, first_counts, hidden, first_tokens, k, out);
  } catch (...) {
    other.join();
    throw;
  }
  other.join();
  if (failed) std::rethrow_exception(failed);
}

void DraftSession::greedy_group(const std::vector<DraftSession*>& sessions, const std::vector<int>& counts,
                                const float* hidden, const std::vector<int>& tokens, int k, int32_t* out) {
  const HeadConfig& c = sessions.at(0)->head_.config();
  const size_t n = sessions.size();
  std::vector<float> m(n * c.dim), next(n * c.dim), logits(n * c.vocab);
  std::vector<int> chosen(n);
  const std::vector<int> ones(n, 1);
  forward_many(sessions, counts, hidden, tokens, m.data(), logits.data());
  for (int j = 0; j < k; j++) {
    if (j > 0) {
      forward_many(sessions, ones, m.data(), chosen, next.data(), logits.data());
      std::swap(m, next);
    }
    for (size_t s = 0; s < n; s++) {
      const float* l = &logits[s * c.vocab];
      chosen[s] = static_cast<int>(std::max_element(l, l + c.vocab) - l);
      out[s * k + j] = chosen[s];
    }
  }
}

// The softmax probability of logits[best], the largest logit.
static float top_probability(const std::vector<float>& logits, int best) {
  float total = 0.0f;
  for (float l : logits) total += std::exp(l - logits[best]);
  return 1.0f / total;
}

std::vector<int> DraftSession::greedy(const float* hidden, const std::vector<int>& tokens, int k, float tau,
                                      std::vector<float>* probs) {
  const HeadConfig& c = head_.config();
  std::vector<float> m(c.dim), next(c.dim), logits(c.vocab);
  std::vector<int> drafts;
  forward(hidden, tokens, m.data(), logits.data());
  float confidence = 1.0f;
  while (true) {
    const int token = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    drafts.push_back(token);
    if (probs != nullptr || tau > 0.0f) {
      const float p = top_probability(logits, token);
      if (probs != nullptr) probs->push_back(p);
      confidence *= p;
    }
    if (static_cast<int>(drafts.size()) >= k || confidence < tau) break;
    forward(m.data(), {token}, next.data(), logits.data());
    std::swap(m, next);
  }
  return drafts;
}

std::tuple<std::vector<int>, std::vector<float>> DraftSession::draft(const mx::array& hidden,
                                                                     const std::vector<int>& tokens, int k,
                                                                     float tau, int row) {
  if (k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(k));
  const std::vector<float> rows = rows_of(hidden, tokens, row);
  std::vector<float> probs;
  nb::gil_scoped_release release;
  std::vector<int> drafts = greedy(rows.data(), tokens, k, tau, &probs);
  return {drafts, probs};
}

void DraftSession::check_pairs(const mx::array& hidden, const std::vector<int>& tokens, int row) const {
  const HeadConfig& c = head_.config();
  const int n = static_cast<int>(tokens.size());
  if (n < 1) throw std::invalid_argument("no pairs to consume");
  const int nd = hidden.ndim();
  if ((nd != 2 && nd != 3) || hidden.shape(-1) != c.dim || hidden.shape(-2) < n) {
    throw std::invalid_argument("hidden must be [rows, positions, " + std::to_string(c.dim) + "] or [positions, " +
                                std::to_string(c.dim) + "] with a position for each of the " + std::to_string(n) +
                                " pairs, got shape " + shape_text(hidden));
  }
  const int rows = nd == 3 ? hidden.shape(0) : 1;
  if (row < 0 || row >= rows) {
    throw std::invalid_argument("row " + std::to_string(row) + " of hidden with " + std::to_string(rows) + " rows");
  }
  if (hidden.dtype() != mx::float32 && hidden.dtype() != mx::bfloat16 && hidden.dtype() != mx::float16) {
    throw std::invalid_argument("hidden must be float32, bfloat16 or float16");
  }
  for (int t : tokens) {
    if (t < 0 || t >= c.vocab) throw std::invalid_argument("token " + std::to_string(t) + " outside the vocabulary");
  }
}

// Positions 0..n of row `row` of an evaluated [rows, T, dim] (or [T, dim])
// array, any strides, into out[n * dim] as float32.
template <typename T>
static void read_rows_as(const mx::array& a, int row, int n, int dim, float* out) {
  const T* base = a.data<T>();
  const bool three = a.ndim() == 3;
  const int64_t s_row = three ? a.strides()[0] : 0, s_pos = a.strides()[three ? 1 : 0],
                s_dim = a.strides()[three ? 2 : 1];
  for (int t = 0; t < n; t++) {
    const T* p = base + row * s_row + t * s_pos;
    for (int d = 0; d < dim; d++) out[(size_t)t * dim + d] = static_cast<float>(p[d * s_dim]);
  }
}

static void read_rows(const mx::array& a, int row, int n, int dim, float* out) {
  switch (a.dtype()) {
    case mx::float32: return read_rows_as<float>(a, row, n, dim, out);
    case mx::bfloat16: return read_rows_as<mx::bfloat16_t>(a, row, n, dim, out);
    default: return read_rows_as<mx::float16_t>(a, row, n, dim, out);
  }
}

std::vector<float> DraftSession::rows_of(const mx::array& hidden, const std::vector<int>& tokens, int row) const {
  check_pairs(hidden, tokens, row);
  if (!hidden.is_available()) mx::eval({hidden});
  const int n = static_cast<int>(tokens.size()), dim = head_.config().dim;
  std::vector<float> rows(static_cast<size_t>(n) * dim);
  read_rows(hidden, row, n, dim, rows.data());
  return rows;
}

std::tuple<std::vector<float>, std::vector<float>> DraftSession::logits(const mx::array& hidden,
                                                                        const std::vector<int>& tokens, int row) {
  const HeadConfig& c = head_.config();
  const std::vector<float> rows = rows_of(hidden, tokens, row);
  std::vector<float> m(c.dim), logits(c.vocab);
  forward(rows.data(), tokens, m.data(), logits.data());
  return {m, logits};
}

// Greedy chains of k drafts for one or more sessions, run on MLX's CPU
// stream when evaluated: session s reads its pending pairs from row rows[s]
// of input sources[s]. Output [sessions, k] int32.
class DraftChains : public mx::Primitive {
 public:
  DraftChains(mx::Stream stream, std::vector<std::shared_ptr<DraftSession>> sessions, std::vector<int> sources,
              std::vector<int> rows, std::vector<std::vector<int>> tokens, int k, int dim)
      : mx::Primitive(stream), sessions_(std::move(sessions)), sources_(std::move(sources)), rows_(std::move(rows)),
        tokens_(std::move(tokens)), k_(k), dim_(dim) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([sessions = sessions_, sources = sources_, rows = rows_, tokens = tokens_, k = k_, dim = dim_,
                      inputs, o = out.data<int32_t>()]() {
      std::vector<int> counts, flat;
      for (const auto& t : tokens) {
        counts.push_back(static_cast<int>(t.size()));
        flat.insert(flat.end(), t.begin(), t.end());
      }
      std::vector<float> pairs(flat.size() * dim);
      size_t at = 0;
      std::vector<DraftSession*> raw;
      for (size_t s = 0; s < sessions.size(); s++) {
        read_rows(inputs[sources[s]], rows[s], counts[s], dim, &pairs[at * dim]);
        at += counts[s];
        raw.push_back(sessions[s].get());
      }
      DraftSession::greedy_many(raw, counts, pairs.data(), flat, k, o);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("draft chains run on the CPU only");
  }
  const char* name() const override { return "DraftChains"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }  // it has side effects

 private:
  std::vector<std::shared_ptr<DraftSession>> sessions_;
  std::vector<int> sources_, rows_;
  std::vector<std::vector<int>> tokens_;
  int k_, dim_;
};

mx::array DraftSession::draft_lazy(const mx::array& hidden, const std::vector<int>& tokens, int k, int row) {
  return draft_batch({shared_from_this()}, {hidden}, {0}, {row}, {tokens}, k);
}

mx::array DraftSession::draft_batch(const std::vector<std::shared_ptr<DraftSession>>& sessions,
                                    const std::vector<mx::array>& hiddens, const std::vector<int>& sources,
                                    const std::vector<int>& rows, const std::vector<std::vector<int>>& tokens, int k) {
  if (k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(k));
  const size_t n = sessions.size();
  if (n == 0) throw std::invalid_argument("no sessions to draft for");
  if (sources.size() != n || rows.size() != n || tokens.size() != n) {
    throw std::invalid_argument("sources, rows and tokens need one entry per session (" + std::to_string(n) + ")");
  }
  for (size_t s = 0; s < n; s++) {
    const DraftSession& S = *sessions[s];
    if (&S.head_ != &sessions[0]->head_) throw std::invalid_argument("sessions of different heads");
    for (size_t t = 0; t < s; t++) {
      if (sessions[t] == sessions[s]) throw std::invalid_argument("session " + std::to_string(s) + " repeats");
    }
    if (sources[s] < 0 || sources[s] >= static_cast<int>(hiddens.size())) {
      throw std::invalid_argument("source " + std::to_string(sources[s]) + " of " + std::to_string(hiddens.size()) +
                                  " hiddens");
    }
    S.check_pairs(hiddens[sources[s]], tokens[s], rows[s]);
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  const int dim = sessions[0]->head_.config().dim;
  return mx::array({static_cast<int>(n), k}, mx::int32,
                   std::make_shared<DraftChains>(stream, sessions, sources, rows, tokens, k, dim), hiddens);
}

}  // namespace mtp

NB_MODULE(_mtp_cpp_drafter, m) {
  m.doc() = "The MTP head's draft steps on the CPU in plain C++";
  nb::class_<mtp::HeadConfig>(m, "HeadConfig")
      .def(nb::init<>())
      .def_rw("dim", &mtp::HeadConfig::dim)
      .def_rw("layers", &mtp::HeadConfig::layers)
      .def_rw("heads", &mtp::HeadConfig::heads)
      .def_rw("kv_heads", &mtp::HeadConfig::kv_heads)
      .def_rw("head_dim", &mtp::HeadConfig::head_dim)
      .def_rw("rope_dims", &mtp::HeadConfig::rope_dims)
      .def_rw("vocab", &mtp::HeadConfig::vocab)
      .def_rw("experts", &mtp::HeadConfig::experts)
      .def_rw("top_k", &mtp::HeadConfig::top_k)
      .def_rw("expert_dim", &mtp::HeadConfig::expert_dim)
      .def_rw("shared_dim", &mtp::HeadConfig::shared_dim)
      .def_rw("rope_base", &mtp::HeadConfig::rope_base)
      .def_rw("rope_scale", &mtp::HeadConfig::rope_scale)
      .def_rw("eps", &mtp::HeadConfig::eps)
      .def_rw("norm_topk", &mtp::HeadConfig::norm_topk);
  nb::class_<mtp::DraftSession>(m, "DraftSession")
      .def_prop_ro("offset", &mtp::DraftSession::offset)
      .def_prop_ro("nbytes", &mtp::DraftSession::nbytes)
      .def("copy", &mtp::DraftSession::copy)
      .def("rewind", &mtp::DraftSession::rewind, "offset"_a)
      .def("draft", &mtp::DraftSession::draft, "hidden"_a, "tokens"_a, "k"_a, "tau"_a = 0.0f, "row"_a = 0)
      .def("logits", &mtp::DraftSession::logits, "hidden"_a, "tokens"_a, "row"_a = 0)
      .def("draft_lazy", &mtp::DraftSession::draft_lazy, "hidden"_a, "tokens"_a, "k"_a, "row"_a = 0);
  m.def("draft_batch", &mtp::DraftSession::draft_batch, "sessions"_a, "hiddens"_a, "sources"_a, "rows"_a, "tokens"_a,
        "k"_a, "Lazy greedy chains of k drafts for several sessions of one head, drafted together: [sessions, k] int32");
  nb::class_<mtp::DraftHead>(m, "DraftHead")
      .def(nb::new_([](std::unordered_map<std::string, mlx::core::array> weights, const mtp::HeadConfig& config) {
             return std::make_shared<mtp::DraftHead>(std::move(weights), config);
           }),
           "weights"_a, "config"_a)
      .def("session", &mtp::DraftHead::session);
}
