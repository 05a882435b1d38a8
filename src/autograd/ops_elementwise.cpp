#include <cmath>

#include "acc/autograd/ops.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "op_util.hpp"

namespace acc {

using kernels::binary;
using kernels::BinaryOp;
using kernels::sum_to;

namespace {

Tensor binary_op(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  detail::check_f32(a, name, "a");
  detail::check_f32(b, name, "b");
  detail::check_same_device(name, {&a, &b});
  Tensor out = binary(op, a, b);
  Shape sa = a.shape(), sb = b.shape();
  switch (op) {
    case BinaryOp::kAdd:
      autograd::record_op("AddBackward", {a, b}, {out},
                          [sa, sb](const std::vector<Tensor>& g, const std::vector<bool>& need) {
                            return std::vector<Tensor>{need[0] ? sum_to(g[0], sa) : Tensor(),
                                                       need[1] ? sum_to(g[0], sb) : Tensor()};
                          });
      break;
    case BinaryOp::kSub:
      autograd::record_op("SubBackward", {a, b}, {out},
                          [sa, sb](const std::vector<Tensor>& g, const std::vector<bool>& need) {
                            return std::vector<Tensor>{
                                need[0] ? sum_to(g[0], sa) : Tensor(),
                                need[1] ? sum_to(scale(g[0], -1.0), sb) : Tensor()};
                          });
      break;
    case BinaryOp::kMul:
      autograd::record_op(
          "MulBackward", {a, b}, {out},
          [a, b](const std::vector<Tensor>& g, const std::vector<bool>& need) {
            return std::vector<Tensor>{
                need[0] ? sum_to(binary(BinaryOp::kMul, g[0], b), a.shape()) : Tensor(),
                need[1] ? sum_to(binary(BinaryOp::kMul, g[0], a), b.shape()) : Tensor()};
          });
      break;
    case BinaryOp::kDiv:
      autograd::record_op("DivBackward", {a, b}, {out},
                          [a, b](const std::vector<Tensor>& g, const std::vector<bool>& need) {
                            Tensor ga, gb;
                            if (need[0]) ga = sum_to(binary(BinaryOp::kDiv, g[0], b), a.shape());
                            if (need[1]) {
                              // d(a/b)/db = -a / b^2
                              Tensor t = binary(BinaryOp::kDiv, binary(BinaryOp::kMul, g[0], a),
                                                binary(BinaryOp::kMul, b, b));
                              gb = sum_to(scale(t, -1.0), b.shape());
                            }
                            return std::vector<Tensor>{ga, gb};
                          });
      break;
  }
  return out;
}

// out = f(x) elementwise; backward dx = df(x, y, dout).
template <class Fwd, class Bwd>
Tensor unary_op(const char* name, const char* backward_name, const Tensor& x, Fwd fwd, Bwd bwd) {
  detail::check_f32(x, name, "x");
  Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.options());
  if (!out.is_meta()) {
    const float* px = xc.data<float>();
    float* po = out.data<float>();
    parallel_for(out.numel(), 1 << 14, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) po[i] = fwd(px[i]);
    });
  }
  Tensor y = detail::saved_output(out);
  autograd::record_op(backward_name, {x}, {out},
                      [xc, y, bwd](const std::vector<Tensor>& g, const std::vector<bool>&) {
                        Tensor gc = g[0].contiguous();
                        Tensor dx = empty(xc.shape(), xc.options());
                        if (!dx.is_meta()) {
                          const float* px = xc.data<float>();
                          const float* py = y.data<float>();
                          const float* pg = gc.data<float>();
                          float* pd = dx.data<float>();
                          parallel_for(dx.numel(), 1 << 14, [&](int64_t b, int64_t e) {
                            for (int64_t i = b; i < e; ++i) pd[i] = bwd(px[i], py[i], pg[i]);
                          });
                        }
                        return std::vector<Tensor>{dx};
                      });
  return out;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::kAdd, "add", a, b);
}
Tensor sub(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::kSub, "sub", a, b);
}
Tensor mul(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::kMul, "mul", a, b);
}
Tensor div(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::kDiv, "div", a, b);
}

Tensor scale(const Tensor& a, double s) {
  const float f = static_cast<float>(s);
  return unary_op(
      "scale", "ScaleBackward", a, [f](float x) { return x * f; },
      [f](float, float, float g) { return g * f; });
}

Tensor add_scalar(const Tensor& a, double s) {
  const float f = static_cast<float>(s);
  return unary_op(
      "add_scalar", "AddScalarBackward", a, [f](float x) { return x + f; },
      [](float, float, float g) { return g; });
}

Tensor neg(const Tensor& a) {
  return scale(a, -1.0);
}

Tensor exp(const Tensor& a) {
  return unary_op(
      "exp", "ExpBackward", a, [](float x) { return std::exp(x); },
      [](float, float y, float g) { return g * y; });
}

Tensor log(const Tensor& a) {
  return unary_op(
      "log", "LogBackward", a, [](float x) { return std::log(x); },
      [](float x, float, float g) { return g / x; });
}

Tensor tanh(const Tensor& a) {
  return unary_op(
      "tanh", "TanhBackward", a, [](float x) { return std::tanh(x); },
      [](float, float y, float g) { return g * (1.f - y * y); });
}

Tensor square(const Tensor& a) {
  return unary_op(
      "square", "SquareBackward", a, [](float x) { return x * x; },
      [](float x, float, float g) { return 2.f * x * g; });
}

}  // namespace acc
