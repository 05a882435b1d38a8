#pragma once
// Shared checks for the differentiable ops.

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "acc/autograd/ops.hpp"
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

/// An uninitialised tensor of `shape` for a gradient that a linear's backward GEMMs read next
/// (cross-entropy's). When its rows are a multiple of 4 KiB (last dimension a multiple of 1024
/// floats, e.g. 8192-wide logits) and there are many of them, and gemm_gradient_padding() is on,
/// the rows are padded by 64 bytes: OpenBLAS packs the weight-gradient GEMM's dy by walking down
/// its columns, and with a power-of-two row stride every row maps onto the same cache sets (a
/// one-off timing of dw = dy^T x for the 17M GPT's LM head, pinned to one core: 6% faster). The
/// result is a view (strides (..., N + 16, 1)) of a larger buffer; rows_of_matrix() hands it to a
/// GEMM without a copy, and any op that needs a contiguous tensor copies it as usual.
inline Tensor empty_gemm_gradient(const Shape& shape, const TensorOptions& options) {
  constexpr int64_t kPad = 16, kMinRows = 64;
  const int64_t n = shape.empty() ? 1 : shape.back();
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
  if (!gemm_gradient_padding() || shape.size() < 2 || n == 0 || n % 1024 != 0 || rows < kMinRows)
    return empty(shape, options);
  return empty({rows, n + kPad}, options).narrow(1, 0, n).view(shape);
}

/// `t` as a matrix of rows (every dimension but the last collapsed) with unit column stride, and
/// its row stride: `t` itself when its layout allows (contiguous, or rows padded as
/// empty_gemm_gradient pads them), else a contiguous copy.
inline std::pair<Tensor, int64_t> rows_of_matrix(const Tensor& t) {
  const int64_t nd = t.dim();
  if (nd == 0) return {t.contiguous(), 1};
  const Shape& sh = t.shape();
  const Shape& st = t.strides();
  const int64_t n = sh[nd - 1];
  bool ok = nd == 1 ? st[0] == 1 || n <= 1 : (st[nd - 1] == 1 || n <= 1) && st[nd - 2] >= n;
  for (int64_t d = 0; ok && d + 2 < nd; ++d) ok = sh[d] <= 1 || st[d] == st[d + 1] * sh[d + 1];
  if (!ok) return {t.contiguous(), n};
  return {t, nd == 1 ? n : st[nd - 2]};
}

}  // namespace acc::detail
