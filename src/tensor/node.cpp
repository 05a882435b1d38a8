#include "acc/tensor/node.hpp"

#include "acc/tensor/observer.hpp"
#include "acc/util/error.hpp"
#include "acc/util/progress.hpp"

namespace acc {
namespace {
thread_local bool grad_mode_enabled = true;
std::atomic<uint64_t> next_sequence_nr{0};
}  // namespace

bool GradMode::is_enabled() {
  return grad_mode_enabled;
}
void GradMode::set_enabled(bool enabled) {
  grad_mode_enabled = enabled;
}

namespace autograd {

Node::Node() : sequence_nr_(next_sequence_nr.fetch_add(1)) {}

std::vector<Tensor> FunctionNode::apply(std::vector<Tensor>&& grad_outputs) {
  ACC_CHECK(fn_ != nullptr, "trying to backward through the graph a second time (", name_,
            " was freed after the first backward); pass retain_graph=true to the first backward");
  for (size_t i = 0; i < grad_outputs.size() && i < output_shapes_.size(); ++i) {
    if (!grad_outputs[i].defined()) grad_outputs[i] = zeros(output_shapes_[i], output_options_[i]);
  }
  std::vector<bool> needs(next_edges().size());
  for (size_t i = 0; i < needs.size(); ++i) needs[i] = next_edges()[i].valid();
  std::vector<Tensor> grads = fn_(grad_outputs, needs);
  ACC_CHECK_INTERNAL(grads.size() == needs.size(), name_, " returned ", grads.size(),
                     " gradients for ", needs.size(), " inputs");
  return grads;
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grad_outputs) {
  Tensor g = std::move(grad_outputs.at(0));
  if (!g.defined()) return {};
  Tensor leaf(leaf_);
  ACC_CHECK_SHAPE(g.shape() == leaf.shape(), "gradient of shape ", g.shape(),
                  " for a leaf of shape ", leaf.shape());
  if (g.dtype() != leaf.dtype()) g = g.to(leaf.dtype());
  AutogradMeta& meta = leaf.autograd_meta();
  for (auto& [id, hook] : meta.grad_hooks) {
    Tensor h = hook(g);
    if (!h.defined()) continue;
    ACC_CHECK_SHAPE(h.shape() == leaf.shape(), "a gradient hook returned shape ", h.shape(),
                    " for a leaf of shape ", leaf.shape());
    g = h.dtype() != leaf.dtype() ? h.to(leaf.dtype()) : std::move(h);
  }
  if (!meta.grad) {
    // Take the incoming buffer when nobody else can see it; otherwise copy it, so that later
    // in-place accumulation never writes into another tensor's memory.
    const bool owned = g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 &&
                       g.is_contiguous() && g.offset() == 0 && g.nbytes() == g.storage()->nbytes();
    meta.grad = owned ? g.impl_ptr() : g.clone().impl_ptr();
    if (meta.grad->autograd) meta.grad->autograd.reset();
  } else {
    Tensor(meta.grad).add_(g);
  }
  for (auto& [id, hook] : meta.post_accumulate_grad_hooks) hook(leaf);
  return {};
}

namespace {
// Whether nodes remember the module they were made in: for a trace, and for the hang detector
// (the module a rank's backward was in). A copy of the scope's name per op otherwise spared.
bool scope_wanted() {
  return detail::op_observer() != nullptr || progress::detail::listening();
}
}  // namespace

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.has_autograd_meta()) return {};
  AutogradMeta& meta = t.autograd_meta();
  if (meta.grad_fn) return {meta.grad_fn, meta.output_nr};
  if (!meta.requires_grad) return {};
  auto acc = meta.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    // Traced or watched: the accumulator belongs to the module that first reads the parameter.
    if (scope_wanted()) acc->set_scope(detail::current_scope());
    meta.grad_accumulator = acc;
  }
  return {acc, 0};
}

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

namespace {
// "LinearBackward" -> "Linear": the forward op a backward node belongs to.
std::string forward_name(const std::string& backward_name) {
  const std::string suffix = "Backward";
  if (backward_name.size() > suffix.size() &&
      backward_name.compare(backward_name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return backward_name.substr(0, backward_name.size() - suffix.size());
  }
  return backward_name;
}
}  // namespace

bool record_op(const std::string& name, const std::vector<Tensor>& inputs,
               const std::vector<Tensor>& outputs, BackwardFn backward) {
  detail::OpObserver* obs = detail::op_observer();
  if (obs) obs->on_op(forward_name(name), detail::current_scope(), inputs, outputs, false);
  if (!any_requires_grad(inputs)) return false;
  auto node = std::make_shared<FunctionNode>(name, std::move(backward));
  if (scope_wanted()) node->set_scope(detail::current_scope());
  auto& edges = node->mutable_next_edges();
  edges.reserve(inputs.size());
  for (const Tensor& t : inputs) edges.push_back(gradient_edge(t));
  node->set_num_outputs(static_cast<uint32_t>(outputs.size()));
  for (uint32_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    node->add_output(out.shape(), out.options());
    AutogradMeta& meta = out.autograd_meta();
    ACC_CHECK_INTERNAL(!meta.grad_fn, name, ": output ", i, " already has a grad_fn");
    meta.grad_fn = node;
    meta.output_nr = i;
  }
  return true;
}

}  // namespace autograd
}  // namespace acc
