#include "acc/autograd/engine.hpp"

#include <map>
#include <queue>
#include <unordered_map>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/observer.hpp"
#include "acc/util/error.hpp"
#include "acc/util/progress.hpp"

namespace acc {
namespace autograd {
namespace {

// Per-node bookkeeping of one backward pass, keyed by the node's sequence number (unique and
// stable), never by its address.
struct NodeTask {
  std::shared_ptr<Node> node;
  int dependencies = 0;
  std::vector<Tensor> inputs;  // summed gradients of the node's forward outputs
};

thread_local int backward_depth = 0;
thread_local std::vector<std::function<void()>> end_callbacks;

// Tracks nesting (recomputation runs backward inside backward) and runs the queued callbacks
// when the outermost pass ends; they are dropped if it ends with an exception.
class BackwardScope {
 public:
  BackwardScope() { ++backward_depth; }
  ~BackwardScope() {
    if (--backward_depth == 0) end_callbacks.clear();
  }
  void finish() {
    if (backward_depth != 1) return;
    // Callbacks may queue further callbacks.
    for (size_t i = 0; i < end_callbacks.size(); ++i) {
      auto fn = std::move(end_callbacks[i]);
      fn();
    }
    end_callbacks.clear();
  }
};

// True when only `slot` can see its memory: no other Tensor shares its impl, no view or saved
// tensor shares its storage. (A backward function that hands one tensor to two inputs, as add's
// does, keeps a second reference until both are accumulated.)
bool owns_its_memory(const Tensor& slot) {
  return slot.impl_ptr().use_count() == 1 && slot.storage() != nullptr &&
         slot.storage().use_count() == 1;
}

void accumulate(Tensor& slot, Tensor g) {
  if (!slot.defined()) {
    slot = std::move(g);
  } else if (owns_its_memory(slot) && !slot.is_meta() && slot.is_contiguous() &&
             g.is_contiguous() && slot.dtype() == DType::kFloat32 && g.dtype() == DType::kFloat32 &&
             slot.shape() == g.shape()) {
    // In place, as PyTorch's engine does when nobody else holds the buffer: no new tensor and
    // no write pass into fresh memory at every residual junction. slot + 1 * g is exactly the
    // out-of-place sum.
    kernels::axpy(slot.numel(), 1.f, g.data<float>(), slot.data<float>());
  } else {
    slot = kernels::binary(kernels::BinaryOp::kAdd, slot, g);
  }
}

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              bool retain_graph) {
  ACC_CHECK(roots.size() == grads.size(), "backward: ", roots.size(), " roots but ", grads.size(),
            " gradients");
  NoGradGuard no_grad;
  BackwardScope scope;
  std::unordered_map<uint64_t, NodeTask> tasks;

  // Count, for every node reachable from the roots, how many edges lead into it.
  std::vector<std::shared_ptr<Node>> stack;
  auto visit = [&](const std::shared_ptr<Node>& n) {
    auto [it, fresh] = tasks.try_emplace(n->sequence_nr());
    if (fresh) {
      it->second.node = n;
      it->second.inputs.resize(n->num_outputs());
      stack.push_back(n);
    }
  };
  std::vector<Edge> root_edges;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    ACC_CHECK(r.defined(), "backward: root ", i, " is undefined");
    Edge e = gradient_edge(r);
    ACC_CHECK(e.valid(), "backward: tensor of shape ", r.shape(),
              " does not require grad and has no grad_fn");
    Tensor g = grads[i];
    if (!g.defined()) {
      ACC_CHECK(r.numel() == 1, "backward: grad can be implicitly created only for a ",
                "one-element tensor, got shape ", r.shape());
      g = ones_like(r);
    } else {
      ACC_CHECK_SHAPE(g.shape() == r.shape(), "backward: gradient shape ", g.shape(),
                      " does not match root shape ", r.shape());
    }
    visit(e.fn);
    root_edges.push_back(e);
    accumulate(tasks[e.fn->sequence_nr()].inputs[e.input_nr], g);
  }
  while (!stack.empty()) {
    auto n = std::move(stack.back());
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.valid()) continue;
      visit(e.fn);
      tasks[e.fn->sequence_nr()].dependencies++;
    }
  }

  // Run ready nodes, a leaf's accumulator first, then latest-created first. An accumulator lives
  // as long as a graph that reads its leaf: a pipeline stage's next forward reuses the one the
  // forward before made, so by creation order it would wait for the whole backward, and every
  // leaf's incoming gradient with it (a stage's gradients twice over at the end of a backward
  // that accumulates). As PyTorch's engine, it runs as soon as its gradient is complete; each
  // leaf's gradient is summed in the same order either way, so the results are bitwise the same.
  using Ready = std::pair<bool, uint64_t>;  // (an accumulator, sequence number)
  std::priority_queue<Ready> ready;
  auto push_ready = [&](const std::shared_ptr<Node>& n) {
    ready.emplace(dynamic_cast<const AccumulateGrad*>(n.get()) != nullptr, n->sequence_nr());
  };
  for (const Edge& e : root_edges) {
    if (tasks[e.fn->sequence_nr()].dependencies == 0) push_ready(e.fn);
  }
  uint64_t last = UINT64_MAX;
  while (!ready.empty()) {
    const uint64_t id = ready.top().second;
    ready.pop();
    if (id == last) continue;  // the same root listed twice
    last = id;
    NodeTask& task = tasks[id];
    std::shared_ptr<Node> node = task.node;
    std::vector<Tensor> in = std::move(task.inputs);
    bool any = false;
    for (const Tensor& t : in) any = any || t.defined();
    std::vector<Tensor> out;
    if (any) {
      for (const auto& hook : node->pre_hooks()) hook(in);
      detail::OpObserver* obs = detail::op_observer();
      if (obs) {
        // Ops the node runs internally (copies, reshapes) belong to the node's module scope.
        obs->on_backward_begin(in);
        detail::push_scope(node->scope());
        out = node->apply(std::move(in));
        detail::pop_scope();
        obs->on_op(node->name(), node->scope(), {}, out, true);
      } else {
        progress::module(node->scope());  // the hang detector's "in backward of <module>"
        out = node->apply(std::move(in));
      }
    }
    if (!retain_graph) node->release();
    const auto& edges = node->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid()) continue;
      NodeTask& next = tasks[e.fn->sequence_nr()];
      if (i < out.size() && out[i].defined()) accumulate(next.inputs[e.input_nr], out[i]);
      if (--next.dependencies == 0) push_ready(e.fn);
    }
  }
  scope.finish();
}

void queue_callback(std::function<void()> fn) {
  ACC_CHECK(backward_depth > 0, "queue_callback: no backward pass is running");
  end_callbacks.push_back(std::move(fn));
}

bool in_backward() {
  return backward_depth > 0;
}

}  // namespace autograd

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  autograd::backward({*this}, {grad}, retain_graph);
}

}  // namespace acc
