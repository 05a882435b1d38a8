#pragma once
// The op test harness (ggml test-backend-ops style): one routine checks any differentiable
// function of f32 tensors against central finite differences, another checks it against a
// reference implementation (forward value and every input gradient).
//
// gradcheck(f, inputs): with R a fixed N(0, 1) tensor of f's output shape, the analytic gradient
// of L(x) = sum(f(x) * R) (one backward with grad_output R, so every output element matters) is
// compared element by element with
//     numeric = (L(x + eps e_i) - L(x - eps e_i)) / (x_i^+ - x_i^-),
// where x_i^+/- are the perturbed values as actually stored in f32 (not x_i +/- eps), and L is
// accumulated in double from the f32 outputs. An element passes when
//     |analytic - numeric| <= atol + rtol * |numeric|.
// AutoAcc has no f64, so the perturbed forward runs in f32: eps must be large enough that the
// rounding of the outputs (~1e-7 relative, divided by 2 eps) stays far below atol, and small
// enough that the truncation error (~eps^2 f''' / 6) stays below it too. Test inputs are O(1),
// so the default eps = 1e-2 (absolute) is a 1e-2 relative step; the tests state their choice.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "acc/autograd/engine.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/tensor/node.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::test {

using TensorFn = std::function<Tensor(const std::vector<Tensor>&)>;

struct GradcheckOptions {
  double eps = 1e-2;   // finite-difference step (absolute)
  double rtol = 1e-2;  // per-element tolerance: atol + rtol * |numeric|
  double atol = 1e-3;
  /// Elements checked by finite differences per input; larger inputs get a fixed pseudo-random
  /// subset that always includes the first and last element (the analytic side is always full).
  int64_t max_checks = 256;
  uint64_t seed = 1234;  // R and the subset
  /// Inputs to differentiate; empty means every f32 input. Others are passed as constants.
  std::vector<bool> wrt;
};

struct GradcheckResult {
  bool ok = true;
  int64_t checked = 0;     // elements compared
  int64_t mismatches = 0;  // elements outside tolerance
  double max_abs_err = 0;  // max |analytic - numeric|
  double worst_ratio = 0;  // max |analytic - numeric| / (atol + rtol |numeric|); <= 1 passes
  std::string report;      // the failure reasons (first few mismatches), empty when ok
};

namespace detail {

inline std::vector<bool> resolve_wrt(const std::vector<Tensor>& inputs,
                                     const std::vector<bool>& wrt) {
  std::vector<bool> out(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    out[i] = (wrt.empty() || (i < wrt.size() && wrt[i])) && inputs[i].defined() &&
             inputs[i].dtype() == DType::kFloat32;
  }
  return out;
}

/// Private contiguous copies of the inputs (perturbing them never touches the caller's tensors);
/// the ones in `wrt` become leaves that require grad.
inline std::vector<Tensor> make_leaves(const std::vector<Tensor>& inputs,
                                       const std::vector<bool>& wrt) {
  std::vector<Tensor> leaves(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    leaves[i] = inputs[i].detach().clone();
    if (wrt[i]) leaves[i].set_requires_grad(true);
  }
  return leaves;
}

inline double weighted_sum(const Tensor& y, const std::vector<double>& r) {
  const std::vector<double> v = y.to_vector<double>();
  double s = 0;
  for (size_t i = 0; i < v.size(); ++i) s += v[i] * r[i];
  return s;
}

/// Indices of the elements to check: all of them, or a fixed subset of `max_checks`.
inline std::vector<int64_t> pick_elements(int64_t n, int64_t max_checks, uint64_t seed) {
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), int64_t{0});
  if (n <= max_checks || max_checks < 2) return idx;
  Generator gen(seed);
  // Partial Fisher-Yates over [1, n-1) keeps element 0 and n-1 and picks the rest at random.
  for (int64_t i = 1; i < max_checks - 1; ++i) {
    const int64_t j = i + static_cast<int64_t>(gen.next_u64() % static_cast<uint64_t>(n - 1 - i));
    std::swap(idx[static_cast<size_t>(i)], idx[static_cast<size_t>(j)]);
  }
  std::vector<int64_t> out(idx.begin(), idx.begin() + (max_checks - 1));
  out.push_back(n - 1);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace detail

/// Checks the gradient of f at `inputs` against central differences (see the file comment).
inline GradcheckResult gradcheck(const TensorFn& f, const std::vector<Tensor>& inputs,
                                 const GradcheckOptions& opt = {}) {
  GradcheckResult res;
  std::ostringstream report;
  auto fail = [&](const std::string& why) {
    res.ok = false;
    report << why << "\n";
  };
  const std::vector<bool> wrt = detail::resolve_wrt(inputs, opt.wrt);
  std::vector<Tensor> leaves = detail::make_leaves(inputs, wrt);

  // Analytic: one backward of f(x) with grad_output R.
  Tensor y = f(leaves);
  if (!y.defined() || y.dtype() != DType::kFloat32 || y.is_meta()) {
    fail("f must return a defined f32 cpu tensor");
    res.report = report.str();
    return res;
  }
  if (!y.requires_grad()) {
    fail("the output of f does not require grad (no differentiable path from the inputs)");
    res.report = report.str();
    return res;
  }
  Generator gen(opt.seed);
  const Tensor R = randn(y.shape(), gen);
  const std::vector<double> r = R.to_vector<double>();
  const std::vector<float> y_grad_mode = y.detach().to_vector<float>();
  y.backward(R);

  NoGradGuard no_grad;
  std::vector<Tensor> args(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (leaves[i].defined()) args[i] = leaves[i].detach().clone();
  }
  // The forward must not depend on grad mode (the finite differences run without it).
  if (f(args).to_vector<float>() != y_grad_mode) {
    fail("f gives different values with and without grad mode");
  }

  int reported = 0;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!wrt[i]) continue;
    const int64_t n = leaves[i].numel();
    Tensor g = leaves[i].grad();
    std::vector<double> analytic(static_cast<size_t>(n), 0.0);
    if (g.defined()) {
      if (g.shape() != leaves[i].shape()) {
        fail("input " + std::to_string(i) + ": gradient shape " + to_string(g.shape()) +
             " differs from input shape " + to_string(leaves[i].shape()));
        continue;
      }
      analytic = g.to_vector<double>();
    }
    Tensor x = args[i];
    float* px = x.data<float>();
    for (int64_t e : detail::pick_elements(n, opt.max_checks, opt.seed + i)) {
      const float orig = px[e];
      const float hi = static_cast<float>(orig + opt.eps);
      const float lo = static_cast<float>(orig - opt.eps);
      px[e] = hi;
      const double fp = detail::weighted_sum(f(args), r);
      px[e] = lo;
      const double fm = detail::weighted_sum(f(args), r);
      px[e] = orig;
      const double numeric = (fp - fm) / (static_cast<double>(hi) - static_cast<double>(lo));
      const double a = analytic[static_cast<size_t>(e)];
      const double err = std::abs(a - numeric);
      const double tol = opt.atol + opt.rtol * std::abs(numeric);
      ++res.checked;
      res.max_abs_err = std::max(res.max_abs_err, err);
      res.worst_ratio = std::max(res.worst_ratio, err / tol);
      if (!(err <= tol)) {  // also catches NaN
        ++res.mismatches;
        if (reported++ < 8) {
          std::ostringstream os;
          os << "input " << i << " element " << e << ": analytic " << a << ", numeric " << numeric
             << ", |diff| " << err << " > tol " << tol;
          fail(os.str());
        }
      }
    }
  }
  if (res.mismatches > 0) {
    report << res.mismatches << " of " << res.checked << " elements outside tolerance (worst "
           << res.worst_ratio << "x tol)\n";
  }
  res.report = report.str();
  return res;
}

struct CompareResult {
  double forward_err = 0;         // max |f - ref| over the output
  std::vector<double> grad_errs;  // max |grad_f - grad_ref| per input (0 for non-f32 inputs)
  std::string report;             // non-empty when a shape or gradient presence differs
};

/// Runs f and ref on the same inputs, back-propagates the same random R through both and returns
/// the largest differences of the outputs and of every input gradient.
inline CompareResult compare_with_reference(const TensorFn& f, const TensorFn& ref,
                                            const std::vector<Tensor>& inputs, uint64_t seed = 99) {
  CompareResult res;
  const std::vector<bool> wrt = detail::resolve_wrt(inputs, {});
  std::vector<Tensor> a = detail::make_leaves(inputs, wrt), b = detail::make_leaves(inputs, wrt);
  Tensor ya = f(a), yb = ref(b);
  if (ya.shape() != yb.shape()) {
    res.report = "output shapes differ: " + to_string(ya.shape()) + " vs " + to_string(yb.shape());
    return res;
  }
  res.forward_err = max_abs_diff(ya, yb);
  Generator gen(seed);
  const Tensor R = randn(ya.shape(), gen);
  ya.backward(R);
  yb.backward(R);
  res.grad_errs.assign(inputs.size(), 0.0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!wrt[i]) continue;
    Tensor ga = a[i].grad(), gb = b[i].grad();
    if (ga.defined() != gb.defined()) {
      res.report += "input " + std::to_string(i) + ": gradient defined on one side only\n";
      continue;
    }
    if (ga.defined()) res.grad_errs[i] = max_abs_diff(ga, gb);
  }
  return res;
}

/// Max over a CompareResult's gradient errors.
inline double max_grad_err(const CompareResult& r) {
  double m = 0;
  for (double e : r.grad_errs) m = std::max(m, e);
  return m;
}

}  // namespace acc::test
