#pragma once
// Block wrappers that can be taken off again: activation recomputation, bf16 activations, and
// the generic forward wrapper they are built on. One code path for the `checkpoint` and `amp`
// strategy methods and for the tracer's options, so the memory the trace predicts is the memory
// the methods save.

#include <functional>
#include <string>
#include <vector>

#include "acc/nn/module.hpp"

namespace acc::nn {

/// Wraps the forward of every module in `modules` with `outer`, which receives the previous
/// wrapper's call (or the plain forward) as its `fwd`. Returns the undo (nn::Undo, module.hpp),
/// which puts the previous wrappers back; undo in the reverse order of wrapping, since a wrapper
/// installed later holds the one before it.
Undo wrap_forward(const std::vector<ModulePtr>& modules, const Module::ForwardWrapper& outer);

/// Recomputes the activations of `blocks` (dotted paths under `root`) in backward
/// (acc::checkpoint around each block's forward). Throws acc::ValueError naming a path that is not
/// a submodule of `root`.
Undo recompute_blocks(Module& root, const std::vector<std::string>& blocks);

/// Selective recomputation (Korthikanti et al. 2022): inside each of `blocks` (dotted paths under
/// `root`), every attention core (CausalSelfAttention, LlamaAttention: softmax(QK^T)V) keeps only
/// its q, k, v during forward and runs again in backward (acc::recompute over the three); the
/// projections, norms and MLP keep their activations. Throws acc::ValueError naming a path that is
/// not a submodule of `root`, or naming the first block without an attention core.
Undo recompute_attention_cores(Module& root, const std::vector<std::string>& blocks);

/// amp's blocks: inside each of `blocks` the activations saved for backward are kept in bf16
/// (autograd::SaveActivationsInBf16), and each block's output is rounded to bf16 (so is the
/// gradient flowing back into it). Throws as recompute_blocks.
Undo bf16_activation_blocks(Module& root, const std::vector<std::string>& blocks);

}  // namespace acc::nn
