#pragma once
// The optimizer base class: parameter groups, the step loop, zero_grad, the learning rate and a
// state dict keyed by parameter name.
//
// Contracts:
//  - Everything is keyed by parameter NAME (the dotted names of Module::named_parameters()), never
//    by tensor address or position, so that optimizer state can be sharded, checkpointed and
//    reloaded into another layout.
//  - Parameters and gradients are f32 and contiguous; the update is a fused loop over the flat
//    buffer (parallel over chunks with acc::parallel_for), so results do not depend on the number
//    of threads.
//  - Per-parameter state (step count and buffers) is allocated when the optimizer is built, so the
//    key set of state_dict() is the same before and after the first step. A parameter whose
//    grad() is undefined is skipped by step(), and its step count does not advance (as in
//    PyTorch, where Adam's bias correction is per parameter).
//  - Hyper-parameters (lr, betas, ...) are configuration, not state: they are not in state_dict()
//    and load_state_dict() does not change them (PyTorch restores them; here the Options the
//    optimizer was built with and the LR schedule own them). Read them with param_groups().

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc::optim {

/// (dotted name, parameter) pairs, the output of Module::named_parameters().
using NamedParams = std::vector<std::pair<std::string, Tensor>>;

/// Flat, ordered (key, tensor) pairs, ready to be written to a safetensors file. Keys are
/// `state.<param name>.<field>`: `step` (i64, 0-d) for every optimizer, plus the optimizer's
/// buffers (f32, the parameter's shape): `momentum_buffer` (SGD with momentum != 0), `exp_avg` and
/// `exp_avg_sq` (Adam, AdamW).
using StateDict = std::vector<std::pair<std::string, Tensor>>;

/// A set of parameters with hyper-parameters that override the optimizer's defaults, as in a
/// PyTorch param group. Unset fields take the optimizer's Options; setting a field the optimizer
/// does not have (betas on SGD, momentum on Adam) is an error. Optimizer::param_groups() returns
/// the groups with every field the optimizer uses filled in.
struct ParamGroup {
  NamedParams params = {};
  std::optional<double> lr = std::nullopt;
  std::optional<double> weight_decay = std::nullopt;
  std::optional<double> momentum = std::nullopt;                  // SGD
  std::optional<double> dampening = std::nullopt;                 // SGD
  std::optional<bool> nesterov = std::nullopt;                    // SGD
  std::optional<std::pair<double, double>> betas = std::nullopt;  // Adam, AdamW
  std::optional<double> eps = std::nullopt;                       // Adam, AdamW
};

class Optimizer;

/// Splits parameters into groups; used by the factories to give groups different options. It is
/// called with whole parameters (their real shapes), never with shards.
using ParamGrouping = std::function<std::vector<ParamGroup>(NamedParams)>;

/// Builds an optimizer over the parameters a strategy wants optimised on this rank. Made by
/// SGD/Adam/AdamW::factory, optionally with a ParamGrouping.
///
/// A sharded strategy (zero1, zero2, fsdp) hands each rank flat 1-D pieces of the parameters, on
/// which a grouping rule such as "dim >= 2 decays" would be wrong. So the grouping is kept apart
/// from the build: the strategy calls group() on the whole parameters, swaps each group's
/// parameters for this rank's pieces of them (same names, same options) and calls build().
/// operator() is group() then build(), for one process.
class OptimizerFactory {
 public:
  using Build = std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>)>;
  OptimizerFactory() = default;
  /// `grouping` may be empty: every parameter in one group with the optimizer's defaults.
  OptimizerFactory(Build build, ParamGrouping grouping);
  /// A factory of one's own from parameters to optimizer. Its grouping is opaque: a sharded
  /// strategy calls it with this rank's pieces (1-D), so it must not group by shape.
  OptimizerFactory(std::function<std::unique_ptr<Optimizer>(NamedParams)> from_params);

  explicit operator bool() const { return static_cast<bool>(build_) || static_cast<bool>(opaque_); }
  /// group() then build().
  std::unique_ptr<Optimizer> operator()(NamedParams params) const;
  /// The groups of whole parameters (one group when there is no grouping). Throws acc::ValueError
  /// for an opaque factory (has_grouping() is false there).
  std::vector<ParamGroup> group(NamedParams params) const;
  /// Builds over groups decided by group(), their parameters possibly replaced by pieces.
  std::unique_ptr<Optimizer> build(std::vector<ParamGroup> groups) const;
  /// False for a factory made from a plain function of the parameters.
  bool has_grouping() const { return static_cast<bool>(build_); }

 private:
  Build build_;
  ParamGrouping grouping_;
  std::function<std::unique_ptr<Optimizer>(NamedParams)> opaque_;
};

/// The most parameter-sized buffers the optimizers `factory` builds keep per parameter, over its
/// groups: what a memory model charges as optimizer state (2 for Adam/AdamW, 1 for SGD with
/// momentum, 0 for plain SGD). Found by building the optimizer over two probe parameters, a
/// matrix ("probe.weight", 2 x 2) and a vector ("probe.bias", 2), so a grouping by dimension
/// sees both kinds. Throws what the factory throws, naming nothing of the user's model.
int optimizer_state_buffers(const OptimizerFactory& factory);

/// The GPT convention (nanoGPT, Megatron): parameters with dim >= 2 (matmul weights, embeddings)
/// get the optimizer's weight decay, the others (biases, norm gains) get weight_decay = 0. Empty
/// groups are dropped.
ParamGrouping decay_matrices_only();

class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// "sgd", "adam" or "adamw"; used in messages.
  virtual std::string name() const = 0;

  /// One update of every parameter that has a gradient, under acc::NoGradGuard. All gradients are
  /// checked before any parameter changes: throws acc::TypeError when a gradient is not f32 or is
  /// on another device, acc::ShapeError when its shape differs from the parameter's and
  /// acc::ValueError when it is not contiguous, naming the parameter. Meta parameters only advance
  /// their step count.
  void step();

  /// As step(), with every gradient multiplied by float(grad_scale) inside the update; the
  /// gradients themselves are left unchanged. With grad_scale = clip_coefficient(max_norm, norm)
  /// (acc/optim/clip_grad.hpp) it computes exactly (bitwise) the update of clip_grads_with_norm_
  /// followed by step(), without the pass that scales the gradients in memory. Throws as step(),
  /// and acc::ValueError when grad_scale is negative or NaN.
  void step_scaled(double grad_scale);

  /// Clears the gradients: grad() becomes undefined (set_to_none, the PyTorch default) or is
  /// filled with zeros in place.
  void zero_grad(bool set_to_none = true);

  /// Learning rate of the first param group.
  double lr() const;
  /// Sets the learning rate of every param group (what a schedule does each step). Throws
  /// acc::ValueError unless lr >= 0.
  void set_lr(double lr);
  /// Sets the learning rate of one group. Throws acc::ValueError on a bad index or unless lr >= 0.
  void set_group_lr(size_t group, double lr);

  /// Adds a group, resolved against the optimizer's defaults and with fresh state. Throws
  /// acc::ValueError on a bad option, an empty or repeated name (also across groups), the same
  /// tensor under two names, a non-leaf or non-contiguous parameter, and acc::TypeError on a
  /// non-f32 parameter, naming the parameter. The optimizer is unchanged when it throws.
  void add_param_group(ParamGroup group);

  /// The groups with every option the optimizer uses filled in.
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  /// Parameter names in group order.
  std::vector<std::string> param_names() const;
  /// (name, parameter) pairs in group order.
  NamedParams named_parameters() const;
  /// Parameter-sized f32 buffers this optimizer keeps per parameter of group `group` (AdamW's
  /// exp_avg and exp_avg_sq: 2; SGD with momentum: 1; plain SGD: 0). Throws acc::ValueError for a
  /// bad index.
  size_t buffers_per_parameter(size_t group) const;
  /// How many steps have updated this parameter. Throws acc::ValueError for an unknown name.
  int64_t param_step(const std::string& name) const;

  /// The per-parameter state, keyed `state.<param name>.<field>` (see StateDict), in parameter
  /// order. Step counts are fresh 0-d i64 tensors; buffer entries alias the optimizer's live state
  /// (as in PyTorch): clone them before the next step() to keep a snapshot.
  StateDict state_dict() const;
  /// Copies state saved by state_dict() into this optimizer. The key set must match exactly; every
  /// entry is checked before anything is copied, so a failed load changes nothing. Throws
  /// acc::ValueError on an unknown parameter name, an unknown field, a missing or repeated key or
  /// a negative step count, acc::ShapeError when a buffer's shape differs from the parameter's
  /// (naming the parameter and both shapes), and acc::TypeError when a buffer is not an f32 tensor
  /// on the parameter's device or a step count is not an integer scalar.
  void load_state_dict(const StateDict& state);

 protected:
  Optimizer() = default;

  /// State of one parameter. `buffers` follow buffer_names() of its group.
  struct ParamState {
    std::string name;
    Tensor param;
    size_t group = 0;
    int64_t step = 0;
    std::vector<Tensor> buffers;
  };

  /// Fills the unset options of `group` from the optimizer's defaults and validates them; throws
  /// acc::ValueError naming the group index, the option and its value.
  virtual void resolve_group(ParamGroup& group, size_t index) const = 0;
  /// Names of the per-parameter buffers (f32, the parameter's shape, zero-initialised) kept for
  /// parameters of `group`.
  virtual std::vector<std::string> buffer_names(const ParamGroup& group) const = 0;
  /// Updates one parameter from `grad` (f32, contiguous, checked) multiplied by grad_scale() (the
  /// multiplication comes first, as if the gradient had been scaled in memory). `state.step` has
  /// already been incremented for this step.
  virtual void update(const ParamGroup& group, ParamState& state, const Tensor& grad) = 0;
  /// The factor of the step being taken: 1 in step(), grad_scale in step_scaled().
  float grad_scale() const { return grad_scale_; }

  /// Adds every group; derived constructors call it once their defaults are set. Throws as
  /// add_param_group, and acc::ValueError when there are no parameters at all.
  void init(std::vector<ParamGroup> groups);

 private:
  std::vector<ParamGroup> groups_;
  std::vector<ParamState> states_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in states_
  std::vector<std::vector<std::string>> fields_;   // buffer_names() of each group
  float grad_scale_ = 1.f;
};

}  // namespace acc::optim
