#pragma once
// Counter-based random numbers (Philox4x32-10): element i of a draw depends only on (seed, offset
// of the draw, i), never on thread scheduling, so results are the same for any thread count.
// Per-rank streams come from Generator(seed).for_rank(rank).

#include <cstdint>

#include "acc/tensor/tensor.hpp"

namespace acc {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  /// Number of 128-bit blocks consumed so far; with seed() this is the whole state.
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }
  /// An independent stream for `rank` (seed mixed with the rank through splitmix64).
  Generator for_rank(int rank) const;

  /// Reserves `blocks` counter blocks and returns the first one.
  uint64_t advance(uint64_t blocks) {
    uint64_t o = offset_;
    offset_ += blocks;
    return o;
  }

  /// Four 32-bit random words for (key=seed, counter).
  static void philox(uint64_t seed, uint64_t counter, uint32_t out[4]);

  uint64_t next_u64();
  /// Uniform in [0, 1).
  double next_double();

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
};

/// The process-wide generator used when none is passed.
Generator& default_generator();
void manual_seed(uint64_t seed);

/// Fills with U[low, high) / N(mean, std) in f32.
Tensor& uniform_(Tensor& t, double low, double high, Generator& gen = default_generator());
Tensor& normal_(Tensor& t, double mean, double std, Generator& gen = default_generator());
Tensor rand(Shape shape, Generator& gen = default_generator(), TensorOptions options = {});
Tensor randn(Shape shape, Generator& gen = default_generator(), TensorOptions options = {});
/// A part of a larger tensor along one dimension: entries [offset, offset + size(dim)) of a
/// dimension with `full` entries (sequence parallelism's shard of the activations). full == 0:
/// the tensor is whole.
struct TensorChunk {
  int dim = 1;
  int64_t offset = 0;
  int64_t full = 0;
  bool active() const { return full > 0; }
};
/// U[low, high) as uniform_ fills the whole tensor of which `t` is `chunk`: each element gets the
/// value of its index in the whole (block base + g/4, word g%4) and the generator advances by the
/// whole's blocks, so ranks holding different chunks draw one process's values and stay in step.
/// Throws acc::ShapeError when the chunk does not fit t (dim outside it, the entries past full).
Tensor& uniform_(Tensor& t, double low, double high, const TensorChunk& chunk,
                 Generator& gen = default_generator());
/// Integers uniform in [low, high), i64.
Tensor randint(int64_t low, int64_t high, Shape shape, Generator& gen = default_generator());

}  // namespace acc
