#pragma once
// What the time model reads of a trace, without its graph: each op in execution order with its
// phase, FLOPs, bytes and communication, and the shapes only where they are priced (a GEMM's, an
// attention core's q). The search's trace cache keeps this digest of the traces of 1 and 2 blocks
// instead of the traces (trace::TraceCache's digest): some 10-20 KB against 130-190 KB a trace,
// and the time model prices every mesh and micro-batch of a rank's layout from it.
//
// A digest at any batch from the pair at BatchTraces::kLow and kLow + 1 samples (OpsDigestPair)
// rewrites every size the digest holds as BatchTraces::at rewrites it in the trace (each affine
// in the batch), so the digest at b is the digest of BatchTraces::at(b), field for field
// (tests/search/cost_test.cpp compares them), and the time model's figures are those it priced
// from the traces.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "acc/search/calibration.hpp"
#include "acc/trace/model_ref.hpp"
#include "acc/trace/tracer.hpp"

namespace acc::search::detail {

struct DigestTensor {
  Shape shape;
  bool operator==(const DigestTensor&) const = default;
};

struct DigestOp {
  std::string_view op;  // a GEMM op's ("Linear", "LinearBackward", "Bmm", "BmmBackward"), else ""
  std::string name;     // a GEMM op's vertex name (its messages), else ""
  trace::Phase phase = trace::Phase::kForward;
  bool view = false;  // every output shares an input's storage: no kernel runs
  int64_t flops = 0, bytes_read = 0, bytes_written = 0;
  // A GEMM op's inputs and outputs; another op with FLOPs, its first input when it is 4-D (an
  // attention core's q); else none.
  std::vector<DigestTensor> inputs, outputs;
  std::optional<CommRecord> comm;
  bool operator==(const DigestOp& o) const;
};

struct OpsDigest final : trace::TraceDigest {
  std::vector<DigestOp> ops;  // the trace's ops, in execution order
  int64_t num_parameters = 0;
};

/// The digest of `t` (trace::DigestMaker: what the search's trace cache keeps).
std::shared_ptr<const trace::TraceDigest> digest_ops(const trace::Trace& t);
/// `d` as the OpsDigest it is (an acc::InternalError for another reader's digest).
const OpsDigest& ops_of(const std::shared_ptr<const trace::TraceDigest>& d);
/// gemm_counts of the trace `d` digests.
std::vector<GemmCount> gemm_counts(const OpsDigest& d);

/// One step's digests at BatchTraces::kLow and kLow + 1 samples, and from them the step at any
/// batch from kLow up.
class OpsDigestPair {
 public:
  OpsDigestPair(std::shared_ptr<const trace::TraceDigest> low,
                std::shared_ptr<const trace::TraceDigest> next);
  /// Whether the two have the same ops (kinds, phases, views, communication groups, tensor
  /// ranks): then at() gives any batch from kLow up.
  bool affine() const { return affine_; }
  /// The digest at `batch` >= kLow: one of the pair itself, else (affine() only: an
  /// acc::InternalError otherwise) the first with every size rewritten, valid until the next
  /// call. Throws acc::ValueError for batch < kLow or a size that does not fit in 64 bits.
  const OpsDigest& at(int64_t batch);

 private:
  std::shared_ptr<const trace::TraceDigest> low_, next_;
  const OpsDigest *lo_ = nullptr, *hi_ = nullptr;
  OpsDigest scaled_;
  bool affine_ = false;
  bool copied_ = false;
};

}  // namespace acc::search::detail
