#pragma once
// Counting the floating-point operations a model really executes: while a FlopCounter is alive,
// every matrix product (matmul, linear, attention) run by this thread adds its multiply-adds x 2,
// forward and backward separately. Elementwise ops are not counted (they are O(1) per element and
// bandwidth-bound), which is the convention of MFU figures.
//
// Attention counts the causal half of its score and value products: forward 2 * B * NH * T^2 * HS
// for a causal mask (4 * B * NH * T^2 * HS without), backward twice the forward (the recomputation
// of the scores in the fused backward is not model work and is not counted).
//
// Counts are int64 and checked: a product or a running total that does not fit in 64 bits is an
// acc::ValueError naming the operands (a step of more than 9.2e18 FLOPs has activations no
// machine holds, so it is an input error, not a reason for a wider type).

#include <cstdint>

namespace acc::autograd {

/// 2 * count * m * k * n: `count` products (m, k) @ (k, n), one multiply-add each counted as 2.
/// Throws acc::ValueError "<op>: FLOPs of count x (m, k) @ (k, n) ..." when it does not fit.
int64_t matmul_flops(const char* op, int64_t count, int64_t m, int64_t k, int64_t n);
/// Forward FLOPs of attention over q (B, NH, T, HS): the score and value products, halved by a
/// causal mask. Throws acc::ValueError naming the shape when it does not fit in 64 bits.
int64_t attention_flops(int64_t B, int64_t NH, int64_t T, int64_t HS, bool causal);

namespace detail {
/// Adds to every live counter of this thread (no-op without one). Throws acc::ValueError when a
/// counter's total would overflow.
void add_flops(int64_t flops, bool backward);
}  // namespace detail

struct FlopCount {
  int64_t forward = 0;
  int64_t backward = 0;
  /// Throws acc::ValueError when the sum does not fit in 64 bits.
  int64_t total() const;
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
