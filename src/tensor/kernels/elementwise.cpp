#include <algorithm>
#include <cmath>

#include "../strided.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/tensor/node.hpp"
#include "acc/util/error.hpp"
#include "vec_math.hpp"

namespace acc::kernels {
namespace {
constexpr int64_t kGrain = 1 << 14;
constexpr float kSqrt2OverPi = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1/sqrt(2 pi)
}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    ACC_CHECK_SHAPE(da == db || da == 1 || db == 1, "shapes ", a, " and ", b,
                    " cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  ACC_CHECK_SHAPE(g.dim() >= static_cast<int64_t>(shape.size()), "sum_to: cannot reduce ",
                  g.shape(), " to ", shape);
  Tensor out = zeros(shape, g.options());
  if (g.is_meta()) return out;
  ACC_CHECK_TYPE(g.dtype() == DType::kFloat32, "sum_to: expects f32, got ", g.dtype());
  // Reducing leading dimensions only (a bias broadcast over rows): add_column_sums, in parallel
  // and reading rows in memory order (its additions are grouped, so the last bits may differ from
  // the general loop below).
  const auto lead = static_cast<std::ptrdiff_t>(g.dim() - static_cast<int64_t>(shape.size()));
  if (std::equal(shape.begin(), shape.end(), g.shape().begin() + lead)) {
    const int64_t n = out.numel();
    if (n > 0)
      add_column_sums(out.data<float>(), g.contiguous().data<float>(), g.numel() / n, n, n);
    return out;
  }
  // Strides of out seen from g's shape: broadcast dimensions get stride 0 and so accumulate.
  Tensor gc = g.contiguous();
  Shape ost = detail::broadcast_strides(out, g.shape());
  float* o = out.data<float>();
  const float* gp = gc.data<float>();
  // Serial: different rows of g may land on the same element of out.
  NoGradGuard ng;
  detail::RowLoop<2> r = detail::coalesce<2>(g.shape(), {gc.strides(), ost});
  const int64_t nd = static_cast<int64_t>(r.shape.size());
  const int64_t inner = r.shape.back();
  std::vector<int64_t> idx(nd, 0);
  int64_t rows = numel_of(r.shape) / std::max<int64_t>(inner, 1);
  int64_t goff = 0, ooff = 0;
  const int64_t gi = r.strides[0].back(), oi = r.strides[1].back();
  for (int64_t row = 0; row < rows; ++row) {
    if (oi == 0) {
      float s = 0;
      for (int64_t i = 0; i < inner; ++i) s += gp[goff + i * gi];
      o[ooff] += s;
    } else {
      for (int64_t i = 0; i < inner; ++i) o[ooff + i * oi] += gp[goff + i * gi];
    }
    for (int64_t d = nd - 2; d >= 0; --d) {
      ++idx[d];
      goff += r.strides[0][d];
      ooff += r.strides[1][d];
      if (idx[d] < r.shape[d]) break;
      goff -= idx[d] * r.strides[0][d];
      ooff -= idx[d] * r.strides[1][d];
      idx[d] = 0;
    }
  }
  return out;
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  Shape shape = broadcast_shapes(a.shape(), b.shape());
  Tensor out = empty(shape, a.options());
  if (out.is_meta()) return out;
  float* o = out.data<float>();
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  std::array<Shape, 3> st{out.strides(), detail::broadcast_strides(a, shape),
                          detail::broadcast_strides(b, shape)};
  detail::for_each_row<3>(
      shape, st,
      [&](const std::array<int64_t, 3>& off, int64_t n, const std::array<int64_t, 3>& inc) {
        float* y = o + off[0];
        const float* x1 = pa + off[1];
        const float* x2 = pb + off[2];
        auto run = [&](auto f) {
          if (inc[1] == 1 && inc[2] == 1) {
            for (int64_t i = 0; i < n; ++i) y[i] = f(x1[i], x2[i]);
          } else if (inc[1] == 1 && inc[2] == 0) {
            const float s = x2[0];
            for (int64_t i = 0; i < n; ++i) y[i] = f(x1[i], s);
          } else if (inc[1] == 0 && inc[2] == 1) {
            const float s = x1[0];
            for (int64_t i = 0; i < n; ++i) y[i] = f(s, x2[i]);
          } else {
            for (int64_t i = 0; i < n; ++i) y[i] = f(x1[i * inc[1]], x2[i * inc[2]]);
          }
        };
        switch (op) {
          case BinaryOp::kAdd:
            run([](float u, float v) { return u + v; });
            break;
          case BinaryOp::kSub:
            run([](float u, float v) { return u - v; });
            break;
          case BinaryOp::kMul:
            run([](float u, float v) { return u * v; });
            break;
          case BinaryOp::kDiv:
            run([](float u, float v) { return u / v; });
            break;
        }
      });
  return out;
}

void gelu_forward(float* out, const float* x, int64_t n, bool tanh_approx) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    if (tanh_approx) {
      // 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
      for (int64_t i = b; i < e; ++i) {
        const float v = x[i];
        const float u = kSqrt2OverPi * (v + 0.044715f * v * v * v);
        out[i] = v * vec::sigmoid(2.f * u);
      }
    } else {
      for (int64_t i = b; i < e; ++i) out[i] = 0.5f * x[i] * (1.f + std::erf(x[i] * kInvSqrt2));
    }
  });
}

void gelu_backward(float* dx, const float* x, const float* dout, int64_t n, bool tanh_approx) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    if (tanh_approx) {
      // d/dx [x s(2u)] = s + 2 x s (1 - s) u'
      for (int64_t i = b; i < e; ++i) {
        const float v = x[i];
        const float u = kSqrt2OverPi * (v + 0.044715f * v * v * v);
        const float s = vec::sigmoid(2.f * u);
        const float du = kSqrt2OverPi * (1.f + 3.f * 0.044715f * v * v);
        dx[i] = dout[i] * (s + 2.f * v * s * (1.f - s) * du);
      }
    } else {
      for (int64_t i = b; i < e; ++i) {
        const float v = x[i];
        const float cdf = 0.5f * (1.f + std::erf(v * kInvSqrt2));
        const float pdf = kInvSqrt2Pi * vec::exp(-0.5f * v * v);
        dx[i] = dout[i] * (cdf + v * pdf);
      }
    }
  });
}

void silu_forward(float* out, const float* x, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = x[i] * vec::sigmoid(x[i]);
  });
}

void silu_backward(float* dx, const float* x, const float* dout, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float s = vec::sigmoid(x[i]);
      dx[i] = dout[i] * s * (1.f + x[i] * (1.f - s));
    }
  });
}

void relu_forward(float* out, const float* x, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = x[i] > 0.f ? x[i] : 0.f;
  });
}

void relu_backward(float* dx, const float* x, const float* dout, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dx[i] = x[i] > 0.f ? dout[i] : 0.f;
  });
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = gate[i] * vec::sigmoid(gate[i]) * up[i];
  });
}

void swiglu_backward(float* dgate, float* dup, const float* gate, const float* up,
                     const float* dout, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    if (dup) {
      for (int64_t i = b; i < e; ++i) dup[i] = dout[i] * gate[i] * vec::sigmoid(gate[i]);
    }
    if (dgate) {
      for (int64_t i = b; i < e; ++i) {
        const float g = gate[i];
        const float s = vec::sigmoid(g);
        dgate[i] = dout[i] * up[i] * s * (1.f + g * (1.f - s));
      }
    }
  });
}

}  // namespace acc::kernels
