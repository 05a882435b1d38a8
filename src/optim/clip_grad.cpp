#include "acc/optim/clip_grad.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "acc/tensor/node.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"
#include "optim_util.hpp"

namespace acc::optim {

namespace {

// Elements per reduction chunk. Chunk results are combined in chunk order, so a norm does not
// depend on the number of threads.
constexpr int64_t kNormChunk = int64_t{1} << 16;

bool is_inf_norm(double norm_type) {
  return norm_type == std::numeric_limits<double>::infinity();
}

void check_norm_type(const char* who, double norm_type) {
  ACC_CHECK(norm_type > 0.0, who, ": norm_type must be > 0 (or infinity), got ", norm_type);
}

/// The defined gradients of `params`, checked.
std::vector<Tensor> grads_of(const NamedParams& params, const char* who) {
  std::vector<Tensor> out;
  out.reserve(params.size());
  for (const auto& [name, p] : params) {
    if (!p.defined()) continue;
    Tensor g = p.grad();
    if (!g.defined()) continue;
    ACC_CHECK_TYPE(g.dtype() == DType::kFloat32 && !g.is_meta(), who, ": gradient of '", name,
                   "' must be an f32 cpu tensor, got ", g.dtype(), " on ", g.device());
    ACC_CHECK(g.is_contiguous(), who, ": gradient of '", name, "' must be contiguous, got strides ",
              g.strides());
    out.push_back(std::move(g));
  }
  return out;
}

// x (n): max |x|, NaN when any element is NaN.
double max_abs(const float* x, int64_t n) {
  float m = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan |= a != a;
    m = std::max(m, a);
  }
  return nan ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(m);
}

// x (n): sum f(x) in double, over kLanes independent accumulators so that the loop vectorises
// without reassociating floating-point sums. 32 lanes are four AVX-512 registers of doubles: four
// independent addition chains keep the loop at memory speed instead of waiting on add latency.
template <class F>
double lane_sum(const float* x, int64_t n, F f) {
  constexpr int kLanes = 32;
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += f(static_cast<double>(x[i + j]));
  }
  double s = 0.0;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  for (; i < n; ++i) s += f(static_cast<double>(x[i]));
  return s;
}

// x (n): sum |x|^p in double (the square of an f32 is exact in double).
double sum_abs_pow(const float* x, int64_t n, double p) {
  if (p == 2.0) return lane_sum(x, n, [](double v) { return v * v; });
  if (p == 1.0) return lane_sum(x, n, [](double v) { return std::fabs(v); });
  return lane_sum(x, n, [p](double v) { return std::pow(std::fabs(v), p); });
}

double chunk_partial(const float* x, int64_t n, double norm_type) {
  if (is_inf_norm(norm_type)) return max_abs(x, n);
  return sum_abs_pow(x, n, norm_type);
}

double combine(double a, double b, bool inf_norm) {
  if (!inf_norm) return a + b;
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return std::max(a, b);
}

double partial_of(const std::vector<Tensor>& grads, double norm_type) {
  const bool inf_norm = is_inf_norm(norm_type);
  double total = 0.0;
  for (const Tensor& g : grads) {
    const float* x = g.data<float>();
    const int64_t n = g.numel();
    const int64_t chunks = (n + kNormChunk - 1) / kNormChunk;
    std::vector<double> parts(static_cast<size_t>(chunks), 0.0);
    parallel_for(chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t off = c * kNormChunk;
        parts[static_cast<size_t>(c)] =
            chunk_partial(x + off, std::min(kNormChunk, n - off), norm_type);
      }
    });
    for (double p : parts) total = combine(total, p, inf_norm);
  }
  return total;
}

}  // namespace

double grad_norm_squared(const NamedParams& params) {
  return partial_of(grads_of(params, "grad_norm_squared"), 2.0);
}

double grad_norm_partial(const NamedParams& params, double norm_type) {
  check_norm_type("grad_norm_partial", norm_type);
  return partial_of(grads_of(params, "grad_norm_partial"), norm_type);
}

double total_norm_from_partial(double partial, double norm_type) {
  check_norm_type("total_norm_from_partial", norm_type);
  if (is_inf_norm(norm_type) || norm_type == 1.0) return partial;
  if (norm_type == 2.0) return std::sqrt(partial);
  return std::pow(partial, 1.0 / norm_type);
}

double get_total_norm(const NamedParams& params, double norm_type) {
  check_norm_type("get_total_norm", norm_type);
  return total_norm_from_partial(partial_of(grads_of(params, "get_total_norm"), norm_type),
                                 norm_type);
}

double clip_coefficient(double max_norm, double total_norm) {
  detail::check_non_negative("clip_coefficient", "max_norm", max_norm);
  const double clip_coef = max_norm / (total_norm + 1e-6);
  return clip_coef < 1.0 ? clip_coef : 1.0;
}

void clip_grads_with_norm_(const NamedParams& params, double max_norm, double total_norm) {
  detail::check_non_negative("clip_grads_with_norm_", "max_norm", max_norm);
  std::vector<Tensor> grads = grads_of(params, "clip_grads_with_norm_");
  const double clip_coef = clip_coefficient(max_norm, total_norm);
  if (!(clip_coef < 1.0)) return;
  const float coef = static_cast<float>(clip_coef);
  NoGradGuard no_grad;
  for (Tensor& g : grads) {
    float* x = g.data<float>();
    parallel_for(g.numel(), detail::kUpdateGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) x[i] = x[i] * coef;
    });
  }
}

double clip_grad_norm_(const NamedParams& params, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  detail::check_non_negative("clip_grad_norm_", "max_norm", max_norm);
  check_norm_type("clip_grad_norm_", norm_type);
  const double total = get_total_norm(params, norm_type);
  ACC_CHECK(!error_if_nonfinite || std::isfinite(total),
            "clip_grad_norm_: the total norm of order ", norm_type,
            " of the gradients is non-finite (", total, "), so it cannot be clipped");
  clip_grads_with_norm_(params, max_norm, total);
  return total;
}

}  // namespace acc::optim
