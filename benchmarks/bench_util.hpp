#pragma once
// Small statistics shared by the benchmark programs.

#include <algorithm>
#include <vector>

namespace acc::bench {

/// The median of v (the mean of the two middle values for an even count); 0 for an empty v.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

}  // namespace acc::bench
