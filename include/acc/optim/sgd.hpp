#pragma once
// Stochastic gradient descent with momentum, torch.optim.SGD semantics:
//   d = g + weight_decay * p
//   buf = d (first step)  or  buf = momentum * buf + (1 - dampening) * d
//   d = d + momentum * buf (nesterov)  or  d = buf
//   p = p - lr * d

#include <memory>
#include <string>
#include <vector>

#include "acc/optim/optimizer.hpp"

namespace acc::optim {

/// Defaults for every SGD param group; usable with designated initialisers:
/// `SGD::Options{.lr = 0.1, .momentum = 0.9}`.
struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD final : public Optimizer {
 public:
  using Options = SGDOptions;

  /// Throws acc::ValueError unless lr, momentum and weight_decay are >= 0 and dampening is in
  /// [0, 1], and when nesterov is set without momentum > 0 and dampening == 0 (per group, naming
  /// the value); otherwise throws as Optimizer::add_param_group.
  explicit SGD(NamedParams params, Options options = {});
  /// One group per entry; unset group options come from `defaults`. Throws as above.
  SGD(std::vector<ParamGroup> groups, Options defaults = {});

  /// A factory that builds SGD(params, options); the options are validated now (acc::ValueError).
  static OptimizerFactory factory(Options options = {});
  /// A factory that builds SGD(grouping(params), options).
  static OptimizerFactory factory(Options options, ParamGrouping grouping);

  std::string name() const override { return "sgd"; }
  const Options& defaults() const { return defaults_; }

 protected:
  void resolve_group(ParamGroup& group, size_t index) const override;
  std::vector<std::string> buffer_names(const ParamGroup& group) const override;
  void update(const ParamGroup& group, ParamState& state, const Tensor& grad) override;

 private:
  Options defaults_;
};

}  // namespace acc::optim
