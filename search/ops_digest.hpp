#pragma once
// What the time model reads of a trace, without its graph: each op in execution order with its
// phase, FLOPs and bytes, and beside them the GEMMs the matrix-product ops ran, the communication
// records and the attention cores' q shapes. The search's trace cache keeps this digest of the
// traces of 1 and 2 blocks instead of the traces (trace::TraceCache's digest): about 5-15 KB (32
// bytes an op, 48 a GEMM, 100-300 ops a trace) against 130-190 KB a trace, and the time model
// prices every mesh and micro-batch of a rank's layout from it.
//
// A digest at any batch from the pair at BatchTraces::kLow and kLow + 1 samples (OpsDigestPair)
// rewrites every size it holds as x(lo) + (b - lo)(x(lo + 1) - x(lo)), as BatchTraces::at
// rewrites the trace's. The ops' bytes, FLOPs, messages and q shapes are the trace's sizes
// themselves; a GEMM's m, n, k and calls are each one of its tensors' dims or its rows (numel
// over one constant dim), and a registry model's tensors grow along one batch dimension alone, so
// they are affine too. tests/search/cluster_test.cpp (OpsDigest.*) compares the digest at b with
// the digest of a trace made at b, field for field, over every rank of the tp, sp and pipeline
// layouts of GPT and Llama: equal.

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "acc/search/calibration.hpp"
#include "acc/trace/model_ref.hpp"
#include "acc/trace/tracer.hpp"

namespace acc::search::detail {

/// One op as the time model prices it.
struct DigestOp {
  int64_t bytes = 0;  // read + written
  int64_t flops = 0;
  int32_t comm = -1;       // its record in OpsDigest::comms, if it communicates
  int32_t attention = -1;  // its q in OpsDigest::attention_q: an op with FLOPs, not a GEMM op,
                           // whose first input is 4-D (B, H, T, D) (an attention core)
  trace::Phase phase = trace::Phase::kForward;
  bool view = false;  // every output shares an input's storage: no kernel runs
  bool gemm = false;  // a matrix-product op: its GEMMs are in OpsDigest::gemms
  bool operator==(const DigestOp&) const = default;
};

/// One GEMM shape a matrix-product op ran, `calls` times.
struct DigestGemm {
  GemmShape shape;
  int64_t calls = 0;
  trace::Phase phase = trace::Phase::kForward;
  bool operator==(const DigestGemm&) const = default;
};

struct OpsDigest final : trace::TraceDigest {
  std::vector<DigestOp> ops;  // the trace's ops, in execution order
  std::vector<DigestGemm> gemms;
  std::vector<CommRecord> comms;
  std::vector<std::array<int64_t, 4>> attention_q;
  int64_t num_parameters = 0;
  /// Every field equal (the tests' comparison).
  bool same_as(const OpsDigest& o) const;
};

/// The digest of `t` (trace::DigestMaker: what the search's trace cache keeps).
std::shared_ptr<const trace::TraceDigest> digest_ops(const trace::Trace& t);
/// `d` as the OpsDigest it is (an acc::InternalError for another reader's digest).
const OpsDigest& ops_of(const std::shared_ptr<const trace::TraceDigest>& d);
/// gemm_counts of the trace `d` digests: one entry per distinct shape, sorted.
std::vector<GemmCount> gemm_counts(const OpsDigest& d);

/// One step's digests at BatchTraces::kLow and kLow + 1 samples, and from them the step at any
/// batch from kLow up.
class OpsDigestPair {
 public:
  OpsDigestPair(std::shared_ptr<const trace::TraceDigest> low,
                std::shared_ptr<const trace::TraceDigest> next);
  /// Whether the two have the same ops (phases, views, GEMM layouts, communication groups):
  /// then at() gives any batch from kLow up.
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
