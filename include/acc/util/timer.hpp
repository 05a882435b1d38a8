#pragma once

#include <chrono>

namespace acc {

/// Wall-clock stopwatch on the steady clock.
class Timer {
 public:
  Timer() : start_(std::chrono::steady_clock::now()) {}
  void reset() { start_ = std::chrono::steady_clock::now(); }
  double elapsed_ms() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
        .count();
  }
  double elapsed_s() const { return elapsed_ms() * 1e-3; }

 private:
  std::chrono::steady_clock::time_point start_;
};

}  // namespace acc
