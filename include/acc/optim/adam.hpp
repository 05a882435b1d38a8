#pragma once
// Adam and AdamW, torch.optim.Adam / torch.optim.AdamW semantics (non-amsgrad, non-fused). With
// t the parameter's step count (from 1), bc1 = 1 - beta1^t and bc2 = 1 - beta2^t:
//   Adam:  g = g + weight_decay * p                  (L2 penalty added to the gradient)
//   AdamW: p = p * (1 - lr * weight_decay)           (decoupled weight decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
// The state of each parameter is `exp_avg` (m) and `exp_avg_sq` (v).

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "acc/optim/optimizer.hpp"

namespace acc::optim {

/// Defaults for every Adam param group: `Adam::Options{.lr = 1e-3, .betas = {0.9, 0.95}}`.
struct AdamOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;  // L2, added to the gradient
};

class Adam final : public Optimizer {
 public:
  using Options = AdamOptions;

  /// Throws acc::ValueError unless lr, eps and weight_decay are >= 0 and both betas are in [0, 1)
  /// (per group, naming the value); otherwise throws as Optimizer::add_param_group.
  explicit Adam(NamedParams params, Options options = {});
  /// One group per entry; unset group options come from `defaults`. Throws as above.
  Adam(std::vector<ParamGroup> groups, Options defaults = {});

  /// A factory that builds Adam(params, options); the options are validated now (acc::ValueError).
  static OptimizerFactory factory(Options options = {});
  /// A factory that builds Adam(grouping(params), options).
  static OptimizerFactory factory(Options options, ParamGrouping grouping);

  std::string name() const override { return "adam"; }
  const Options& defaults() const { return defaults_; }

 protected:
  void resolve_group(ParamGroup& group, size_t index) const override;
  std::vector<std::string> buffer_names(const ParamGroup& group) const override;
  void update(const ParamGroup& group, ParamState& state, const Tensor& grad) override;

 private:
  Options defaults_;
};

/// Defaults for every AdamW param group: `AdamW::Options{.lr = 3e-4, .weight_decay = 0.1}`.
struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled: p *= 1 - lr * weight_decay
};

class AdamW final : public Optimizer {
 public:
  using Options = AdamWOptions;

  /// Throws acc::ValueError unless lr, eps and weight_decay are >= 0 and both betas are in [0, 1)
  /// (per group, naming the value); otherwise throws as Optimizer::add_param_group.
  explicit AdamW(NamedParams params, Options options = {});
  /// One group per entry; unset group options come from `defaults`. Throws as above.
  AdamW(std::vector<ParamGroup> groups, Options defaults = {});

  /// A factory that builds AdamW(params, options); the options are validated now
  /// (acc::ValueError). This is what user code passes to acc::auto_accelerate.
  static OptimizerFactory factory(Options options = {});
  /// A factory that builds AdamW(grouping(params), options), e.g. with decay_matrices_only().
  static OptimizerFactory factory(Options options, ParamGrouping grouping);

  std::string name() const override { return "adamw"; }
  const Options& defaults() const { return defaults_; }

 protected:
  void resolve_group(ParamGroup& group, size_t index) const override;
  std::vector<std::string> buffer_names(const ParamGroup& group) const override;
  void update(const ParamGroup& group, ParamState& state, const Tensor& grad) override;

 private:
  Options defaults_;
};

}  // namespace acc::optim
