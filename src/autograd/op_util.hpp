#pragma once
// Shared checks for the differentiable ops.

#include <initializer_list>

#include "acc/tensor/tensor.hpp"
#include "acc/util/error.hpp"

namespace acc::detail {

inline void check_f32(const Tensor& t, const char* op, const char* arg) {
  ACC_CHECK(t.defined(), op, ": ", arg, " is undefined");
  ACC_CHECK_TYPE(t.dtype() == DType::kFloat32, op, ": ", arg, " must be f32, got ", t.dtype(),
                 " (cast with .to(DType::kFloat32))");
}

inline void check_index(const Tensor& t, const char* op, const char* arg) {
  ACC_CHECK(t.defined(), op, ": ", arg, " is undefined");
  ACC_CHECK_TYPE(t.dtype() == DType::kInt64 || t.dtype() == DType::kInt32, op, ": ", arg,
                 " must be i32 or i64, got ", t.dtype());
}

inline void check_same_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!first) {
      first = t;
      continue;
    }
    ACC_CHECK_TYPE(t->device() == first->device(), op, ": tensors on different devices (",
                   first->device(), " and ", t->device(), ")");
  }
}

/// The tensor to capture in a backward closure when it is an output of the op: same data, no
/// autograd history (capturing the output itself would make a reference cycle through grad_fn).
inline Tensor saved_output(const Tensor& t) {
  return t.detach();
}

}  // namespace acc::detail
