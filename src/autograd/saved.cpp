#include "acc/autograd/saved.hpp"

#include "acc/tensor/node.hpp"

namespace acc::autograd {
namespace {
thread_local bool save_bf16 = false;
}

SaveActivationsInBf16::SaveActivationsInBf16(bool on) : prev_(save_bf16) {
  save_bf16 = on;
}
SaveActivationsInBf16::~SaveActivationsInBf16() {
  save_bf16 = prev_;
}
bool saving_activations_in_bf16() {
  return save_bf16;
}

SavedTensor::SavedTensor(const Tensor& t, bool recorded) : data_(t) {
  if (!recorded || !save_bf16 || !t.defined() || t.dtype() != DType::kFloat32) return;
  if (t.is_leaf() && t.requires_grad()) return;  // a parameter
  NoGradGuard ng;
  data_ = t.detach().to(DType::kBFloat16);
  packed_ = true;
}

Tensor SavedTensor::get() const {
  if (!packed_) return data_;
  NoGradGuard ng;
  return data_.to(DType::kFloat32);
}

bool will_record(std::initializer_list<const Tensor*> inputs) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor* t : inputs) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

}  // namespace acc::autograd
