#include "acc/optim/adam.hpp"

#include <cmath>

#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"
#include "optim_util.hpp"

namespace acc::optim {

namespace {

// Scalars of one Adam/AdamW update, computed in double as torch does and rounded to f32 where
// torch hands them to an f32 kernel.
struct AdamCoeffs {
  float l2;     // Adam: g += l2 * p
  float decay;  // AdamW: p *= decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float bc2_sqrt;  // sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
  float grad_scale;     // g *= grad_scale first (fused gradient clipping)
};

// p (n), g (n), m (n), v (n). Same float operation order as torch's _single_tensor_adam(w):
//   m = m * b1 + (1 - b1) * g;  v = v * b2 + ((1 - b2) * g) * g;
//   p = p + ((-step_size) * m) / (sqrt(v) / bc2_sqrt + eps)
template <bool kL2, bool kDecoupled, bool kScaled>
void adam_kernel(float* __restrict p, const float* __restrict g, float* __restrict m,
                 float* __restrict v, int64_t n, const AdamCoeffs& c) {
  parallel_for(n, detail::kUpdateGrain, [&](int64_t begin, int64_t end) {
    // Staged only when the scaled gradient feeds an addition (the L2 term); elsewhere it only
    // feeds multiplications, which the compiler cannot contract with it.
    constexpr bool kStaged = kScaled && kL2;
    detail::with_scaled_grad<kStaged>(
        g, c.grad_scale, begin, end,
        [&](const float* __restrict gp, int64_t b, int64_t e, int64_t base) {
          for (int64_t i = b; i < e; ++i) {
            float pi = p[i];
            float gi = gp[i - base];
            if constexpr (kScaled && !kStaged) gi = gi * c.grad_scale;
            if constexpr (kL2) gi = gi + c.l2 * pi;
            if constexpr (kDecoupled) pi = pi * c.decay;
            const float mi = m[i] * c.beta1 + c.one_minus_beta1 * gi;
            const float vi = v[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
            m[i] = mi;
            v[i] = vi;
            const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
            p[i] = pi + c.neg_step_size * mi / denom;
          }
        });
  });
}

struct AdamLike {
  double lr;
  std::pair<double, double> betas;
  double eps;
  double weight_decay;
};

void validate(const AdamLike& o, const std::string& who) {
  detail::check_non_negative(who, "lr", o.lr);
  detail::check_range(who, "betas[0]", o.betas.first, 0.0, 1.0, /*hi_inclusive=*/false);
  detail::check_range(who, "betas[1]", o.betas.second, 0.0, 1.0, /*hi_inclusive=*/false);
  detail::check_non_negative(who, "eps", o.eps);
  detail::check_non_negative(who, "weight_decay", o.weight_decay);
}

template <class Options>
AdamLike as_adam_like(const Options& o) {
  return {o.lr, o.betas, o.eps, o.weight_decay};
}

void resolve_adam_group(const AdamLike& defaults, ParamGroup& group, size_t index,
                        const std::string& opt) {
  const std::string who = opt + ": param group " + std::to_string(index);
  const char* foreign = group.momentum    ? "momentum"
                        : group.dampening ? "dampening"
                        : group.nesterov  ? "nesterov"
                                          : nullptr;
  ACC_CHECK(foreign == nullptr, who, " sets ", foreign, ", which ", opt, " does not use");
  AdamLike o = defaults;
  if (group.lr) o.lr = *group.lr;
  if (group.betas) o.betas = *group.betas;
  if (group.eps) o.eps = *group.eps;
  if (group.weight_decay) o.weight_decay = *group.weight_decay;
  validate(o, who);
  group.lr = o.lr;
  group.betas = o.betas;
  group.eps = o.eps;
  group.weight_decay = o.weight_decay;
}

template <bool kScaled>
void adam_dispatch(float* p, const float* g, float* m, float* v, int64_t n, const AdamCoeffs& c,
                   bool decoupled, bool l2) {
  if (decoupled) {
    adam_kernel<false, true, kScaled>(p, g, m, v, n, c);
  } else if (l2) {
    adam_kernel<true, false, kScaled>(p, g, m, v, n, c);
  } else {
    adam_kernel<false, false, kScaled>(p, g, m, v, n, c);
  }
}

void adam_update(const ParamGroup& group, int64_t step, Tensor& param, std::vector<Tensor>& buffers,
                 const Tensor& grad, bool decoupled, float grad_scale) {
  const double lr = *group.lr;
  const double wd = *group.weight_decay;
  const auto [beta1, beta2] = *group.betas;
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(beta1, t);
  const double bias_correction2 = 1.0 - std::pow(beta2, t);
  const AdamCoeffs c{static_cast<float>(wd),
                     static_cast<float>(1.0 - lr * wd),
                     static_cast<float>(beta1),
                     static_cast<float>(1.0 - beta1),
                     static_cast<float>(beta2),
                     static_cast<float>(1.0 - beta2),
                     static_cast<float>(std::sqrt(bias_correction2)),
                     static_cast<float>(*group.eps),
                     static_cast<float>(-(lr / bias_correction1)),
                     grad_scale};
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* m = buffers[0].data<float>();
  float* v = buffers[1].data<float>();
  const int64_t n = param.numel();
  if (grad_scale != 1.f) {
    adam_dispatch<true>(p, g, m, v, n, c, decoupled, wd != 0.0);
  } else {
    adam_dispatch<false>(p, g, m, v, n, c, decoupled, wd != 0.0);
  }
}

}  // namespace

// ---- Adam ----

Adam::Adam(NamedParams params, Options options)
    : Adam(std::vector<ParamGroup>{ParamGroup{.params = std::move(params)}}, options) {}

Adam::Adam(std::vector<ParamGroup> groups, Options defaults) : defaults_(defaults) {
  validate(as_adam_like(defaults_), "adam");
  init(std::move(groups));
}

OptimizerFactory Adam::factory(Options options) {
  validate(as_adam_like(options), "adam");
  return {[options](std::vector<ParamGroup> groups) -> std::unique_ptr<Optimizer> {
            return std::make_unique<Adam>(std::move(groups), options);
          },
          nullptr};
}

OptimizerFactory Adam::factory(Options options, ParamGrouping grouping) {
  validate(as_adam_like(options), "adam");
  ACC_CHECK(grouping != nullptr, "adam: factory got an empty grouping function");
  return {[options](std::vector<ParamGroup> groups) -> std::unique_ptr<Optimizer> {
            return std::make_unique<Adam>(std::move(groups), options);
          },
          std::move(grouping)};
}

void Adam::resolve_group(ParamGroup& group, size_t index) const {
  resolve_adam_group(as_adam_like(defaults_), group, index, "adam");
}

std::vector<std::string> Adam::buffer_names(const ParamGroup&) const {
  return {"exp_avg", "exp_avg_sq"};
}

void Adam::update(const ParamGroup& group, ParamState& state, const Tensor& grad) {
  adam_update(group, state.step, state.param, state.buffers, grad, /*decoupled=*/false,
              grad_scale());
}

// ---- AdamW ----

AdamW::AdamW(NamedParams params, Options options)
    : AdamW(std::vector<ParamGroup>{ParamGroup{.params = std::move(params)}}, options) {}

AdamW::AdamW(std::vector<ParamGroup> groups, Options defaults) : defaults_(defaults) {
  validate(as_adam_like(defaults_), "adamw");
  init(std::move(groups));
}

OptimizerFactory AdamW::factory(Options options) {
  validate(as_adam_like(options), "adamw");
  return {[options](std::vector<ParamGroup> groups) -> std::unique_ptr<Optimizer> {
            return std::make_unique<AdamW>(std::move(groups), options);
          },
          nullptr};
}

OptimizerFactory AdamW::factory(Options options, ParamGrouping grouping) {
  validate(as_adam_like(options), "adamw");
  ACC_CHECK(grouping != nullptr, "adamw: factory got an empty grouping function");
  return {[options](std::vector<ParamGroup> groups) -> std::unique_ptr<Optimizer> {
            return std::make_unique<AdamW>(std::move(groups), options);
          },
          std::move(grouping)};
}

void AdamW::resolve_group(ParamGroup& group, size_t index) const {
  resolve_adam_group(as_adam_like(defaults_), group, index, "adamw");
}

std::vector<std::string> AdamW::buffer_names(const ParamGroup&) const {
  return {"exp_avg", "exp_avg_sq"};
}

void AdamW::update(const ParamGroup& group, ParamState& state, const Tensor& grad) {
  adam_update(group, state.step, state.param, state.buffers, grad, /*decoupled=*/true,
              grad_scale());
}

}  // namespace acc::optim
