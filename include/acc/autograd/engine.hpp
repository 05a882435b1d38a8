#pragma once
// The backward engine. Tensor::backward(grad, retain_graph) calls backward({t}, {grad}, ...).

#include <functional>
#include <vector>

#include "acc/tensor/node.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::autograd {

/// Runs backward from `roots` with the given output gradients (an undefined entry means 1 for a
/// one-element root). Nodes run in reverse creation order; each node runs once, with the sum of
/// every gradient that reaches it, and each leaf's post-accumulate-grad hooks fire once its
/// gradient is complete. Without retain_graph the captured tensors are freed as nodes finish, and
/// a second backward through them throws acc::ValueError.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
              bool retain_graph = false);

/// Runs `fn` once the outermost backward pass running in this thread has finished all its nodes
/// (before backward() returns), in the order queued: what a data-parallel reducer uses to wait for
/// its last reductions. Throws acc::ValueError outside a backward pass.
void queue_callback(std::function<void()> fn);
/// True while a backward pass runs in this thread.
bool in_backward();

}  // namespace acc::autograd
