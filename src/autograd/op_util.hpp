#pragma once
// Shared checks for the differentiable ops.

#include <cstdint>
#include <initializer_list>
#include <utility>

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

/// `t` as a matrix of rows (every dimension but the last collapsed) with unit column stride, and
/// its row stride: `t` itself when its layout allows (contiguous, or rows a fixed stride apart, as
/// in a narrowed or split tensor), else a contiguous copy.
inline std::pair<Tensor, int64_t> rows_of_matrix(const Tensor& t) {
  const int64_t nd = t.dim();
  if (nd == 0) return {t.contiguous(), 1};
  const Shape& sh = t.shape();
  const Shape& st = t.strides();
  const int64_t n = sh[nd - 1];
  if (n > 1 && st[nd - 1] != 1) return {t.contiguous(), n};
  // The row stride is the stride of the innermost leading dimension of size > 1 (size-1
  // dimensions may carry any stride); every leading dimension of size > 1 must then step over
  // exactly the rows inside it.
  int64_t ld = n;
  for (int64_t d = nd - 2; d >= 0; --d) {
    if (sh[d] > 1) {
      ld = st[d];
      break;
    }
  }
  if (ld < n) return {t.contiguous(), n};
  int64_t rows_inside = 1;
  for (int64_t d = nd - 2; d >= 0; --d) {
    if (sh[d] > 1 && st[d] != ld * rows_inside) return {t.contiguous(), n};
    rows_inside *= sh[d];
  }
  return {t, ld};
}

}  // namespace acc::detail
