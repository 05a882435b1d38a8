#pragma once
// Activation recomputation (activation checkpointing), as torch.utils.checkpoint (reentrant):
// the forward of `fn` runs without recording a graph, so none of its intermediate activations stay
// alive; only the inputs are saved. In backward, `fn` runs again with grad on the saved inputs and
// the engine back-propagates through that fresh graph: parameters used inside `fn` receive their
// gradients (and fire their hooks) during that inner backward, and the inputs' gradients flow on.
//
// The default generator's state is saved before the forward and restored for the recomputation,
// so dropout draws the same mask both times.

#include <functional>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc {

/// fn(x) with its activations recomputed in backward. Without grad mode, or when neither x nor
/// anything inside fn requires grad, it is simply fn(x).
Tensor recompute(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x);

/// fn(inputs) with its activations recomputed in backward, for a function of several tensors (an
/// attention core's q, k, v). Each input that requires grad receives its gradient; the others are
/// saved as they are and get none. Without grad mode, or when no input requires grad, it is simply
/// fn(inputs). Throws acc::ValueError when `inputs` is empty.
Tensor recompute(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                 const std::vector<Tensor>& inputs);

}  // namespace acc
