#pragma once
// The traced graph: one vertex per op (forward and backward), per parameter and per model input,
// stored in a Boost.Graph adjacency_list; edges carry the tensors that flow between them. Vertex
// ids are creation order, identical on every rank and every run; names are dotted module paths.
//
// Alongside the graph, the trace keeps the memory timeline of the step: the birth and death of
// every storage in op order (on the meta device nothing is allocated, but the timeline is exactly
// the one a real step would have), which is what liveness and the memory estimator read.

#include <boost/graph/adjacency_list.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "acc/tensor/observer.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::trace {

enum class VertexKind { kOp, kParameter, kInput };
enum class Phase { kForward, kBackward };

const char* vertex_kind_name(VertexKind k);
const char* phase_name(Phase p);

/// A tensor as the trace saw it.
struct TensorInfo {
  int64_t id = -1;       // trace-local tensor id (creation order)
  uint64_t storage = 0;  // storage id (shared by views)
  Shape shape;
  DType dtype = DType::kFloat32;
  int64_t nbytes = 0;  // logical bytes (numel x element size)
};

struct Vertex {
  int64_t id = 0;  // creation order, stable
  VertexKind kind = VertexKind::kOp;
  std::string op;     // "Linear", "LinearBackward", "parameter", "input"
  std::string name;   // parameter/input name; for ops "<scope>/<op>" (unique with id)
  std::string scope;  // dotted module scope of the op ("" for the root)
  Phase phase = Phase::kForward;
  int64_t index = -1;  // position in execution order (ops only)
  std::vector<TensorInfo> inputs;
  std::vector<TensorInfo> outputs;
  int64_t flops = 0;          // matrix-product FLOPs (see acc/autograd/flops.hpp)
  int64_t bytes_read = 0;     // logical bytes of the inputs
  int64_t bytes_written = 0;  // logical bytes of the outputs
  /// Set on a communication vertex: an op of acc/dist/functional.hpp that moves bytes between
  /// ranks, forward (reduce_from_group's all-reduce) or backward (copy_to_group's). Its kind, group
  /// and bytes as the op reported them (acc::CommRecord).
  std::optional<CommRecord> comm;
  /// A forward op whose inputs or outputs are still alive when the forward ends, i.e. kept for
  /// its backward (or a later op's).
  bool saves_activations = false;
};

struct Edge {
  int64_t tensor = -1;
  int64_t nbytes = 0;
};

using BoostGraph =
    boost::adjacency_list<boost::vecS, boost::vecS, boost::bidirectionalS, Vertex, Edge>;
using VertexId = BoostGraph::vertex_descriptor;

/// One entry of the memory timeline: after op `op_index` (-1: before the first op), `storage`
/// of `bytes` became alive (bytes > 0) or died (bytes < 0).
struct MemoryEvent {
  int64_t op_index = -1;
  uint64_t storage = 0;
  int64_t bytes = 0;
};

class Graph {
 public:
  // The Boost graph is held by pointer: Boost 1.74's adjacency_list has no move constructor or
  // assignment (and its swap() copies it three times), so a Graph holding it by value would copy
  // every vertex each time a trace is moved (several times on its way out of the tracer). A
  // moved-from Graph is empty.
  Graph() : g_(std::make_unique<BoostGraph>()) {}
  Graph(const Graph& other);
  Graph& operator=(const Graph& other);
  Graph(Graph&& other);
  Graph& operator=(Graph&& other);
  ~Graph();

  BoostGraph& boost_graph() { return *g_; }
  const BoostGraph& boost_graph() const { return *g_; }
  size_t num_vertices() const { return boost::num_vertices(*g_); }
  const Vertex& vertex(VertexId v) const { return (*g_)[v]; }
  Vertex& vertex(VertexId v) { return (*g_)[v]; }
  /// Op vertices in execution order.
  const std::vector<VertexId>& ops() const { return ops_; }
  /// Index into ops() of the first backward op (ops().size() without backward).
  int64_t backward_begin() const { return backward_begin_; }

  const std::vector<MemoryEvent>& memory_events() const { return events_; }
  /// Storages that hold parameters / parameter gradients / model inputs.
  const std::set<uint64_t>& parameter_storages() const { return param_storages_; }
  const std::set<uint64_t>& gradient_storages() const { return grad_storages_; }
  const std::set<uint64_t>& input_storages() const { return input_storages_; }

 private:
  friend class Recorder;
  friend class BatchTraces;  // rewrites the events' bytes of a trace at another batch
  std::unique_ptr<BoostGraph> g_;
  std::vector<VertexId> ops_;
  int64_t backward_begin_ = 0;
  std::vector<MemoryEvent> events_;
  std::set<uint64_t> param_storages_, grad_storages_, input_storages_;
};

}  // namespace acc::trace
