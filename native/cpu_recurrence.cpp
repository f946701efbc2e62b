// One MLX primitive for the gated-delta recurrence over T tokens (CPU).
//
// mlx-lm's ops path runs a step of about twenty primitives per token and
// layer; on MLX's CPU backend each primitive has a fixed dispatch cost that
// dwarfs the arithmetic of this small recurrence, so a verify forward over T
// tokens pays it T times. This primitive runs all T tokens in one dispatch
// and writes the state after every token (the per-token captured states). The
// engine uses it for one-token decoding too, so verify forwards and plain
// decoding share one arithmetic, token for token.
//
// Semantics (per batch row b and value head h, state S of Dv x Dk):
//   S = S * g_t
//   kv_i = sum_j S_ij k_j
//   d_i = (v_i - kv_i) * beta_t
//   S_ij = S_ij + k_j d_i
//   y_i = sum_j S_ij q_j
// as mlx-lm's `_gated_delta_step_ops` with a scalar gate per head.

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>

#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtp {

using mlx::core::array;
namespace mx = mlx::core;

class GatedDeltaTokens : public mx::Primitive {
 public:
  GatedDeltaTokens(mx::Stream stream, bool keep_states)
      : mx::Primitive(stream), keep_states_(keep_states) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("gated_delta_tokens has no GPU implementation");
  }
  const char* name() const override { return "GatedDeltaTokens"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return keep_states_ == static_cast<const GatedDeltaTokens&>(other).keep_states_;
  }

 private:
  bool keep_states_;
};

// One token's inputs and output.
struct Token {
  const float *q, *k, *v;
  float g, beta;
  float* y;
};

// One token on S in its own layout [Dv][Dk], row by row, as
// `_gated_delta_step_ops` sums (decode, verify).
static void step_rows(float* s, const Token& t, int Dk, int Dv) {
  for (int i = 0; i < Dv; ++i) {
    float* row = s + static_cast<size_t>(i) * Dk;
    float kv = 0.0f;
    for (int j = 0; j < Dk; ++j) {
      row[j] *= t.g;
      kv += row[j] * t.k[j];
    }
    const float d = (t.v[i] - kv) * t.beta;
    float out = 0.0f;
    for (int j = 0; j < Dk; ++j) {
      row[j] += t.k[j] * d;
      out += row[j] * t.q[j];
    }
    t.y[i] = out;
  }
}

// One token on S transposed, sT[j][i] = S[i][j] (prefill): the loops over j
// step through every value row i at once, so the compiler vectorizes over i,
// and each S[i][j] and each running sum over j still sees the same
// operations in the same order as in step_rows (built with
// -ffp-contract=off: nothing is fused). `kv` is scratch of Dv values.
static void step_transposed(float* sT, const Token& t, int Dk, int Dv, float* kv) {
  // S = S * g;  kv_i = sum_j S_ij k_j  (j in order)
  std::fill(kv, kv + Dv, 0.0f);
  for (int j = 0; j < Dk; ++j) {
    float* col = sT + static_cast<size_t>(j) * Dv;
    const float kj = t.k[j];
    for (int i = 0; i < Dv; ++i) {
      col[i] *= t.g;
      kv[i] += col[i] * kj;
    }
  }
  float* delta = kv;  // d_i = (v_i - kv_i) * beta, in place
  for (int i = 0; i < Dv; ++i) delta[i] = (t.v[i] - kv[i]) * t.beta;
  // S_ij += k_j d_i;  y_i = sum_j S_ij q_j  (j in order)
  std::fill(t.y, t.y + Dv, 0.0f);
  for (int j = 0; j < Dk; ++j) {
    float* col = sT + static_cast<size_t>(j) * Dv;
    const float kj = t.k[j], qj = t.q[j];
    for (int i = 0; i < Dv; ++i) {
      col[i] += kj * delta[i];
      t.y[i] += col[i] * qj;
    }
  }
}

// Copy a [rows][cols] matrix, transposing it when asked.
static void copy_matrix(const float* src, float* dst, int rows, int cols, bool transpose) {
  if (!transpose) {
    std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(rows) * cols);
    return;
  }
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) dst[static_cast<size_t>(j) * rows + i] = src[static_cast<size_t>(i) * cols + j];
}

// From this many tokens on, the transposed state (same numbers, faster);
// for fewer, transposing it in and out costs more than it saves.
constexpr int TRANSPOSED_FROM = 8;

static void run(const float* q, const float* k, const float* v, const float* g, const float* beta,
                const float* state, float* y, float* states, int B, int T, int H, int Dk, int Dv,
                bool keep_states) {
  const bool transposed = T >= TRANSPOSED_FROM;
  const size_t sz = static_cast<size_t>(Dv) * Dk;
  std::vector<float> s(sz), kv(Dv);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      copy_matrix(state + (static_cast<size_t>(b) * H + h) * sz, s.data(), Dv, Dk, transposed);
      for (int t = 0; t < T; ++t) {
        const size_t bth = (static_cast<size_t>(b) * T + t) * H + h;
        const Token tok{q + bth * Dk, k + bth * Dk, v + bth * Dv, g[bth], beta[bth], y + bth * Dv};
        if (transposed) {
          step_transposed(s.data(), tok, Dk, Dv, kv.data());
        } else {
          step_rows(s.data(), tok, Dk, Dv);
        }
        if (keep_states || t == T - 1) {
          const size_t slot = keep_states ? t : 0;
          copy_matrix(s.data(), states + ((slot * B + b) * H + h) * sz, transposed ? Dk : Dv,
                      transposed ? Dv : Dk, transposed);
        }
      }
    }
  }
}

void GatedDeltaTokens::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  auto& q = inputs[0];
  auto& k = inputs[1];
  auto& v = inputs[2];
  auto& g = inputs[3];
  auto& beta = inputs[4];
  auto& state = inputs[5];
  auto& y = outputs[0];
  auto& states = outputs[1];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  states.set_data(mx::allocator::malloc(states.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(y);
  encoder.set_output_array(states);
  const int B = q.shape(0), T = q.shape(1), H = q.shape(2), Dk = q.shape(3), Dv = v.shape(3);
  encoder.dispatch([qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(),
                    gp = g.data<float>(), bp = beta.data<float>(), sp = state.data<float>(),
                    yp = y.data<float>(), op = states.data<float>(), B, T, H, Dk, Dv,
                    keep = keep_states_]() { run(qp, kp, vp, gp, bp, sp, yp, op, B, T, H, Dk, Dv, keep); });
}

static void check(const array& a, const char* name, int ndim) {
  if (a.dtype() != mx::float32) {
    throw std::invalid_argument(std::string("gated_delta_tokens: ") + name + " must be float32");
  }
  if (a.ndim() != ndim) {
    throw std::invalid_argument(std::string("gated_delta_tokens: ") + name + " must have " +
                                std::to_string(ndim) + " dimensions");
  }
}

// Outputs y [B, T, H, Dv] and the states after every token [T, B, H, Dv, Dk]
// (after the last token only, [1, B, H, Dv, Dk], unless keep_states).
std::tuple<array, array> gated_delta_tokens(const array& q, const array& k, const array& v,
                                            const array& g, const array& beta, const array& state,
                                            bool keep_states) {
  check(q, "q", 4);
  check(k, "k", 4);
  check(v, "v", 4);
  check(g, "g", 3);
  check(beta, "beta", 3);
  check(state, "state", 4);
  const int B = q.shape(0), T = q.shape(1), H = q.shape(2), Dk = q.shape(3), Dv = v.shape(3);
  if (k.shape() != q.shape() || v.shape(0) != B || v.shape(1) != T || v.shape(2) != H ||
      g.shape() != mx::Shape{B, T, H} || beta.shape() != mx::Shape{B, T, H} ||
      state.shape() != mx::Shape{B, H, Dv, Dk}) {
    throw std::invalid_argument("gated_delta_tokens: shapes do not agree");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs = {mx::contiguous(q, false, s), mx::contiguous(k, false, s),
                               mx::contiguous(v, false, s), mx::contiguous(g, false, s),
                               mx::contiguous(beta, false, s), mx::contiguous(state, false, s)};
  auto outs = array::make_arrays(
      {mx::Shape{B, T, H, Dv}, mx::Shape{keep_states ? T : 1, B, H, Dv, Dk}},
      {mx::float32, mx::float32}, std::make_shared<GatedDeltaTokens>(s, keep_states), inputs);
  return {outs[0], outs[1]};
}

}  // namespace mtp

NB_MODULE(_mtp_cpu_recurrence, m) {
  m.doc() = "The gated-delta recurrence over T tokens as one MLX CPU primitive";
  m.def("gated_delta_tokens", &mtp::gated_delta_tokens, "q"_a, "k"_a, "v"_a, "g"_a, "beta"_a,
        "state"_a, "keep_states"_a = true);
}
