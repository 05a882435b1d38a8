#pragma once
// One step traced at two consecutive batches, from which the same step at any larger batch
// follows without tracing it again.
//
// A registry model's tensors grow with the batch along their batch dimension alone (B, or B x T
// flattened), so every size in its trace (each tensor's dims and bytes, an op's FLOPs and bytes
// moved, a collective's bytes, each memory event) is affine in the batch: x(b) = x(lo) + (b - lo)
// x (x(lo + 1) - x(lo)). Where the two traces have the same ops, tensors and memory events
// (checked), the trace at b >= lo is the one at lo with every size so rewritten, and equal to a
// trace made at b (tests/trace/trace_test.cpp, BatchTraces.*, compares their dumps). The pair is
// taken at 2 and 3 samples: at 1 sample a transpose can leave a tensor contiguous, and the trace
// then lacks the copy every larger batch makes. The memory and time models use it to price every
// micro-batch of a layout from one pair of traces.

#include <cstdint>
#include <memory>

#include "acc/trace/tracer.hpp"

namespace acc::trace {

class BatchTraces {
 public:
  /// The batch of the first trace of the pair (the second's is one more).
  static constexpr int64_t kLow = 2;
  /// `low` and `next`: the same step (model, depth, options) traced at kLow and kLow + 1 samples.
  BatchTraces(Trace low, Trace next);
  /// The same over traces kept elsewhere (trace::TraceCache's), not copied.
  BatchTraces(std::shared_ptr<const Trace> low, std::shared_ptr<const Trace> next);
  /// Whether the two have the same ops, tensors and memory events: then at() gives any batch
  /// from kLow up.
  bool affine() const { return affine_; }
  /// The step at `batch` >= kLow samples: one of the pair itself, else (affine() only: an
  /// acc::InternalError otherwise) a copy of the first with every size rewritten, valid until the
  /// next call. Throws acc::ValueError for batch < kLow or a size that does not fit in 64 bits.
  const Trace& at(int64_t batch);
  /// The step at one sample, on the pair's line: valid only where the step traced at one sample
  /// has the pair's structure (same_structure with low()), which a caller establishes for the
  /// same model and options at fewer blocks (estimate_training_needs: at 2 blocks, for the
  /// deeper traces). Then every size is the pair's line at 1 (tests/search/space_test.cpp,
  /// BatchTraces.AtOneSampleWhereTwoBlocksAreLikeThePair). A copy, valid until the next call of
  /// at() or at_one(). acc::InternalError when the pair is not affine().
  const Trace& at_one();
  /// The trace at kLow samples.
  const Trace& low() const { return *low_; }
  /// Whether two traces of one step at different batches have the same ops, tensors and memory
  /// events (what affine() checks of the pair).
  static bool same_structure(const Trace& a, const Trace& b);
  /// A size at `batch` samples from the same size at kLow (`at_low`) and kLow + 1 (`at_next`):
  /// at_low + (batch - kLow) x (at_next - at_low), what at() writes. Throws acc::ValueError when
  /// it does not fit in 64 bits.
  static int64_t size_at(int64_t at_low, int64_t at_next, int64_t batch);

 private:
  std::shared_ptr<const Trace> low_, next_;
  Trace scaled_;
  bool affine_ = false;
  bool copied_ = false;  // scaled_ holds a copy of low_
  // The copy of low_ with every size at `batch` (>= 1) samples.
  const Trace& scaled(int64_t batch);
};

}  // namespace acc::trace
