#pragma once
// Block wrappers that can be taken off again: activation recomputation, and the generic
// forward wrapper strategies such as amp install. One code path for the `checkpoint` strategy
// method and for the tracer's recompute option, so the memory the trace predicts is the memory the
// method saves.

#include <functional>
#include <string>
#include <vector>

#include "acc/nn/module.hpp"

namespace acc::nn {

/// Restores what a wrap_* call changed when called (once; later calls do nothing). Undo in the
/// reverse order of wrapping: a wrapper installed later holds the one before it.
using Unwrap = std::function<void()>;

/// Wraps the forward of every module in `modules` with `outer`, which receives the previous
/// wrapper's call (or the plain forward) as its `fwd`. Returns the undo, which puts the previous
/// wrappers back.
Unwrap wrap_forward(const std::vector<ModulePtr>& modules, const Module::ForwardWrapper& outer);

/// Recomputes the activations of `blocks` (dotted paths under `root`) in backward
/// (acc::checkpoint around each block's forward). Throws acc::ValueError naming a path that is not
/// a submodule of `root`.
Unwrap recompute_blocks(Module& root, const std::vector<std::string>& blocks);

}  // namespace acc::nn
