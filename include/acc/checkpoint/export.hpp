#pragma once
// A checkpoint's weights, whole, as a safetensors file.

#include <cstddef>
#include <string>

namespace acc::ckpt {

/// Writes every parameter of the checkpoint in `step_dir`, whole, to a safetensors file at `out`
/// (PyTorch's safetensors loads it; train_gpt --init-from takes it), with the step and, when the
/// checkpoint's extra has them, model_type and config in its metadata. Returns the number of
/// tensors. Throws acc::IoError before reading anything when `out` lies inside a checkpoint
/// (check_outside_checkpoints: its own input included), and what read_metadata, load and
/// io::save_safetensors (temporary file, fsync, rename) throw.
size_t export_safetensors(const std::string& step_dir, const std::string& out);

}  // namespace acc::ckpt
