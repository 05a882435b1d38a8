#pragma once
// Counting the floating-point operations a model really executes: while a FlopCounter is alive,
// every matrix product (matmul, linear, attention) run by this thread adds its multiply-adds x 2,
// forward and backward separately. Elementwise ops are not counted (they are O(1) per element and
// bandwidth-bound), which is the convention of MFU figures.
//
// Attention counts the causal half of its score and value products: forward 2 * B * NH * T^2 * HS
// for a causal mask (4 * B * NH * T^2 * HS without), backward twice the forward (the recomputation
// of the scores in the fused backward is not model work and is not counted).

#include <cstdint>

namespace acc::autograd {

namespace detail {
/// Adds to every live counter of this thread (no-op without one).
void add_flops(int64_t flops, bool backward);
}  // namespace detail

struct FlopCount {
  int64_t forward = 0;
  int64_t backward = 0;
  int64_t total() const { return forward + backward; }
};

class FlopCounter {
 public:
  FlopCounter();
  ~FlopCounter();
  FlopCounter(const FlopCounter&) = delete;
  FlopCounter& operator=(const FlopCounter&) = delete;
  const FlopCount& count() const { return count_; }

 private:
  friend void detail::add_flops(int64_t flops, bool backward);
  FlopCount count_;
  FlopCounter* prev_;
};

}  // namespace acc::autograd
