#pragma once
// Activation recomputation (activation checkpointing), as torch.utils.checkpoint (reentrant):
// the forward of `fn` runs without recording a graph, so none of its intermediate activations stay
// alive; only the input is saved. In backward, `fn` runs again with grad on the saved input and
// the engine back-propagates through that fresh graph: parameters used inside `fn` receive their
// gradients (and fire their hooks) during that inner backward, and the input's gradient flows on.
//
// The default generator's state is saved before the forward and restored for the recomputation,
// so dropout draws the same mask both times.

#include <functional>

#include "acc/tensor/tensor.hpp"

namespace acc {

/// fn(x) with its activations recomputed in backward. Without grad mode, or when neither x nor
/// anything inside fn requires grad, it is simply fn(x).
Tensor recompute(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x);

}  // namespace acc
