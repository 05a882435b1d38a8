#pragma once
// Helpers shared by the optimizer sources: option checks and the chunk size of the fused loops.

#include <algorithm>
#include <cstdint>
#include <string>

#include "acc/util/error.hpp"

namespace acc::optim::detail {

/// Elements per parallel chunk of a fused update loop (keeps small parameters on one thread).
inline constexpr int64_t kUpdateGrain = int64_t{1} << 15;

/// Runs core(gp, begin, end, base) over [begin, end), where gp[i - base] is the gradient g[i]
/// multiplied by `scale` when Scaled. The scaled values are rounded into a stack buffer first, so
/// that the compiler cannot fuse the multiplication into a later addition (-ffp-contract): the
/// update then sees exactly the gradient that scaling it in memory would have given.
template <bool Scaled, class Core>
inline void with_scaled_grad(const float* g, float scale, int64_t begin, int64_t end, Core core) {
  if constexpr (!Scaled) {
    core(g, begin, end, int64_t{0});
  } else {
    constexpr int64_t kBlock = 1024;
    alignas(64) float buf[kBlock];
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t e = std::min(end, b + kBlock);
      for (int64_t i = b; i < e; ++i) buf[i - b] = g[i] * scale;
      core(static_cast<const float*>(buf), b, e, b);
    }
  }
}

/// Throws acc::ValueError unless value >= 0 (NaN fails).
inline void check_non_negative(const std::string& who, const char* what, double value) {
  ACC_CHECK(value >= 0.0, who, ": ", what, " must be >= 0, got ", value);
}

/// Throws acc::ValueError unless lo <= value < hi (value <= hi when hi_inclusive; NaN fails).
inline void check_range(const std::string& who, const char* what, double value, double lo,
                        double hi, bool hi_inclusive) {
  const bool ok = value >= lo && (hi_inclusive ? value <= hi : value < hi);
  ACC_CHECK(ok, who, ": ", what, " must be in [", lo, ", ", hi, hi_inclusive ? "]" : ")", ", got ",
            value);
}

}  // namespace acc::optim::detail
