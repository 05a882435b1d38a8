#pragma once
// Timing one calibration point.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "acc/util/timer.hpp"

namespace acc::search::detail {

/// Seconds per call of `call`: one warm-up call (caches, page mappings, the BLAS's buffers), then
/// calls until `seconds_per_point` has passed (at least one, at most 10000 samples); the median of
/// those. Calls under 100 us (judged by the first timed one) are timed in groups of up to 1000, so
/// that the clock's resolution and overhead stay far below what is measured.
template <class F>
double median_seconds(F&& call, double seconds_per_point) {
  call();
  std::vector<double> times;
  Timer total;
  int64_t group = 1;
  while (times.empty() || (total.elapsed_s() < seconds_per_point && times.size() < 10000)) {
    Timer t;
    for (int64_t i = 0; i < group; ++i) call();
    const double s = t.elapsed_s();
    times.push_back(s / static_cast<double>(group));
    if (times.size() == 1) {
      group = std::clamp<int64_t>(static_cast<int64_t>(1e-4 / std::max(s, 1e-9)), 1, 1000);
    }
  }
  std::sort(times.begin(), times.end());
  const size_t n = times.size();
  return n % 2 == 1 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
}

}  // namespace acc::search::detail
