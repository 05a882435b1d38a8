#include "acc/trace/batch_traces.hpp"

#include <utility>

#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"

namespace acc::trace {
namespace {

bool same_tensor(const TensorInfo& a, const TensorInfo& b) {
  return a.id == b.id && a.storage == b.storage && a.dtype == b.dtype &&
         a.shape.size() == b.shape.size();
}

bool same_tensors(const std::vector<TensorInfo>& a, const std::vector<TensorInfo>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!same_tensor(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace

bool BatchTraces::same_structure(const Trace& a, const Trace& b) {
  const Graph &ga = a.graph, &gb = b.graph;
  if (ga.num_vertices() != gb.num_vertices() || ga.ops().size() != gb.ops().size() ||
      ga.backward_begin() != gb.backward_begin() ||
      ga.memory_events().size() != gb.memory_events().size() ||
      boost::num_edges(ga.boost_graph()) != boost::num_edges(gb.boost_graph()) ||
      a.num_parameters != b.num_parameters || a.parameter_bytes != b.parameter_bytes ||
      a.input_shapes.size() != b.input_shapes.size() ||
      ga.parameter_storages() != gb.parameter_storages() ||
      ga.gradient_storages() != gb.gradient_storages() ||
      ga.input_storages() != gb.input_storages()) {
    return false;
  }
  for (size_t i = 0; i < a.input_shapes.size(); ++i) {
    if (a.input_shapes[i].size() != b.input_shapes[i].size()) return false;
  }
  for (VertexId v = 0; v < ga.num_vertices(); ++v) {
    const Vertex &x = ga.vertex(v), &y = gb.vertex(v);
    if (x.kind != y.kind || x.op != y.op || x.name != y.name || x.phase != y.phase ||
        x.index != y.index || x.comm.has_value() != y.comm.has_value() ||
        boost::out_degree(v, ga.boost_graph()) != boost::out_degree(v, gb.boost_graph()) ||
        !same_tensors(x.inputs, y.inputs) || !same_tensors(x.outputs, y.outputs)) {
      return false;
    }
    if (x.comm && (x.comm->kind != y.comm->kind || x.comm->group != y.comm->group ||
                   x.comm->group_size != y.comm->group_size)) {
      return false;
    }
  }
  for (size_t i = 0; i < ga.memory_events().size(); ++i) {
    const MemoryEvent &x = ga.memory_events()[i], &y = gb.memory_events()[i];
    if (x.op_index != y.op_index || x.storage != y.storage || (x.bytes > 0) != (y.bytes > 0)) {
      return false;
    }
  }
  return true;
}

namespace {

int64_t at_batch(int64_t x1, int64_t x2, int64_t b) {
  return BatchTraces::size_at(x1, x2, b);
}

void scale(std::vector<TensorInfo>& out, const std::vector<TensorInfo>& one,
           const std::vector<TensorInfo>& two, int64_t b) {
  for (size_t i = 0; i < out.size(); ++i) {
    for (size_t d = 0; d < out[i].shape.size(); ++d) {
      out[i].shape[d] = at_batch(one[i].shape[d], two[i].shape[d], b);
    }
    out[i].nbytes = at_batch(one[i].nbytes, two[i].nbytes, b);
  }
}

}  // namespace

// The two are sizes of one thing at kLow and kLow + 1 samples: of one sign (same_structure checks
// the events'; every other size is >= 0), so the difference cannot overflow.
int64_t BatchTraces::size_at(int64_t x1, int64_t x2, int64_t b) {
  return checked_add(x1, checked_mul(b - kLow, x2 - x1, "a traced size at batch ", b),
                     "a traced size at batch ", b);
}

BatchTraces::BatchTraces(Trace low, Trace next)
    : BatchTraces(std::make_shared<const Trace>(std::move(low)),
                  std::make_shared<const Trace>(std::move(next))) {}

BatchTraces::BatchTraces(std::shared_ptr<const Trace> low, std::shared_ptr<const Trace> next)
    : low_(std::move(low)), next_(std::move(next)) {
  ACC_CHECK_INTERNAL(low_ != nullptr && next_ != nullptr, "BatchTraces: a null trace");
  affine_ = same_structure(*low_, *next_);
}

const Trace& BatchTraces::at(int64_t b) {
  ACC_CHECK(b >= kLow, "BatchTraces: the batch must have >= ", kLow, " samples, got ", b);
  if (b == kLow) return *low_;
  if (b == kLow + 1) return *next_;
  return scaled(b);
}

const Trace& BatchTraces::at_one() {
  return scaled(1);
}

const Trace& BatchTraces::scaled(int64_t b) {
  ACC_CHECK_INTERNAL(affine_, "BatchTraces: the traces at ", kLow, " and ", kLow + 1,
                     " samples differ in structure");
  if (!copied_) {
    scaled_ = *low_;
    copied_ = true;
  }
  Graph& g = scaled_.graph;
  const Graph &g1 = low_->graph, &g2 = next_->graph;
  for (VertexId v = 0; v < g.num_vertices(); ++v) {
    Vertex& x = g.vertex(v);
    const Vertex &x1 = g1.vertex(v), &x2 = g2.vertex(v);
    scale(x.inputs, x1.inputs, x2.inputs, b);
    scale(x.outputs, x1.outputs, x2.outputs, b);
    x.flops = at_batch(x1.flops, x2.flops, b);
    x.bytes_read = at_batch(x1.bytes_read, x2.bytes_read, b);
    x.bytes_written = at_batch(x1.bytes_written, x2.bytes_written, b);
    if (x.comm) x.comm->bytes = at_batch(x1.comm->bytes, x2.comm->bytes, b);
    auto [e, e_end] = boost::out_edges(v, g.boost_graph());
    auto e1 = boost::out_edges(v, g1.boost_graph()).first;
    auto e2 = boost::out_edges(v, g2.boost_graph()).first;
    for (; e != e_end; ++e, ++e1, ++e2) {
      g.boost_graph()[*e].nbytes =
          at_batch(g1.boost_graph()[*e1].nbytes, g2.boost_graph()[*e2].nbytes, b);
    }
  }
  for (size_t i = 0; i < g.events_.size(); ++i) {
    g.events_[i].bytes = at_batch(g1.events_[i].bytes, g2.events_[i].bytes, b);
  }
  for (size_t i = 0; i < scaled_.input_shapes.size(); ++i) {
    for (size_t d = 0; d < scaled_.input_shapes[i].size(); ++d) {
      scaled_.input_shapes[i][d] = at_batch(low_->input_shapes[i][d], next_->input_shapes[i][d], b);
    }
  }
  return scaled_;
}

}  // namespace acc::trace
