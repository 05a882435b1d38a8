#pragma once
// gradcheck (tests/autograd/gradcheck.hpp) for a function that communicates: every rank of
// `group` calls it together, and the gradient checked is that of the loss of the whole job.
//
// Each rank r computes y_r = f(x_r) and L_r = sum(y_r * R_r), R_r a fixed N(0, 1) tensor of its
// own (seeded by its rank). The job's loss is L = sum over ranks of L_r, or, when the output is
// replicated (every rank holds the same y and its consumers are replicated, as after
// reduce_from_group), L = L_0 with one R for every rank: the loss counted once. The analytic
// gradient is x_r.grad after one backward of y_r with grad_output R_r on every rank. The numeric
// one perturbs one element on one rank (every rank calls f each time, the others unperturbed) and
// differentiates L, which the ranks add up exactly (their double L_r all-gathered as bits); with a
// replicated input (one x that every rank holds, as before copy_to_group) the element is
// perturbed on every rank at once, since it is one variable. Every rank runs the same number of
// calls of f in the same order, which the group's collective contract needs.

#include <cstring>

#include "acc/dist/process_group.hpp"
#include "autograd/gradcheck.hpp"

namespace acc::test {

struct DistGradcheckOptions {
  GradcheckOptions base;  // eps, tolerances, max_checks, seed (wrt is not used: input 0 only)
  bool replicated_input = false;
  bool replicated_output = false;
};

namespace detail {

// The sum over ranks of `value`, exactly as each rank computed it (bits all-gathered, added in
// rank order on every rank, so every rank gets the same double).
inline double sum_over_ranks(double value, dist::ProcessGroup& group) {
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  Tensor mine = from_vector(std::vector<int64_t>{bits}, {1});
  Tensor all = empty({group.size()}, {DType::kInt64});
  group.allgather(all, mine)->wait();
  double sum = 0;
  for (int64_t b : all.to_vector<int64_t>()) {
    double v = 0;
    std::memcpy(&v, &b, sizeof(v));
    sum += v;
  }
  return sum;
}

}  // namespace detail

/// Checks the gradient of f at this rank's `x` against central differences of the job's loss
/// (see the file comment). Collective over `group`: every rank calls it with an x of the same
/// shape. The result describes this rank's elements.
inline GradcheckResult dist_gradcheck(const std::function<Tensor(const Tensor&)>& f,
                                      const Tensor& x, dist::ProcessGroup& group,
                                      const DistGradcheckOptions& opt = {}) {
  GradcheckResult res;
  std::ostringstream report;
  const int W = group.size(), rank = group.rank();
  Tensor leaf = x.detach().clone();
  leaf.set_requires_grad(true);
  Tensor y = f(leaf);
  Generator gen(opt.base.seed + (opt.replicated_output ? 0 : static_cast<uint64_t>(rank)));
  const Tensor R = randn(y.shape(), gen);
  const std::vector<double> r = R.to_vector<double>();
  y.backward(R);
  const Tensor g = leaf.grad();
  const std::vector<double> analytic =
      g.defined() ? g.to_vector<double>() : std::vector<double>(x.numel(), 0.0);

  NoGradGuard no_grad;
  Tensor arg = x.detach().clone();
  float* px = arg.data<float>();
  auto loss = [&] {
    const double mine = ::acc::test::detail::weighted_sum(f(arg), r);
    const double all = detail::sum_over_ranks(mine, group);
    return opt.replicated_output ? all / W : all;  // replicated: W equal terms, counted once
  };
  const std::vector<int64_t> elements =
      ::acc::test::detail::pick_elements(x.numel(), opt.base.max_checks, opt.base.seed);
  int reported = 0;
  for (int owner = 0; owner < (opt.replicated_input ? 1 : W); ++owner) {
    const bool mine = opt.replicated_input || owner == rank;
    for (int64_t e : elements) {
      const float orig = px[e];
      const float hi = static_cast<float>(orig + opt.base.eps);
      const float lo = static_cast<float>(orig - opt.base.eps);
      if (mine) px[e] = hi;
      const double fp = loss();
      if (mine) px[e] = lo;
      const double fm = loss();
      px[e] = orig;
      if (!mine) continue;
      const double numeric = (fp - fm) / (static_cast<double>(hi) - static_cast<double>(lo));
      const double a = analytic[static_cast<size_t>(e)];
      const double err = std::abs(a - numeric);
      const double tol = opt.base.atol + opt.base.rtol * std::abs(numeric);
      ++res.checked;
      res.max_abs_err = std::max(res.max_abs_err, err);
      res.worst_ratio = std::max(res.worst_ratio, err / tol);
      if (!(err <= tol)) {
        ++res.mismatches;
        res.ok = false;
        if (reported++ < 8) {
          report << "rank " << rank << " element " << e << ": analytic " << a << ", numeric "
                 << numeric << ", |diff| " << err << " > tol " << tol << "\n";
        }
      }
    }
  }
  res.report = report.str();
  return res;
}

}  // namespace acc::test
