#include "ops_digest.hpp"

#include <algorithm>
#include <utility>

#include "acc/trace/batch_traces.hpp"
#include "acc/util/error.hpp"
#include "gemm_ops.hpp"

namespace acc::search::detail {
namespace {

// The op name as a literal the digest can point at (only GEMM ops' names are read).
std::string_view gemm_name(const std::string& op) {
  for (const std::string_view g : {"Linear", "LinearBackward", "Bmm", "BmmBackward"}) {
    if (op == g) return g;
  }
  return {};
}

std::vector<DigestTensor> shapes_of(const std::vector<trace::TensorInfo>& ts) {
  std::vector<DigestTensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back({t.shape});
  return out;
}

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

bool same_comm(const std::optional<CommRecord>& a, const std::optional<CommRecord>& b) {
  if (a.has_value() != b.has_value()) return false;
  return !a || (a->kind == b->kind && a->group == b->group && a->group_size == b->group_size);
}

bool same_ranks(const std::vector<DigestTensor>& a, const std::vector<DigestTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].shape.size() != b[i].shape.size()) return false;
  }
  return true;
}

bool same_ops(const OpsDigest& a, const OpsDigest& b) {
  if (a.ops.size() != b.ops.size() || a.num_parameters != b.num_parameters) return false;
  for (size_t i = 0; i < a.ops.size(); ++i) {
    const DigestOp &x = a.ops[i], &y = b.ops[i];
    if (x.op != y.op || x.phase != y.phase || x.view != y.view || !same_comm(x.comm, y.comm) ||
        !same_ranks(x.inputs, y.inputs) || !same_ranks(x.outputs, y.outputs)) {
      return false;
    }
  }
  return true;
}

void scale(std::vector<DigestTensor>& out, const std::vector<DigestTensor>& one,
           const std::vector<DigestTensor>& two, int64_t b) {
  for (size_t i = 0; i < out.size(); ++i) {
    for (size_t d = 0; d < out[i].shape.size(); ++d) {
      out[i].shape[d] = trace::BatchTraces::size_at(one[i].shape[d], two[i].shape[d], b);
    }
  }
}

}  // namespace

bool DigestOp::operator==(const DigestOp& o) const {
  auto same_record = [](const std::optional<CommRecord>& a, const std::optional<CommRecord>& b) {
    return same_comm(a, b) && (!a || (a->bytes == b->bytes && a->peer == b->peer));
  };
  return op == o.op && name == o.name && phase == o.phase && view == o.view && flops == o.flops &&
         bytes_read == o.bytes_read && bytes_written == o.bytes_written && inputs == o.inputs &&
         outputs == o.outputs && same_record(comm, o.comm);
}

std::shared_ptr<const trace::TraceDigest> digest_ops(const trace::Trace& t) {
  auto d = std::make_shared<OpsDigest>();
  d->num_parameters = t.num_parameters;
  d->ops.reserve(t.graph.ops().size());
  for (const trace::VertexId id : t.graph.ops()) {
    const trace::Vertex& v = t.graph.vertex(id);
    DigestOp op;
    op.op = gemm_name(v.op);
    op.phase = v.phase;
    op.view = is_view(v);
    op.flops = v.flops;
    op.bytes_read = v.bytes_read;
    op.bytes_written = v.bytes_written;
    op.comm = v.comm;
    if (!op.op.empty()) {
      op.name = v.name;
      op.inputs = shapes_of(v.inputs);
      op.outputs = shapes_of(v.outputs);
    } else if (v.flops > 0 && !v.inputs.empty() && v.inputs.front().shape.size() == 4) {
      op.inputs = {{v.inputs.front().shape}};
    }
    d->ops.push_back(std::move(op));
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
  for (const DigestOp& op : d.ops) {
    if (!op.op.empty()) count_gemms(op, counts);
  }
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
    scaled_.num_parameters = lo_->num_parameters;
    copied_ = true;
  }
  for (size_t i = 0; i < scaled_.ops.size(); ++i) {
    DigestOp& x = scaled_.ops[i];
    const DigestOp &x1 = lo_->ops[i], &x2 = hi_->ops[i];
    scale(x.inputs, x1.inputs, x2.inputs, b);
    scale(x.outputs, x1.outputs, x2.outputs, b);
    x.flops = trace::BatchTraces::size_at(x1.flops, x2.flops, b);
    x.bytes_read = trace::BatchTraces::size_at(x1.bytes_read, x2.bytes_read, b);
    x.bytes_written = trace::BatchTraces::size_at(x1.bytes_written, x2.bytes_written, b);
    if (x.comm) x.comm->bytes = trace::BatchTraces::size_at(x1.comm->bytes, x2.comm->bytes, b);
  }
  return scaled_;
}

}  // namespace acc::search::detail
