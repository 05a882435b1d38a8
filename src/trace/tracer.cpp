#include "acc/trace/tracer.hpp"

#include <atomic>
#include <deque>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "acc/autograd/ops.hpp"
#include "acc/models/language_model.hpp"
#include "acc/nn/recompute.hpp"
#include "acc/tensor/observer.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"

namespace acc::trace {

Graph::Graph(const Graph& other)
    : g_(std::make_unique<BoostGraph>(*other.g_)),
      ops_(other.ops_),
      backward_begin_(other.backward_begin_),
      events_(other.events_),
      param_storages_(other.param_storages_),
      grad_storages_(other.grad_storages_),
      input_storages_(other.input_storages_) {}

Graph& Graph::operator=(const Graph& other) {
  if (this != &other) *this = Graph(other);
  return *this;
}

Graph::Graph(Graph&& other) : Graph() {
  *this = std::move(other);
}

Graph& Graph::operator=(Graph&& other) {
  if (this == &other) return *this;
  g_.swap(other.g_);
  other.g_->clear();  // what this one held goes: the moved-from graph is empty
  ops_ = std::exchange(other.ops_, {});
  backward_begin_ = std::exchange(other.backward_begin_, 0);
  events_ = std::exchange(other.events_, {});
  param_storages_ = std::exchange(other.param_storages_, {});
  grad_storages_ = std::exchange(other.grad_storages_, {});
  input_storages_ = std::exchange(other.input_storages_, {});
  return *this;
}

Graph::~Graph() = default;

const char* vertex_kind_name(VertexKind k) {
  switch (k) {
    case VertexKind::kOp:
      return "op";
    case VertexKind::kParameter:
      return "parameter";
    case VertexKind::kInput:
      return "input";
  }
  return "?";
}

const char* phase_name(Phase p) {
  return p == Phase::kForward ? "forward" : "backward";
}

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::kNone;
  if (name == "block") return Recompute::kBlock;
  if (name == "selective") return Recompute::kSelective;
  ACC_THROW(ValueError, "unknown recompute choice '", name,
            "' (expected none, block or selective)");
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return "none";
    case Recompute::kBlock:
      return "block";
    case Recompute::kSelective:
      return "selective";
  }
  return "none";
}

// Builds the Graph from the observer callbacks of one trace. The vertices and edges are collected
// first and the Boost graph built once, at its final size, by finish(): adding them one by one
// copied every vertex into the graph and grew its vertex array by doubling, which (with the
// search's trace cache growing the heap) faulted in fresh pages at each growth: a tenth of a
// plan-only search (perf, GPT-3 175B on 1024 devices).
class Recorder : public detail::OpObserver {
 public:
  explicit Recorder(Graph& g) : g_(g), session_(next_session_.fetch_add(1)) {}

  TensorInfo info(const Tensor& t) {
    TensorImpl* impl = t.impl();
    if (impl->trace_session != session_) {
      impl->trace_session = session_;
      impl->trace_id = next_tensor_++;
    }
    TensorInfo ti;
    ti.id = impl->trace_id;
    ti.storage = local(t.storage()->id());
    ti.shape = t.shape();
    ti.dtype = t.dtype();
    ti.nbytes = static_cast<int64_t>(t.nbytes());
    return ti;
  }

  VertexId add_source(VertexKind kind, const std::string& name, const Tensor& t) {
    Vertex v;
    v.id = static_cast<int64_t>(vertices_.size());
    v.kind = kind;
    v.op = vertex_kind_name(kind);
    v.name = name;
    v.outputs.push_back(info(t));
    v.bytes_written = v.outputs.back().nbytes;
    const auto id = static_cast<VertexId>(vertices_.size());
    set_producer(v.outputs.back().id, id);
    (kind == VertexKind::kParameter ? g_.param_storages_ : g_.input_storages_)
        .insert(v.outputs.back().storage);
    vertices_.push_back(std::move(v));
    return id;
  }

  void mark_backward() {
    phase_ = Phase::kBackward;
    g_.backward_begin_ = static_cast<int64_t>(g_.ops_.size());
  }

  void add_gradient_storage(const Tensor& grad) {
    g_.grad_storages_.insert(local(grad.storage()->id()));
  }

  void on_alloc(uint64_t storage, size_t nbytes, Device) override {
    const int64_t b = static_cast<int64_t>(nbytes);
    bytes_[storage] = b;
    g_.events_.push_back({current_op(), local(storage), b});
  }

  void on_free(uint64_t storage) override {
    auto it = bytes_.find(storage);
    if (it == bytes_.end()) return;
    g_.events_.push_back({current_op(), local(storage), -it->second});
    bytes_.erase(it);
  }

  void on_flops(int64_t flops, bool) override {
    pending_flops_ = checked_add(pending_flops_, flops, "FLOPs of one op");
  }

  void on_comm(const CommRecord& comm) override {
    ACC_CHECK_INTERNAL(!pending_comm_, "trace: ", comm_kind_name(comm.kind), " on group '",
                       comm.group, "' reported while the ", comm_kind_name(pending_comm_->kind),
                       " on group '", pending_comm_->group, "' waits for its op");
    pending_comm_ = comm;
  }

  void on_backward_begin(const std::vector<Tensor>& grads) override {
    std::vector<TensorInfo> infos;
    for (const Tensor& t : grads) {
      if (t.defined()) infos.push_back(info(t));
    }
    pending_inputs_.push_back(std::move(infos));
  }

  void on_op(const std::string& name, const std::string& scope, const std::vector<Tensor>& inputs,
             const std::vector<Tensor>& outputs, bool backward) override {
    Vertex v;
    v.id = static_cast<int64_t>(vertices_.size());
    v.kind = VertexKind::kOp;
    v.op = name;
    v.scope = scope;
    v.name = scope.empty() ? name : scope + "/" + name;
    v.phase = backward ? Phase::kBackward : phase_;
    v.index = static_cast<int64_t>(g_.ops_.size());
    v.flops = pending_flops_;
    pending_flops_ = 0;
    v.comm = std::move(pending_comm_);
    pending_comm_.reset();
    if (backward && !pending_inputs_.empty()) {
      v.inputs = std::move(pending_inputs_.back());
      pending_inputs_.pop_back();
      for (const TensorInfo& ti : v.inputs) {
        v.bytes_read = checked_add(v.bytes_read, ti.nbytes, "bytes read by ", v.name);
      }
    }
    for (const Tensor& t : inputs) {
      if (!t.defined()) continue;
      v.inputs.push_back(info(t));
      v.bytes_read = checked_add(v.bytes_read, v.inputs.back().nbytes, "bytes read by ", v.name);
    }
    for (const Tensor& t : outputs) {
      if (!t.defined()) continue;
      v.outputs.push_back(info(t));
      v.bytes_written =
          checked_add(v.bytes_written, v.outputs.back().nbytes, "bytes written by ", v.name);
    }
    const auto id = static_cast<VertexId>(vertices_.size());
    g_.ops_.push_back(id);
    for (const TensorInfo& in : v.inputs) {
      if (in.id < static_cast<int64_t>(producer_.size()) && producer_[in.id] >= 0) {
        edges_.push_back({static_cast<VertexId>(producer_[in.id]), id, Edge{in.id, in.nbytes}});
      }
    }
    for (const TensorInfo& out : v.outputs) set_producer(out.id, id);
    vertices_.push_back(std::move(v));
  }

  // The graph of what was recorded (its vertices in creation order, each vertex's edges in the
  // order they were recorded).
  void finish() {
    g_.g_ = std::make_unique<BoostGraph>(vertices_.size());
    for (size_t i = 0; i < vertices_.size(); ++i) (*g_.g_)[i] = std::move(vertices_[i]);
    vertices_.clear();
    for (const auto& [from, to, e] : edges_) boost::add_edge(from, to, e, *g_.g_);
    edges_.clear();
  }

 private:
  int64_t current_op() const { return static_cast<int64_t>(g_.ops_.size()) - 1; }
  // Trace-local storage ids in order of first appearance, so dumps do not depend on how many
  // storages the process created before the trace.
  uint64_t local(uint64_t global) {
    auto [it, fresh] = local_ids_.try_emplace(global, local_ids_.size() + 1);
    return it->second;
  }
  void set_producer(int64_t tensor, VertexId v) {
    if (tensor >= static_cast<int64_t>(producer_.size())) producer_.resize(tensor + 1, -1);
    producer_[tensor] = static_cast<int64_t>(v);
  }

  static std::atomic<uint64_t> next_session_;
  Graph& g_;
  uint64_t session_;
  int64_t next_tensor_ = 0;
  int64_t pending_flops_ = 0;
  std::optional<CommRecord> pending_comm_;  // reported for the next op
  Phase phase_ = Phase::kForward;
  std::deque<Vertex> vertices_;  // recorded (a deque: never moved as it grows)
  struct Recorded {
    VertexId from, to;
    Edge edge;
  };
  std::vector<Recorded> edges_;
  std::vector<int64_t> producer_;                        // tensor id -> vertex
  std::vector<std::vector<TensorInfo>> pending_inputs_;  // of backward nodes being run
  std::unordered_map<uint64_t, int64_t> bytes_;          // live global storage id -> bytes
  std::unordered_map<uint64_t, uint64_t> local_ids_;     // global storage id -> trace-local id
};

std::atomic<uint64_t> Recorder::next_session_{1};

struct MetaStorageGuard::Saved {
  Tensor tensor;
  std::shared_ptr<Storage> storage;
  int64_t offset;
  Shape strides;
  std::shared_ptr<TensorImpl> grad;
};

MetaStorageGuard::MetaStorageGuard(
    nn::Module& m, const std::function<void(const std::string&, const Tensor&)>& on_swap) {
  // A set, not a scan of saved_: a model with 10^5 parameters spent seconds here.
  std::unordered_set<const TensorImpl*> swapped;
  auto swap = [&](Tensor& t, const std::string& name) {
    if (!swapped.insert(t.impl()).second) return;  // tied: already swapped
    TensorImpl* impl = t.impl();
    Saved s{t, impl->storage, impl->offset, impl->strides, nullptr};
    if (impl->autograd) {
      s.grad = impl->autograd->grad;
      impl->autograd->grad.reset();
    }
    saved_.push_back(std::move(s));
    impl->storage = std::make_shared<Storage>(t.nbytes(), Device::kMeta);
    impl->offset = 0;
    impl->strides = contiguous_strides(impl->shape);
    if (on_swap) on_swap(name, t);
  };
  for (auto& [name, t] : m.named_parameters()) swap(t, name);
  for (auto& [name, t] : m.named_buffers()) swap(t, name);
}

MetaStorageGuard::~MetaStorageGuard() {
  for (auto& s : saved_) {
    TensorImpl* impl = s.tensor.impl();
    impl->storage = s.storage;
    impl->offset = s.offset;
    impl->strides = s.strides;
    if (impl->autograd) impl->autograd->grad = s.grad;
  }
}

namespace {

// The strategies' block wrappers applied while alive, through the code paths of the `amp` and
// `checkpoint` methods: bf16 activations in every repeated block (inner), then recomputation of
// the first `options.recompute_blocks` of them (all with -1), whole or their attention cores.
class BlockWrappers {
 public:
  BlockWrappers(nn::Module& root, const TraceOptions& options) {
    if (options.recompute == Recompute::kNone && !options.bf16_activations) return;
    auto groups = find_blocks(root);
    if (groups.empty()) return;
    std::vector<std::string> blocks = groups.front().blocks;
    if (options.bf16_activations) unwraps_.push_back(nn::bf16_activation_blocks(root, blocks));
    if (options.recompute == Recompute::kNone) return;
    if (options.recompute_blocks >= 0 &&
        options.recompute_blocks < static_cast<int64_t>(blocks.size())) {
      blocks.resize(static_cast<size_t>(options.recompute_blocks));
    }
    unwraps_.push_back(options.recompute == Recompute::kSelective
                           ? nn::recompute_attention_cores(root, blocks)
                           : nn::recompute_blocks(root, blocks));
  }
  ~BlockWrappers() {
    for (auto it = unwraps_.rbegin(); it != unwraps_.rend(); ++it) (*it)();
  }
  BlockWrappers(const BlockWrappers&) = delete;
  BlockWrappers& operator=(const BlockWrappers&) = delete;

 private:
  std::vector<nn::Undo> unwraps_;
};

Tensor default_loss(nn::Module& m, const std::vector<Tensor>& in) {
  if (auto* lm = dynamic_cast<models::LanguageModel*>(&m); lm != nullptr && in.size() >= 2) {
    return lm->loss(in[0], in[1]);
  }
  Tensor out = m(in[0]);
  return out.numel() == 1 ? out : sum(out);
}

}  // namespace

Trace trace(nn::Module& module, const std::vector<Tensor>& sample_inputs,
            const TraceOptions& options) {
  return trace(module, default_loss, sample_inputs, options);
}

Trace trace(nn::Module& module, const LossFn& loss_fn, const std::vector<Tensor>& sample_inputs,
            const TraceOptions& options) {
  ACC_CHECK(!sample_inputs.empty(), "trace: at least one sample input is needed");
  Trace t;
  t.model_type = module.type_name();
  t.options = options;
  for (const Tensor& p : module.parameters()) {
    t.num_parameters = checked_add(t.num_parameters, p.numel(), "parameter count of the model");
    t.parameter_bytes = checked_add(t.parameter_bytes, static_cast<int64_t>(p.nbytes()),
                                    "parameter bytes of the model");
  }
  Recorder rec(t.graph);
  {
    detail::ObserverGuard observe(&rec);
    MetaStorageGuard swap(module, [&rec](const std::string& name, const Tensor& t) {
      rec.add_source(VertexKind::kParameter, name, t);
    });
    BlockWrappers wrappers(module, options);
    std::vector<Tensor> inputs;
    for (size_t i = 0; i < sample_inputs.size(); ++i) {
      const Tensor& s = sample_inputs[i];
      ACC_CHECK(s.defined(), "trace: sample input ", i, " is undefined");
      t.input_shapes.push_back(s.shape());
      inputs.push_back(empty(s.shape(), {s.dtype(), Device::kMeta, false}));
      rec.add_source(VertexKind::kInput, "input." + std::to_string(i), inputs.back());
    }
    {
      Tensor loss = loss_fn(module, inputs);
      ACC_CHECK(loss.defined(), "trace: the loss function returned an undefined tensor");
      if (options.backward && loss.requires_grad()) {
        rec.mark_backward();
        loss.backward(loss.numel() == 1 ? Tensor() : ones_like(loss));
        for (const Tensor& p : module.parameters()) {
          if (p.grad().defined()) rec.add_gradient_storage(p.grad());
        }
      } else {
        rec.mark_backward();  // no backward ops: they start at the end
      }
    }
    inputs.clear();
    // MetaSwap restores the real storages and gradients here, while the recorder still sees the
    // meta ones die.
  }
  rec.finish();
  // Which forward ops keep something alive into the backward.
  Liveness live = liveness(t);
  std::set<uint64_t> saved;
  for (const StorageLife& s : live.storages) {
    const bool alive_at_boundary =
        s.born < t.graph.backward_begin() && (s.dies < 0 || s.dies >= t.graph.backward_begin());
    if (alive_at_boundary && s.role == StorageLife::Role::kActivation) saved.insert(s.storage);
  }
  for (VertexId v : t.graph.ops()) {
    Vertex& vx = t.graph.vertex(v);
    if (vx.phase != Phase::kForward) continue;
    for (const auto* list : {&vx.inputs, &vx.outputs}) {
      for (const TensorInfo& ti : *list) {
        if (saved.count(ti.storage)) vx.saves_activations = true;
      }
    }
  }
  return t;
}

}  // namespace acc::trace
