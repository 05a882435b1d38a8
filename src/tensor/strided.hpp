#pragma once
// Iteration over K strided operands of one logical shape, row by row: the innermost dimension is
// a contiguous loop the compiler can vectorise, the outer ones an odometer. Dimensions that are
// laid out back to back in every operand are merged first, so contiguous tensors become one row.

#include <array>
#include <cstdint>

#include "acc/tensor/tensor.hpp"
#include "acc/tensor/threading.hpp"

namespace acc::detail {

template <size_t K>
struct RowLoop {
  Shape shape;                   // coalesced
  std::array<Shape, K> strides;  // in elements, coalesced
};

template <size_t K>
RowLoop<K> coalesce(const Shape& shape, const std::array<Shape, K>& strides) {
  RowLoop<K> r;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;  // size-1 dims carry no stride information
    bool merge = !r.shape.empty();
    if (merge) {
      for (size_t k = 0; k < K; ++k) {
        if (r.strides[k].back() != strides[k][d] * shape[d]) merge = false;
      }
    }
    if (merge) {
      r.shape.back() *= shape[d];
      for (size_t k = 0; k < K; ++k) r.strides[k].back() = strides[k][d];
    } else {
      r.shape.push_back(shape[d]);
      for (size_t k = 0; k < K; ++k) r.strides[k].push_back(strides[k][d]);
    }
  }
  if (r.shape.empty()) {
    r.shape.push_back(1);
    for (size_t k = 0; k < K; ++k) r.strides[k].push_back(1);
  }
  return r;
}

/// fn(offsets, n, inner_strides): one call per row, offsets in elements from each operand's base.
template <size_t K, class F>
void for_each_row(const Shape& shape, const std::array<Shape, K>& strides, F&& fn) {
  if (numel_of(shape) == 0) return;
  RowLoop<K> r = coalesce<K>(shape, strides);
  const int64_t nd = static_cast<int64_t>(r.shape.size());
  const int64_t inner = r.shape.back();
  std::array<int64_t, K> inner_strides;
  for (size_t k = 0; k < K; ++k) inner_strides[k] = r.strides[k].back();
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < nd; ++d) rows *= r.shape[d];
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(inner, 1));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    // Unravel `begin` into the outer index, then step an odometer.
    std::array<int64_t, 16> idx{};
    std::array<int64_t, K> off{};
    int64_t rem = begin;
    for (int64_t d = nd - 2; d >= 0; --d) {
      idx[d] = rem % r.shape[d];
      rem /= r.shape[d];
      for (size_t k = 0; k < K; ++k) off[k] += idx[d] * r.strides[k][d];
    }
    for (int64_t row = begin; row < end; ++row) {
      fn(off, inner, inner_strides);
      for (int64_t d = nd - 2; d >= 0; --d) {
        ++idx[d];
        for (size_t k = 0; k < K; ++k) off[k] += r.strides[k][d];
        if (idx[d] < r.shape[d]) break;
        for (size_t k = 0; k < K; ++k) off[k] -= idx[d] * r.strides[k][d];
        idx[d] = 0;
      }
    }
  });
}

/// Strides of `t` seen through the broadcast shape `out` (0 for broadcast dimensions).
Shape broadcast_strides(const Tensor& t, const Shape& out);

}  // namespace acc::detail
