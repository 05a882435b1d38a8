#include "ops_digest.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include "acc/trace/batch_traces.hpp"
#include "acc/util/error.hpp"
#include "gemm_ops.hpp"

namespace acc::search::detail {
namespace {

// Every output shares an input's storage: a view, no kernel.
bool is_view(const trace::Vertex& v) {
  if (v.outputs.empty() || v.inputs.empty()) return false;
  for (const auto& o : v.outputs) {
    const bool shared = std::any_of(v.inputs.begin(), v.inputs.end(),
                                    [&](const auto& i) { return i.storage == o.storage; });
    if (!shared) return false;
  }
  return true;
}

int32_t index_of(size_t size) {
  ACC_CHECK_INTERNAL(size < static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                     "digest_ops: ", size, " entries");
  return static_cast<int32_t>(size);
}

bool same_group(const CommRecord& a, const CommRecord& b) {
  return a.kind == b.kind && a.group == b.group && a.group_size == b.group_size;
}

// The same ops, in the same order, but for their sizes.
bool same_ops(const OpsDigest& a, const OpsDigest& b) {
  if (a.ops.size() != b.ops.size() || a.gemms.size() != b.gemms.size() ||
      a.comms.size() != b.comms.size() || a.attention_q.size() != b.attention_q.size() ||
      a.num_parameters != b.num_parameters) {
    return false;
  }
  for (size_t i = 0; i < a.ops.size(); ++i) {
    const DigestOp &x = a.ops[i], &y = b.ops[i];
    if (x.phase != y.phase || x.view != y.view || x.gemm != y.gemm || x.comm != y.comm ||
        x.attention != y.attention) {
      return false;
    }
  }
  for (size_t i = 0; i < a.gemms.size(); ++i) {
    const DigestGemm &x = a.gemms[i], &y = b.gemms[i];
    if (x.phase != y.phase || x.shape.trans_a != y.shape.trans_a ||
        x.shape.trans_b != y.shape.trans_b) {
      return false;
    }
  }
  for (size_t i = 0; i < a.comms.size(); ++i) {
    if (!same_group(a.comms[i], b.comms[i])) return false;
  }
  return true;
}

int64_t size_at(int64_t x1, int64_t x2, int64_t b) {
  return trace::BatchTraces::size_at(x1, x2, b);
}

}  // namespace

bool OpsDigest::same_as(const OpsDigest& o) const {
  if (!same_ops(*this, o) || ops != o.ops || gemms != o.gemms || attention_q != o.attention_q) {
    return false;
  }
  for (size_t i = 0; i < comms.size(); ++i) {
    if (comms[i].bytes != o.comms[i].bytes || comms[i].peer != o.comms[i].peer) return false;
  }
  return true;
}

std::shared_ptr<const trace::TraceDigest> digest_ops(const trace::Trace& t) {
  auto d = std::make_shared<OpsDigest>();
  d->num_parameters = t.num_parameters;
  d->ops.reserve(t.graph.ops().size());
  for (const trace::VertexId id : t.graph.ops()) {
    const trace::Vertex& v = t.graph.vertex(id);
    DigestOp op;
    op.bytes = v.bytes_read + v.bytes_written;
    op.flops = v.flops;
    op.phase = v.phase;
    op.view = is_view(v);
    op.gemm = is_gemm_op(v.op);
    if (v.comm) {
      op.comm = index_of(d->comms.size());
      d->comms.push_back(*v.comm);
    }
    if (op.gemm) {
      for_each_gemm(v, [&](const GemmShape& s, int64_t calls) {
        d->gemms.push_back({s, calls, v.phase});
      });
    } else if (v.flops > 0 && !v.inputs.empty() && v.inputs.front().shape.size() == 4) {
      const Shape& q = v.inputs.front().shape;
      op.attention = index_of(d->attention_q.size());
      d->attention_q.push_back({q[0], q[1], q[2], q[3]});
    }
    d->ops.push_back(op);
  }
  return d;
}

const OpsDigest& ops_of(const std::shared_ptr<const trace::TraceDigest>& d) {
  const auto* ops = dynamic_cast<const OpsDigest*>(d.get());
  ACC_CHECK_INTERNAL(ops != nullptr, "ops_of: not the time model's digest of a trace");
  return *ops;
}

std::vector<GemmCount> gemm_counts(const OpsDigest& d) {
  std::map<GemmShape, GemmCount> counts;
  for (const DigestGemm& g : d.gemms) count_gemm(counts, g.shape, g.calls, g.phase);
  return sorted_counts(counts);
}

OpsDigestPair::OpsDigestPair(std::shared_ptr<const trace::TraceDigest> low,
                             std::shared_ptr<const trace::TraceDigest> next)
    : low_(std::move(low)), next_(std::move(next)), lo_(&ops_of(low_)), hi_(&ops_of(next_)) {
  affine_ = same_ops(*lo_, *hi_);
}

const OpsDigest& OpsDigestPair::at(int64_t b) {
  constexpr int64_t kLow = trace::BatchTraces::kLow;
  ACC_CHECK(b >= kLow, "OpsDigestPair: the batch must have >= ", kLow, " samples, got ", b);
  if (b == kLow) return *lo_;
  if (b == kLow + 1) return *hi_;
  ACC_CHECK_INTERNAL(affine_, "OpsDigestPair: the digests at ", kLow, " and ", kLow + 1,
                     " samples differ in their ops");
  if (!copied_) {
    scaled_.ops = lo_->ops;
    scaled_.gemms = lo_->gemms;
    scaled_.comms = lo_->comms;
    scaled_.attention_q = lo_->attention_q;
    scaled_.num_parameters = lo_->num_parameters;
    copied_ = true;
  }
  for (size_t i = 0; i < scaled_.ops.size(); ++i) {
    const DigestOp &x1 = lo_->ops[i], &x2 = hi_->ops[i];
    scaled_.ops[i].bytes = size_at(x1.bytes, x2.bytes, b);
    scaled_.ops[i].flops = size_at(x1.flops, x2.flops, b);
  }
  for (size_t i = 0; i < scaled_.gemms.size(); ++i) {
    const DigestGemm &x1 = lo_->gemms[i], &x2 = hi_->gemms[i];
    DigestGemm& x = scaled_.gemms[i];
    x.shape.m = size_at(x1.shape.m, x2.shape.m, b);
    x.shape.n = size_at(x1.shape.n, x2.shape.n, b);
    x.shape.k = size_at(x1.shape.k, x2.shape.k, b);
    x.calls = size_at(x1.calls, x2.calls, b);
  }
  for (size_t i = 0; i < scaled_.comms.size(); ++i) {
    scaled_.comms[i].bytes = size_at(lo_->comms[i].bytes, hi_->comms[i].bytes, b);
  }
  for (size_t i = 0; i < scaled_.attention_q.size(); ++i) {
    for (size_t k = 0; k < 4; ++k) {
      scaled_.attention_q[i][k] = size_at(lo_->attention_q[i][k], hi_->attention_q[i][k], b);
    }
  }
  return scaled_;
}

}  // namespace acc::search::detail
