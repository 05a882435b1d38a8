#pragma once
// Helpers shared by the optimizer sources: option checks and the chunk size of the fused loops.

#include <cstdint>
#include <string>

#include "acc/util/error.hpp"

namespace acc::optim::detail {

/// Elements per parallel chunk of a fused update loop (keeps small parameters on one thread).
inline constexpr int64_t kUpdateGrain = int64_t{1} << 15;

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
