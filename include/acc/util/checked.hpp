#pragma once
// Overflow-checked size arithmetic: element counts, bytes, FLOPs, and the estimates built from
// them. A product or sum that does not fit in int64_t is an error naming what was computed and
// its operands, never a wrapped (negative or small) number that a memory or cost estimate would
// then trust.
//
// Sizes stay int64_t (as PyTorch's): exact, signed so that a difference (a memory event that
// frees) is representable, and 9.2e18 is beyond any machine's bytes and any single micro-batch
// step's FLOPs, so a value that does not fit is an input error, not a limit worth a wider type.

#include <cstdint>
#include <initializer_list>
#include <string>

#include "acc/util/error.hpp"

namespace acc {

/// a * b. Throws Exc (acc::ValueError unless named) "<what...>: a * b overflows 64 bits".
template <class Exc = ValueError, class What, class... More>
int64_t checked_mul(int64_t a, int64_t b, const What& what, const More&... more) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) [[unlikely]] {
    throw Exc(detail::str_cat(what, more..., ": ", a, " * ", b, " overflows 64 bits"));
  }
  return r;
}

/// a + b. Throws Exc (acc::ValueError unless named) "<what...>: a + b overflows 64 bits".
template <class Exc = ValueError, class What, class... More>
int64_t checked_add(int64_t a, int64_t b, const What& what, const More&... more) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) [[unlikely]] {
    throw Exc(detail::str_cat(what, more..., ": ", a, " + ", b, " overflows 64 bits"));
  }
  return r;
}

/// The product of `factors` (1 when empty). Throws Exc (acc::ValueError unless named)
/// "<what...>: the product of [f0, f1, ...] overflows 64 bits", listing every factor.
template <class Exc = ValueError, class What, class... More>
int64_t checked_product(std::initializer_list<int64_t> factors, const What& what,
                        const More&... more) {
  int64_t r = 1;
  bool overflow = false;
  for (int64_t f : factors) overflow = overflow || __builtin_mul_overflow(r, f, &r);
  if (overflow) [[unlikely]] {
    std::string list;
    for (int64_t f : factors) list += (list.empty() ? "" : ", ") + std::to_string(f);
    throw Exc(detail::str_cat(what, more..., ": the product of [", list, "] overflows 64 bits"));
  }
  return r;
}

}  // namespace acc
