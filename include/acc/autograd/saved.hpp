#pragma once
// How ops keep the tensors their backward needs. Normally the tensor itself. While a
// SaveActivationsInBf16 guard is alive in the thread (amp turns one on inside every block), an f32
// activation an op keeps is stored as a bf16 copy instead, half the bytes, and turned back into
// f32 when backward reads it: the math stays f32, backward sees activations rounded to bf16 (as
// with bf16 activations on a GPU). Parameters (leaves that require grad) are always kept as they
// are. The trace sees the copies, so its memory estimate includes the saving.

#include "acc/tensor/tensor.hpp"

namespace acc::autograd {

/// RAII: activations saved for backward are kept in bf16 while alive (nests; restores the
/// previous setting).
class SaveActivationsInBf16 {
 public:
  explicit SaveActivationsInBf16(bool on = true);
  ~SaveActivationsInBf16();
  SaveActivationsInBf16(const SaveActivationsInBf16&) = delete;
  SaveActivationsInBf16& operator=(const SaveActivationsInBf16&) = delete;

 private:
  bool prev_;
};
bool saving_activations_in_bf16();

/// A tensor an op keeps for its backward.
class SavedTensor {
 public:
  SavedTensor() = default;
  /// Keeps `t`, or a bf16 copy of it when `recorded` (the op will be part of a graph), bf16 saving
  /// is on, `t` is f32 and it is not a parameter. Pass recorded = false when no backward will
  /// run, so no copy is made for nothing.
  SavedTensor(const Tensor& t, bool recorded);
  /// The tensor in f32 (a fresh contiguous f32 copy when it was stored as bf16).
  Tensor get() const;
  /// True when stored as a bf16 copy (get() is then contiguous).
  bool packed() const { return packed_; }

 private:
  Tensor data_;
  bool packed_ = false;
};

/// True when an op on `inputs` is recorded for backward (grad mode on, an input requires grad).
bool will_record(std::initializer_list<const Tensor*> inputs);

}  // namespace acc::autograd
