// MLX's float32 sigmoid, SiLU and softmax as vectorized MLX CPU primitives.
//
// On Linux x86-64, MLX's CPU backend computes exp (inside sigmoid, SiLU,
// softplus) one element at a time, and its polynomial calls libm's fma for
// each of six steps: about 11 ns an element. A prompt's prefill runs SiLU over
// the conv outputs, the gated norms and the MoE blocks of every layer, and on
// the shipped model that was about a third of the prefill.
//
// This computes the same function, operation for operation, in a loop the
// compiler vectorizes (-O3 -march=native). Every step is an IEEE operation
// with one rounding (multiply, add, divide, fused multiply-add, floor, the
// float-to-int conversion, integer shifts), so the vector lanes give the
// scalar results bit for bit; -ffp-contract=off keeps the compiler from fusing
// the multiply-adds MLX keeps apart. The tests compare it with mx.sigmoid and
// nn.silu bit for bit over every float32 range that matters.
//
// MLX's exp (mlx/backend/cpu/simd/math.h, from Cephes): 2^(x log2 e) split
// into an integer part, made by shifting it into a float's exponent, and a
// fractional part through a degree-6 polynomial; NaN passes through, above 88
// is infinity, below -88 is 0. Sigmoid: y = 1 / (1 + exp(|x|)), then y for
// x < 0 and 1 - y otherwise. SiLU: x * sigmoid(x).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mtp {

using mlx::core::array;
namespace mx = mlx::core;

static inline float mlx_exp(float x_init) {
  float x = x_init * 1.442695f;
  const float ipart = std::floor(x + 0.5f);
  const float fpart = x - ipart;
  x = 1.535336188319500e-4f;
  x = std::fma(x, fpart, 1.339887440266574e-3f);
  x = std::fma(x, fpart, 9.618437357674640e-3f);
  x = std::fma(x, fpart, 5.550332471162809e-2f);
  x = std::fma(x, fpart, 2.402264791363012e-1f);
  x = std::fma(x, fpart, 6.931472028550421e-1f);
  x = std::fma(x, fpart, 1.000000000000000f);
  // 2^ipart through the exponent bits (unsigned: the out-of-range cases are
  // replaced below, as in MLX).
  const uint32_t bits = (static_cast<uint32_t>(static_cast<int32_t>(ipart)) + 127u) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  float result = x_init != x_init ? x_init : scale * x;
  result = x_init > 88.0f ? INFINITY : result;
  result = x_init < -88.0f ? 0.0f : result;
  return result;
}

static inline float mlx_sigmoid(float x) {
  const float y = 1.0f / (1.0f + mlx_exp(std::fabs(x)));
  return x < 0.0f ? y : 1.0f - y;
}

static void sigmoid_loop(const float* __restrict in, float* __restrict out, size_t n, bool silu) {
  if (silu) {
    for (size_t i = 0; i < n; ++i) out[i] = in[i] * mlx_sigmoid(in[i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = mlx_sigmoid(in[i]);
  }
}

// MLX's float32 softmax over the last axis (mlx/backend/cpu/softmax.cpp with
// one lane, as on x86-64): the row's maximum (a NaN wins), exp(x - max) by
// the exp above, their sum in order, then each times 1 / sum. Only the sum
// stays sequential: it is the one step whose order changes a result.
static void softmax_rows(const float* __restrict in, float* __restrict out, size_t rows, size_t m) {
  for (size_t r = 0; r < rows; ++r, in += m, out += m) {
    float top = -INFINITY;
    for (size_t i = 0; i < m; ++i) {
      const float a = in[i];
      top = a != a ? a : (a > top ? a : top);
    }
    for (size_t i = 0; i < m; ++i) out[i] = mlx_exp(in[i] - top);
    float sum = 0.0f;
    for (size_t i = 0; i < m; ++i) sum += out[i];
    const float scale = 1 / sum;
    for (size_t i = 0; i < m; ++i) out[i] *= scale;
  }
}

// One float32 input, one output of its shape, computed on the CPU stream by
// a plain loop over the data (n elements in rows of m, the last axis).
class CpuUnary : public mx::Primitive {
 public:
  using Kernel = void (*)(const float* in, float* out, size_t n, size_t m);

  explicit CpuUnary(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    const array& x = inputs[0];
    array& y = outputs[0];
    y.set_data(mx::allocator::malloc(y.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(y);
    encoder.dispatch([in = x.data<float>(), out = y.data<float>(), n = x.size(),
                      m = static_cast<size_t>(x.ndim() ? x.shape(-1) : 1), run = kernel()]() {
      run(in, out, n, m);
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("the _mtp_cpu_activations primitives have no GPU implementation");
  }

 protected:
  virtual Kernel kernel() const = 0;
};

// The primitive's output for x (made row-contiguous first), on the CPU stream.
static array unary(const array& x, std::shared_ptr<mx::Primitive> primitive, mx::Stream s) {
  return array(x.shape(), mx::float32, std::move(primitive), {mx::contiguous(x, false, s)});
}

class Softmax : public CpuUnary {
 public:
  using CpuUnary::CpuUnary;

  std::vector<array> vjp(const std::vector<array>&, const std::vector<array>& cotangents,
                         const std::vector<int>&, const std::vector<array>& outputs) override {
    // As MLX's Softmax: s * (g - sum(g * s)) along the last axis.
    auto st = stream();
    const array& s = outputs[0];
    const array gs = mx::sum(mx::multiply(cotangents[0], s, st), -1, true, st);
    return {mx::multiply(s, mx::subtract(cotangents[0], gs, st), st)};
  }
  const char* name() const override { return "MtpSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

 protected:
  Kernel kernel() const override {
    return [](const float* in, float* out, size_t n, size_t m) { softmax_rows(in, out, n / m, m); };
  }
};

class Sigmoid : public CpuUnary {
 public:
  Sigmoid(mx::Stream stream, bool silu) : CpuUnary(stream), silu_(silu) {}

  // Derivatives through MLX's own ops (training runs through the swapped
  // layers too): sigmoid' = s (1 - s), silu' = s (1 + x (1 - s)).
  std::vector<array> jvp(const std::vector<array>& primals, const std::vector<array>& tangents,
                         const std::vector<int>&) override {
    return {mx::multiply(tangents[0], derivative(primals[0]), stream())};
  }
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>&, const std::vector<array>&) override {
    return {mx::multiply(cotangents[0], derivative(primals[0]), stream())};
  }
  std::pair<std::vector<array>, std::vector<int>> vmap(const std::vector<array>& inputs,
                                                        const std::vector<int>& axes) override {
    // Elementwise: the batched call is the call.
    return {{unary(inputs[0], std::make_shared<Sigmoid>(stream(), silu_), stream())}, {axes[0]}};
  }
  const char* name() const override { return silu_ ? "MtpSiLU" : "MtpSigmoid"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return silu_ == static_cast<const Sigmoid&>(other).silu_;
  }

 protected:
  Kernel kernel() const override {
    if (silu_) return [](const float* in, float* out, size_t n, size_t) { sigmoid_loop(in, out, n, true); };
    return [](const float* in, float* out, size_t n, size_t) { sigmoid_loop(in, out, n, false); };
  }

 private:
  array derivative(const array& x) {
    auto st = stream();
    const array s = mx::sigmoid(x, st);
    const array one_minus = mx::subtract(array(1.0f), s, st);
    if (!silu_) return mx::multiply(s, one_minus, st);
    return mx::multiply(s, mx::add(array(1.0f), mx::multiply(x, one_minus, st), st), st);
  }

  bool silu_;
};

static array sigmoid_primitive(const array& x, bool silu, const char* what) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument(std::string(what) + ": x must be float32");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return unary(x, std::make_shared<Sigmoid>(s, silu), s);
}

array sigmoid(const array& x) { return sigmoid_primitive(x, false, "sigmoid"); }
array silu(const array& x) { return sigmoid_primitive(x, true, "silu"); }

array softmax(const array& x) {
  if (x.dtype() != mx::float32 || x.ndim() == 0) {
    throw std::invalid_argument("softmax: x must be float32 with at least one dimension");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return unary(x, std::make_shared<Softmax>(s), s);
}

}  // namespace mtp

NB_MODULE(_mtp_cpu_activations, m) {
  m.doc() = "MLX's float32 sigmoid, SiLU and softmax, vectorized, as MLX CPU primitives";
  m.def("sigmoid", &mtp::sigmoid, "x"_a);
  m.def("silu", &mtp::silu, "x"_a);
  m.def("softmax", &mtp::softmax, "x"_a, "MLX's precise float32 softmax over the last axis");
}
