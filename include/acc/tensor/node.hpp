#pragma once
// The autograd graph's data structures: a Node is the backward of one op, and its edges point at
// the Nodes that produced the op's inputs. Ops record Nodes through record_op(); the engine that
// walks them (Tensor::backward) lives in acc::autograd.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc {

/// Grad mode is per thread; NoGradGuard turns it off for a scope (e.g. optimizer steps, eval).
class GradMode {
 public:
  static bool is_enabled();
  static void set_enabled(bool enabled);
};

class NoGradGuard {
 public:
  NoGradGuard() : prev_(GradMode::is_enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

/// Sets grad mode to `enabled` for a scope (e.g. recomputation inside a backward).
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : prev_(GradMode::is_enabled()) {
    GradMode::set_enabled(enabled);
  }
  ~GradModeGuard() { GradMode::set_enabled(prev_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool prev_;
};

namespace autograd {

class Node;

/// Input `input_nr` of `fn`. An edge without fn means "no gradient needed here".
struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

class Node {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// Gradients of the forward op's outputs (one per output; undefined means zero) to gradients of
  /// its inputs (one per next edge; undefined where no gradient flows).
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) = 0;
  virtual std::string name() const = 0;
  /// Frees what the backward captured (called after apply when the graph is not retained).
  virtual void release() {}

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  std::vector<Edge>& mutable_next_edges() { return next_edges_; }
  uint32_t num_outputs() const { return num_outputs_; }
  void set_num_outputs(uint32_t n) { num_outputs_ = n; }
  /// Creation order: the engine runs later nodes first, so backward is deterministic.
  uint64_t sequence_nr() const { return sequence_nr_; }

  /// fn(grad_outputs) runs before apply with the summed gradients of this node's outputs (used by
  /// retain_grad on non-leaf tensors).
  using PreHook = std::function<void(const std::vector<Tensor>&)>;
  void add_pre_hook(PreHook fn) { pre_hooks_.push_back(std::move(fn)); }
  const std::vector<PreHook>& pre_hooks() const { return pre_hooks_; }

  /// Module scope of the forward op (recorded only while an OpObserver is installed).
  const std::string& scope() const { return scope_; }
  void set_scope(std::string scope) { scope_ = std::move(scope); }

 private:
  std::string scope_;
  std::vector<PreHook> pre_hooks_;
  std::vector<Edge> next_edges_;
  uint32_t num_outputs_ = 1;
  uint64_t sequence_nr_;
};

/// Gradient of an op's inputs from its outputs' gradients. `needs[i]` says whether input i needs a
/// gradient; entries of the result where it does not may be left undefined.
using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& grad_outputs,
                                                     const std::vector<bool>& needs)>;

/// A Node whose backward is a closure that captures only what it needs.
class FunctionNode : public Node {
 public:
  FunctionNode(std::string name, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  /// Throws acc::ValueError when called again after release() (backward through a freed graph).
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) override;
  std::string name() const override { return name_; }
  void release() override { fn_ = nullptr; }
  /// Shapes and options of the forward outputs, used to stand in zeros for missing gradients.
  void add_output(const Shape& shape, TensorOptions options) {
    output_shapes_.push_back(shape);
    output_options_.push_back(options);
  }

 private:
  std::string name_;
  BackwardFn fn_;
  std::vector<Shape> output_shapes_;
  std::vector<TensorOptions> output_options_;
};

/// The sink of a leaf: adds the incoming gradient into the leaf's grad and runs its hooks.
class AccumulateGrad : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) override;
  std::string name() const override { return "AccumulateGrad"; }
  Tensor leaf() const { return Tensor(leaf_); }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

/// The edge a gradient for `t` should flow into: its grad_fn, its leaf accumulator, or none.
Edge gradient_edge(const Tensor& t);

/// True when grad mode is on and any input requires grad.
bool any_requires_grad(const std::vector<Tensor>& inputs);

/// Records an op for autograd when any input requires grad (and grad mode is on): creates a
/// FunctionNode whose edges point at the inputs and makes it the grad_fn of every output.
/// Returns false (and records nothing) otherwise.
bool record_op(const std::string& name, const std::vector<Tensor>& inputs,
               const std::vector<Tensor>& outputs, BackwardFn backward);

}  // namespace autograd
}  // namespace acc
