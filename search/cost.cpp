#include "acc/search/cost.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <set>

#include "acc/models/language_model.hpp"
#include "acc/trace/batch_traces.hpp"
#include "acc/trace/tracer.hpp"
#include "acc/util/error.hpp"
#include "made_ahead.hpp"
#include "ops_digest.hpp"

namespace acc::search {
namespace {

// A trace of the model at `depth` blocks for a micro-batch, on the meta device (a module that is
// not the registry's: whole, whatever the depth asked).
// Shared, not copied, when the model keeps its traces (trace::ModelRef::shared_traces).
std::shared_ptr<const trace::Trace> shallow_trace(const trace::ModelRef& model, int64_t depth,
                                                  int64_t micro_batch, int64_t seq_len,
                                                  const trace::TraceOptions& activations) {
  if (!model.extrapolates()) depth = model.num_layers();
  auto t = model.traced(depth, micro_batch, seq_len, activations);
  return {t, &t->trace};
}

// The time model's digest of that trace (detail::OpsDigest): the search's trace cache keeps it
// instead of the trace (RankModels).
std::shared_ptr<const trace::TraceDigest> shallow_digest(const trace::ModelRef& model,
                                                         int64_t depth, int64_t micro_batch,
                                                         int64_t seq_len,
                                                         const trace::TraceOptions& activations) {
  if (!model.extrapolates()) depth = model.num_layers();
  return model.digest(depth, micro_batch, seq_len, activations, detail::digest_ops);
}

struct Times {
  double forward = 0, backward = 0;
  double comm_forward = 0, comm_backward = 0;
  double waits = 0;  // the collectives and received messages the rank waits for
};

// What turns a trace's ops into seconds.
class Pricer {
 public:
  virtual ~Pricer() = default;
  virtual double gemm(const GemmShape& s) const = 0;
  /// An op that is neither a GEMM nor communication; `q`: an attention core's q (B, H, T, D), else
  /// null.
  virtual double op(const detail::DigestOp& v, const std::array<int64_t, 4>* q) const = 0;
  /// A communication vertex's; a send is free (its receive waits for it).
  virtual double comm(const CommRecord& r) const = 0;
  /// What `r` waits beyond comm(r) for peers that time-slice cores, after `gap_s` of compute.
  virtual double wait(const CommRecord& /*r*/, double /*gap_s*/) const { return 0; }
  /// Whether wait() may be anything but 0 (the plan-only pricing skips the pass over them).
  virtual bool waits() const { return false; }
  /// What every op costs beyond its work (the engine's dispatch, allocation, autograd node).
  virtual double per_op() const { return 0; }
};

// This machine: the calibration's GEMM rates and bandwidth, the α-β fits by group size.
template <typename CommFor>
class MeasuredPricer final : public Pricer {
 public:
  MeasuredPricer(const MachineCalibration& m, const CommFor& comm_for)
      : m_(m), comm_for_(comm_for) {
    for (const auto& [shape, gf] : m.gemm_gflops) best_gflops_ = std::max(best_gflops_, gf);
  }
  double gemm(const GemmShape& s) const override { return m_.gemm_seconds(s); }
  double per_op() const override { return m_.op_overhead_s; }
  double op(const detail::DigestOp& v, const std::array<int64_t, 4>* /*q*/) const override {
    double s = m_.memory_seconds(v.bytes);
    if (v.flops > 0 && best_gflops_ > 0) {
      s = std::max(s, static_cast<double>(v.flops) / (best_gflops_ * 1e9));
    }
    return s;
  }
  double comm(const CommRecord& r) const override {
    // A pipeline's message: its receive waits for it (at the broadcast fit of two ranks: one
    // message).
    const bool p2p = r.kind == CommKind::kRecv;
    const std::string kind = r.kind == CommKind::kAlltoall ? "allgather"
                             : p2p                         ? "broadcast"
                                                           : std::string(comm_kind_name(r.kind));
    return comm_for_(p2p ? 2 : r.group_size).seconds(kind, r.bytes);
  }
  // Each also waits for its peers when more ranks than cores time-slice them
  // (CommCalibration::wait_seconds): a collective for the group, a message for its sender.
  bool waits() const override { return true; }
  double wait(const CommRecord& r, double gap_s) const override {
    return comm_for_(r.kind == CommKind::kRecv ? 2 : r.group_size).wait_seconds(r.bytes, gap_s);
  }

 private:
  const MachineCalibration& m_;
  const CommFor& comm_for_;
  double best_gflops_ = 0;
};

// A cluster not at hand: the profile's figures, each group placed by the candidate's mesh.
class ClusterPricer final : public Pricer {
 public:
  ClusterPricer(const ClusterProfile& p, const dist::DeviceMesh& mesh, bool bf16)
      : p_(p), mesh_(mesh), bf16_(bf16) {}
  double gemm(const GemmShape& s) const override { return p_.gemm_seconds(s, bf16_); }
  double op(const detail::DigestOp& v, const std::array<int64_t, 4>* q) const override {
    if (v.view) return 0;
    const double bytes = static_cast<double>(v.bytes) * (bf16_ ? 0.5 : 1);
    if (v.flops > 0 && q != nullptr) return attention(v, *q);
    return p_.memory_seconds(static_cast<int64_t>(bytes));
  }
  double comm(const CommRecord& r) const override {
    // Activations and their gradients travel in 16 bits under amp.
    const int64_t bytes = bf16_ ? r.bytes / 2 : r.bytes;
    if (r.kind == CommKind::kRecv) return p_.p2p_seconds(bytes, mesh_.stride(dist::MeshDim::kPp));
    const std::string kind =
        r.kind == CommKind::kAlltoall ? "alltoall" : std::string(comm_kind_name(r.kind));
    return p_.collective_seconds(kind, bytes, {r.group_size, stride_of(r.group)});
  }

 private:
  // The distance between a group's ranks, by the mesh dimension it is named after (dp x cp:
  // cp's neighbours, dp's groups of them contiguous above tp; the whole world: adjacent).
  int stride_of(const std::string& group) const {
    if (group == "dp_cp") return mesh_.stride(dist::MeshDim::kCp);
    for (const dist::MeshDim d : dist::kMeshDims) {
      if (group == dist::mesh_dim_name(d)) return mesh_.stride(d);
    }
    return 1;
  }
  // The attention core, its q (B, H, T, D) first among its inputs (cluster.hpp: fused, or
  // Megatron-LM 2021's materialized scores).
  double attention(const detail::DigestOp& v, const std::array<int64_t, 4>& q) const {
    const int64_t L = q[0] * q[1], T = q[2], D = q[3];
    const bool backward = v.phase == trace::Phase::kBackward;
    if (p_.attention == ClusterProfile::Attention::kFused) {
      const double rate = p_.peak_tflops(bf16_) * 1e12 * p_.gemm_efficiency_at({T, T, D});
      return static_cast<double>(v.flops) / rate + p_.kernel_overhead_s;
    }
    // Two batched products over the whole T x T scores forward, four backward, and the scores'
    // softmax and dropout passes in 16 bits.
    const double products =
        static_cast<double>(L) * (p_.gemm_seconds({T, T, D}, bf16_) - p_.kernel_overhead_s) +
        p_.kernel_overhead_s;
    const int64_t scores = L * T * T;
    return (backward ? 4 : 2) * products + p_.memory_seconds((backward ? 11 : 9) * scores);
  }

  const ClusterProfile& p_;
  dist::DeviceMesh mesh_;
  bool bf16_;
};

// The communication `op` makes its rank wait for, if any: a collective over more than one rank
// or a received message (a send is free: its receive waits for it).
const CommRecord* waited_for(const detail::OpsDigest& t, const detail::DigestOp& op) {
  if (op.gemm || op.comm < 0) return nullptr;
  const CommRecord& r = t.comms[op.comm];
  return r.group_size <= 1 || r.kind == CommKind::kSend ? nullptr : &r;
}

Times trace_times(const detail::OpsDigest& t, const Pricer& pricer) {
  Times out;
  for (const auto& g : detail::gemm_counts(t)) {
    const double s = pricer.gemm(g.shape);
    out.forward += static_cast<double>(g.forward) * s;
    out.backward += static_cast<double>(g.backward) * s;
  }
  for (const detail::DigestOp& op : t.ops) {
    const bool forward = op.phase == trace::Phase::kForward;
    (forward ? out.forward : out.backward) += pricer.per_op();
    if (op.gemm) continue;  // priced above, from gemm_counts
    if (op.comm >= 0) {
      if (const CommRecord* r = waited_for(t, op)) {
        (forward ? out.comm_forward : out.comm_backward) += pricer.comm(*r);
        out.waits += 1;
      }
      continue;
    }
    (forward ? out.forward : out.backward) +=
        pricer.op(op, op.attention >= 0 ? &t.attention_q[op.attention] : nullptr);
  }
  if (out.waits == 0 || !pricer.waits()) return out;
  // The waits, each after the trace's mean compute between two of them.
  const double gap = (out.forward + out.backward) / out.waits;
  for (const detail::DigestOp& op : t.ops) {
    if (const CommRecord* r = waited_for(t, op)) {
      (op.phase == trace::Phase::kForward ? out.comm_forward : out.comm_backward) +=
          pricer.wait(*r, gap);
    }
  }
  return out;
}

// A trace's times: on a cluster (`cluster` set) with each group placed by `mesh`, else at this
// machine's calibration and `comm_of`'s fits.
template <typename CommFor>
Times priced(const detail::OpsDigest& t, const ClusterProfile* cluster,
             const dist::DeviceMesh& mesh, bool bf16, const MachineCalibration& machine,
             const CommFor& comm_of) {
  if (cluster != nullptr) return trace_times(t, ClusterPricer(*cluster, mesh, bf16));
  return trace_times(t, MeasuredPricer<CommFor>(machine, comm_of));
}

}  // namespace

nlohmann::json TimePrediction::to_json() const {
  return {{"compute_s", compute_s},
          {"backward_s", backward_s},
          {"optimizer_s", optimizer_s},
          {"comm_s", comm_s},
          {"exposed_comm_s", exposed_comm_s},
          {"bubble_s", bubble_s},
          {"waits", waits},
          {"step_s", step_s}};
}

CostModel::CostModel(std::string model_type, nlohmann::json config, int64_t seq_len,
                     MachineCalibration machine, CommCalibration comm, double contention)
    : CostModel(trace::ModelRef::registry(std::move(model_type), std::move(config)), seq_len,
                std::move(machine), std::move(comm), contention) {}

CostModel::CostModel(trace::ModelRef model, int64_t seq_len, MachineCalibration machine,
                     CommCalibration comm, double contention)
    : model_(model),
      ranks_(std::make_shared<RankModels>(model, seq_len)),
      seq_len_(seq_len),
      machine_(std::move(machine)),
      comm_(std::move(comm)),
      contention_(contention) {
  ACC_CHECK(std::isfinite(contention) && contention >= 1.0,
            "CostModel: contention must be a finite factor >= 1, got ", contention);
}

CostModel::CostModel(trace::ModelRef model, int64_t seq_len, ClusterProfile cluster)
    : model_(model),
      ranks_(std::make_shared<RankModels>(model, seq_len)),
      seq_len_(seq_len),
      cluster_(std::move(cluster)) {}

std::vector<GemmShape> CostModel::shapes_to_measure(const std::string& model_type,
                                                    const nlohmann::json& config,
                                                    const std::vector<int64_t>& micro_batches,
                                                    int64_t seq_len) {
  return shapes_to_measure(trace::ModelRef::registry(model_type, config), micro_batches, seq_len);
}

std::vector<GemmShape> CostModel::shapes_to_measure(const trace::ModelRef& model,
                                                    const std::vector<int64_t>& micro_batches,
                                                    int64_t seq_len) {
  std::set<GemmShape> shapes;
  for (const int64_t b : micro_batches) {
    for (const auto& s : gemm_shapes(*shallow_trace(model, 1, b, seq_len, {}))) {
      shapes.insert(s);
    }
  }
  return {shapes.begin(), shapes.end()};
}

std::vector<GemmShape> CostModel::shapes_to_measure_for(
    const trace::ModelRef& model, const std::vector<const Candidate*>& candidates,
    int64_t seq_len) {
  std::map<std::string, std::pair<const Candidate*, std::set<int64_t>>> micro;
  for (const Candidate* c : candidates) {
    auto& [first, sizes] = micro[c->layout_key()];
    if (first == nullptr) first = c;
    sizes.insert(c->micro_batch);
  }
  std::set<GemmShape> shapes;
  for (const auto& [layout, of] : micro) {
    const std::vector<int64_t> batches(of.second.begin(), of.second.end());
    for (const RankModel& r : rank_models(model, *of.first, seq_len)) {
      for (const GemmShape& s : shapes_to_measure(r.model, batches, seq_len)) {
        shapes.insert(s);
      }
    }
  }
  return {shapes.begin(), shapes.end()};
}

void CostModel::share_rank_models(std::shared_ptr<RankModels> ranks) {
  ACC_CHECK_INTERNAL(ranks != nullptr, "CostModel::share_rank_models: no rank models");
  ACC_CHECK_INTERNAL(passes_.empty() && expected_.empty(),
                     "CostModel::share_rank_models: called after its first expect() or predict()");
  const trace::ModelRef& theirs = ranks->model();
  ACC_CHECK_INTERNAL(theirs.type() == model_.type() && theirs.config() == model_.config() &&
                         ranks->seq_len() == seq_len_,
                     "CostModel::share_rank_models: the rank models are of ", theirs.type(),
                     " at sequence length ", ranks->seq_len(), ", this model is ", model_.type(),
                     " at ", seq_len_);
  ranks_ = std::move(ranks);
}

void CostModel::add_group_calibration(CommCalibration comm) {
  const int size = comm.world;
  group_comm_[size] = std::move(comm);
}

const CommCalibration& CostModel::comm_for(int size) const {
  auto it = group_comm_.find(size);
  return it != group_comm_.end() ? it->second : comm_;
}

void CostModel::expect(const std::vector<Candidate>& candidates) {
  expect(pointers_to(candidates));
}

void CostModel::expect(const std::vector<const Candidate*>& candidates) {
  // Each pair's first rank model and the activation options its key was made of.
  struct Pair {
    const RankModel* rank = nullptr;
    trace::TraceOptions activations;
  };
  std::map<BatchPairKey, Pair> first;
  auto add = [&](const Candidate& c, const RankModel& r, const BatchPairKey& pair_key,
                 const trace::TraceOptions& activations) {
    expected_[{r.trace_id, pair_key.second}].try_emplace({c.micro_batch, c.mesh.dp}, c.mesh);
    if (first.count(pair_key) == 0) first.emplace(pair_key, Pair{&r, activations});
  };
  ranks_->for_each_rank(candidates,
                        [&](const Candidate& c, const RankModel& r, const BatchPairKey& pair_key) {
                          add(c, r, pair_key, rank_activation_options(c.effects, r));
                          // A pipeline's first and last ranks are also priced without
                          // recomputation, for its stages' ends (stage_ends: a search re-cuts each
                          // pipeline that fits).
                          if (c.mesh.pp > 1 && (r.first || r.last)) {
                            const trace::TraceOptions plain = end_options(c, r);
                            add(c, r, batch_pair_key(r.trace_key, plain), plain);
                          }
                        });
  // Each pair's passes made now, on the configured threads, as pass() makes them: grouped as
  // MemoryModel::expect groups its needs (the pairs of one shape_key on one thread, in order; a
  // module of the user's on one), so the traces made do not depend on the threads' timing. A pair
  // whose layout or depth the model refuses is left to predict, which says so.
  std::map<std::string, std::vector<const BatchPairKey*>> by_shape;
  for (const auto& [key, pair] : first) {
    by_shape[model_.is_registry() ? pair.rank->shape_key : ""].push_back(&key);
  }
  std::vector<const std::vector<const BatchPairKey*>*> jobs;
  for (const auto& [shape, keys] : by_shape) jobs.push_back(&keys);
  auto made = detail::made_ahead<MadePasses>(jobs, [&](const BatchPairKey* key, MadePasses& out) {
    const Pair& pair = first.at(*key);
    const int id = pair.rank->trace_id;
    const Asked asked = not_made(id, pair.activations, expected_.at({id, key->second}), false);
    if (asked.empty()) return;
    MadePasses m = make_passes(*pair.rank, pair.activations, asked, true);
    out.traced += m.traced;
    for (auto& p : m.passes) out.passes.push_back(std::move(p));
  });
  for (MadePasses& m : made) keep(std::move(m));
}

CostModel::Asked CostModel::not_made(int trace_id, const trace::TraceOptions& a,
                                     const Asked& expected, bool from_low) const {
  Asked out;
  std::set<PassKey> keys;  // a pass key once (off a cluster, every dp of a micro-batch shares one)
  for (const auto& [at, mesh] : expected) {
    if (from_low && at.first < trace::BatchTraces::kLow) continue;
    const PassKey key = pass_key(trace_id, mesh, at.first, a);
    if (passes_.count(key) != 0 || !keys.insert(key).second) continue;
    out.emplace(at, mesh);
  }
  return out;
}

CostModel::PassKey CostModel::pass_key(int trace_id, const dist::DeviceMesh& mesh,
                                       int64_t micro_batch, const trace::TraceOptions& a) const {
  // A cluster places the pp neighbours by the mesh's dp too (cluster.hpp).
  return {trace_id, cluster_ ? mesh.dp : 0, micro_batch, a.key_fields()};
}

CostModel::PassCost CostModel::extrapolated_pass(const detail::OpsDigest& t1,
                                                 const detail::OpsDigest& t2,
                                                 const detail::OpsDigest* r1, int64_t num_blocks,
                                                 const dist::DeviceMesh& mesh,
                                                 const trace::TraceOptions& a) const {
  auto comm_of = [this](int size) -> const CommCalibration& { return comm_for(size); };
  auto times = [&](const detail::OpsDigest& t) {
    return priced(t, cluster_ ? &*cluster_ : nullptr, mesh, a.bf16_activations, machine_, comm_of);
  };
  PassCost p;
  const Times c1 = times(t1), c2 = times(t2);
  Times rc;
  if (r1 != nullptr) {
    const Times r = times(*r1);
    rc = {r.forward - c1.forward, r.backward - c1.backward, r.comm_forward - c1.comm_forward,
          r.comm_backward - c1.comm_backward, r.waits - c1.waits};
  }
  p.num_blocks = num_blocks;
  const double L = static_cast<double>(p.num_blocks);
  const int64_t n_rc =
      a.recompute_blocks < 0 ? p.num_blocks : std::min(a.recompute_blocks, p.num_blocks);
  // More blocks never cost less than one: a pipeline rank's trace of one block may not hold all
  // of its stages (interleaved: one block for two virtual stages), and its messages then differ
  // from the two-block trace's, which made the step's communication negative.
  auto extrapolate = [&](double one, double two, double recomputed) {
    return std::max(one, one + (L - 1) * (two - one) + static_cast<double>(n_rc) * recomputed);
  };
  p.forward_s = extrapolate(c1.forward, c2.forward, rc.forward);
  p.backward_s = extrapolate(c1.backward, c2.backward, rc.backward);
  p.comm_forward_s = extrapolate(c1.comm_forward, c2.comm_forward, rc.comm_forward);
  p.comm_backward_s = extrapolate(c1.comm_backward, c2.comm_backward, rc.comm_backward);
  p.comm_waits = extrapolate(c1.waits, c2.waits, rc.waits);
  p.block_parameters = t2.num_parameters - t1.num_parameters;
  p.parameters = t1.num_parameters + (p.num_blocks - 1) * p.block_parameters;
  p.block_s = (c2.forward - c1.forward) + (c2.backward - c1.backward);
  return p;
}

CostModel::MadePasses CostModel::make_passes(const RankModel& rank, const trace::TraceOptions& a,
                                             const Asked& asked, bool paired) const {
  MadePasses out;
  // The model as the candidate's rank runs it (its stages, shards and tp / cp / pp messages).
  const trace::ModelRef& model = rank.model;
  auto comm_of = [this](int size) -> const CommCalibration& { return comm_for(size); };
  if (!model.extrapolates()) {
    // A module traced whole: its own figures, recomputation included.
    for (const auto& [at, mesh] : asked) {
      const auto whole = shallow_digest(model, 0, at.first, seq_len_, a);
      const detail::OpsDigest& t = detail::ops_of(whole);
      const Times c =
          priced(t, cluster_ ? &*cluster_ : nullptr, mesh, a.bf16_activations, machine_, comm_of);
      PassCost p;
      p.num_blocks = model.num_layers();
      p.forward_s = c.forward;
      p.backward_s = c.backward;
      p.comm_forward_s = c.comm_forward;
      p.comm_backward_s = c.comm_backward;
      p.comm_waits = c.waits;
      p.parameters = t.num_parameters;
      const auto groups = model.trace(p.num_blocks, 1, seq_len_, {}).blocks;
      p.block_parameters = groups.empty() ? 0 : groups.front().parameters_per_block;
      ++out.traced;
      out.passes.emplace_back(pass_key(rank.trace_id, mesh, at.first, a), p);
    }
    return out;
  }
  // cost(L, n) = base + L * block + n * recompute, from traces of 1 and 2 blocks (and one block
  // recomputed when the candidate recomputes any).
  trace::TraceOptions plain = a;
  plain.recompute = trace::Recompute::kNone;
  plain.recompute_blocks = 0;
  trace::TraceOptions first = a;
  first.recompute_blocks = 1;
  const bool recomputes = a.recompute != trace::Recompute::kNone && a.recompute_blocks != 0;
  constexpr int64_t kLow = trace::BatchTraces::kLow;
  bool from_pair = false;  // the asked micro-batches from kLow up made from one set of pairs
  if (asked.empty()) return out;
  if (paired && model.is_registry() && asked.rbegin()->first.first >= kLow) {
    // Every asked micro-batch from kLow up (and its dp) from the rank's traces at kLow and
    // kLow + 1 samples (trace::BatchTraces), when those follow the batch.
    auto pair = [&](int64_t depth, const trace::TraceOptions& o) {
      return detail::OpsDigestPair(shallow_digest(model, depth, kLow, seq_len_, o),
                                   shallow_digest(model, depth, kLow + 1, seq_len_, o));
    };
    detail::OpsDigestPair t1 = pair(1, plain), t2 = pair(2, plain);
    std::optional<detail::OpsDigestPair> r1;
    if (recomputes) r1 = pair(1, first);
    from_pair = t1.affine() && t2.affine() && (!r1 || r1->affine());
    if (from_pair) {
      ++out.traced;
      for (const auto& [at, mesh] : asked) {
        if (at.first < kLow) continue;
        out.passes.emplace_back(
            pass_key(rank.trace_id, mesh, at.first, a),
            extrapolated_pass(t1.at(at.first), t2.at(at.first), r1 ? &r1->at(at.first) : nullptr,
                              model.num_layers(), mesh, a));
      }
    }
  }
  for (const auto& [at, mesh] : asked) {
    if (from_pair && at.first >= kLow) continue;
    const auto t1 = shallow_digest(model, 1, at.first, seq_len_, plain);
    const auto t2 = shallow_digest(model, 2, at.first, seq_len_, plain);
    std::shared_ptr<const trace::TraceDigest> r1;
    if (recomputes) r1 = shallow_digest(model, 1, at.first, seq_len_, first);
    ++out.traced;
    out.passes.emplace_back(
        pass_key(rank.trace_id, mesh, at.first, a),
        extrapolated_pass(detail::ops_of(t1), detail::ops_of(t2),
                          r1 ? &detail::ops_of(r1) : nullptr, model.num_layers(), mesh, a));
  }
  return out;
}

void CostModel::keep(MadePasses made) {
  passes_traced_ += made.traced;
  for (auto& [key, p] : made.passes) passes_.try_emplace(std::move(key), p);
}

const CostModel::PassCost& CostModel::pass(const Candidate& cand, const RankModel& rank,
                                           const trace::TraceOptions& a) {
  const int id = rank.trace_id;
  const auto key = pass_key(id, cand.mesh, cand.micro_batch, a);
  if (auto it = passes_.find(key); it != passes_.end()) return it->second;
  // With the candidate expected, every expected micro-batch and dp of its rank's trace not made
  // yet, from one set of trace pairs; else its own alone.
  const auto expected = expected_.find({id, a.key_fields()});
  const bool paired = expected != expected_.end() && cand.micro_batch >= trace::BatchTraces::kLow &&
                      expected->second.count({cand.micro_batch, cand.mesh.dp}) != 0;
  keep(make_passes(rank, a,
                   paired ? not_made(id, a, expected->second, true)
                          : Asked{{{cand.micro_batch, cand.mesh.dp}, cand.mesh}},
                   paired));
  return passes_.at(key);
}

TimePrediction CostModel::predict(const Candidate& c) {
  const std::vector<RankModel>& ranks = ranks_->of(c);
  if (ranks.size() > 1) return predict_pipeline(c, ranks);
  const strategies::StepEffects& e = c.effects;
  const PassCost& p = pass(c, ranks.front(), activation_trace_options(e));
  TimePrediction t;
  const double k = static_cast<double>(e.micro_batches);
  t.compute_s = contention_ * k * (p.forward_s + p.backward_s);
  t.backward_s = contention_ * p.backward_s;
  // The layout's own communication (tp, cp): inside the forward and backward, waited for.
  const double layout_comm = k * (p.comm_forward_s + p.comm_backward_s);
  t.comm_s += layout_comm;
  t.exposed_comm_s += layout_comm;
  t.waits += k * p.comm_waits;
  add_data_parallel_comm(c, p, true, t);
  t.step_s = t.compute_s + t.optimizer_s + t.exposed_comm_s;
  return t;
}

trace::TraceOptions CostModel::end_options(const Candidate& c, const RankModel& r) {
  trace::TraceOptions plain = rank_activation_options(c.effects, r);
  plain.recompute = trace::Recompute::kNone;
  plain.recompute_blocks = 0;
  return plain;
}

std::optional<CostModel::StageEnds> CostModel::stage_ends(const Candidate& c) {
  const std::vector<RankModel>& ranks = ranks_->of(c);
  if (ranks.size() < 2) return std::nullopt;
  // What a rank computes beyond its blocks, in its blocks' time (without recomputation, which
  // costs per block).
  auto extra = [&](const RankModel& r) {
    const PassCost& p = pass(c, r, end_options(c, r));
    if (p.block_s <= 0) return 0.0;
    const double rest = p.forward_s + p.backward_s - static_cast<double>(p.num_blocks) * p.block_s;
    return std::max(0.0, rest / p.block_s);
  };
  StageEnds out;
  for (const RankModel& r : ranks) {
    if (r.first) out.first = extra(r);
    if (r.last) out.last = extra(r);
  }
  return out;
}

std::optional<std::vector<strategies::StageBlocks>> CostModel::balanced_stages(const Candidate& c) {
  const std::optional<StageEnds> ends = stage_ends(c);
  if (!ends) return std::nullopt;
  const std::vector<strategies::StageBlocks> own = stages_of(c);
  return strategies::balance_stages(own.back().end, static_cast<int>(own.size()), ends->first,
                                    ends->last);
}

std::vector<strategies::StageBlocks> CostModel::stages_of(const Candidate& c) {
  const std::vector<RankModel>& ranks = ranks_->of(c);
  if (ranks.size() < 2) return {};
  // Stage s is on rank s % p, the (s / p)-th of its stages.
  std::vector<strategies::StageBlocks> out;
  const size_t p = ranks.size();
  for (size_t s = 0; s < p * ranks.front().stages.size(); ++s) {
    out.push_back(ranks.at(s % p).stages.at(s / p));
  }
  return out;
}

std::optional<Recut> rebalanced_pipeline(const Candidate& c, CostModel& cost, MemoryModel& memory,
                                         int64_t budget, double margin) {
  std::optional<std::vector<strategies::StageBlocks>> balanced = cost.balanced_stages(c);
  if (!balanced) return std::nullopt;
  std::vector<strategies::StageBlocks> cut = std::move(*balanced);
  const std::vector<strategies::StageBlocks> own = cost.stages_of(c);
  const int64_t blocks = own.back().end;
  const int stages = static_cast<int>(own.size());
  const double last = cost.stage_ends(c)->last;  // priced once: the passes are cached
  while (cut != own) {
    Recut r{c, {}};
    r.candidate.set_strategy(strategies::with_pipeline_stages(c.strategy(), cut));
    r.memory = memory.predict(r.candidate);
    if (static_cast<double>(r.memory.peak) * (1 + margin) <= static_cast<double>(budget)) return r;
    // A block fewer on the first stage, the rest balanced over the later ones.
    const int64_t first = cut.front().end - 1;
    if (first < 1) break;
    const auto rest = strategies::balance_stages(blocks - first, stages - 1, 0.0, last);
    cut = {{0, first}};
    for (const auto& b : rest) cut.push_back({b.begin + first, b.end + first});
  }
  return std::nullopt;
}

void CostModel::set_time_slicing(double share) {
  ACC_CHECK(std::isfinite(share) && share <= contention_ * (1 + 1e-9),
            "CostModel::set_time_slicing: the share of a core must be finite and at most the "
            "contention (",
            contention_, "), got ", share);
  sliced_ = std::max(1.0, share);
}

TimePrediction CostModel::predict_pipeline(const Candidate& c,
                                           const std::vector<RankModel>& ranks) {
  const strategies::StepEffects& e = c.effects;
  const double m = static_cast<double>(e.micro_batches);
  const int v = static_cast<int>(ranks.front().stages.size());
  double slowest = 0, slowest_comm = 0, slowest_waits = 0;
  std::vector<double> per_rank;  // a micro-batch through each rank's stages
  // One action of each rank (one stage of its v), for the schedule run on time-sliced cores.
  std::vector<strategies::ActionCosts> actions;
  TimePrediction t;  // the optimizer and data-parallel reduction of the rank that takes longest
  double after_s = -1;
  for (const RankModel& r : ranks) {
    const PassCost& p = pass(c, r, rank_activation_options(e, r));
    // A micro-batch through the rank's stages, its messages included.
    const double comm = p.comm_forward_s + p.comm_backward_s;
    const double s = contention_ * (p.forward_s + p.backward_s) + comm;
    if (sliced_ > 1) {
      actions.push_back(
          {p.forward_s / v, p.backward_s / v, p.comm_forward_s / v, p.comm_backward_s / v});
    }
    if (s > slowest) {
      slowest = s;
      slowest_comm = comm;
      slowest_waits = p.comm_waits;
    }
    per_rank.push_back(s);
    TimePrediction after;
    add_data_parallel_comm(c, p, /*overlap=*/false, after);
    if (after.optimizer_s + after.exposed_comm_s > after_s) {
      after_s = after.optimizer_s + after.exposed_comm_s;
      t = after;
      t.backward_s = contention_ * p.backward_s;
    }
  }
  double schedule = 0;
  if (sliced_ > 1) {
    // Time-sliced cores (more ranks x threads than cores): the schedule run action by action,
    // each rank's compute slowed by the contention beyond slicing and by the share of the cores
    // that the ranks computing at that moment take (every pipeline of the mesh and every rank of
    // a stage's tp x cp group runs alike: n of the pp ranks computing is n / pp of the job's
    // ranks). Ranks idle in the fill and drain leave their cores to the others. 4 ranks on 2
    // cores, 2026-11-30: pipelines of 2 with 2 micro-batches were priced 1.3x their measured step
    // at the full contention; pipelines of 4 were priced 0.7-0.8 of it by the bound that this
    // replaced (the longer of the schedule at the contention beyond slicing and all ranks'
    // compute over the cores), which misses the steady state's ranks slowing each other.
    const double beyond = std::max(1.0, contention_ / sliced_);
    const double pp = static_cast<double>(ranks.size());
    const auto schedule_of = strategies::checked_schedule(
        e.pipeline_schedule, static_cast<int>(ranks.size()), v, e.micro_batches);
    schedule = strategies::simulated_schedule_time(*schedule_of, actions, [&](int computing) {
      return beyond * std::max(1.0, sliced_ * static_cast<double>(computing) / pp);
    });
  } else {
    schedule = strategies::schedule_time(per_rank, e.micro_batches, v);
  }
  double sum = 0;
  for (const double s : per_rank) sum += s;
  t.bubble_s = std::max(0.0, schedule - m * sum / static_cast<double>(ranks.size()));
  // The slowest rank's messages are waited for; the rest of the schedule is compute and idling.
  t.comm_s += m * slowest_comm;
  t.exposed_comm_s += m * slowest_comm;
  t.waits += m * slowest_waits;
  t.compute_s = schedule - m * slowest_comm;
  t.step_s = t.compute_s + t.optimizer_s + t.exposed_comm_s;
  return t;
}

void CostModel::set_optimizer_state_buffers(int buffers) {
  ACC_CHECK(buffers >= 0, "CostModel: optimizer state buffers must be >= 0, got ", buffers);
  optimizer_buffers_ = buffers;
}

void CostModel::add_data_parallel_comm(const Candidate& c, const PassCost& p, bool overlap,
                                       TimePrediction& t) const {
  const strategies::StepEffects& e = c.effects;
  const double k = static_cast<double>(e.micro_batches);
  const int W = c.data_parallel_ranks();
  // The dp x cp group: cp's neighbours (cluster.hpp); on this machine, the fits of its size.
  auto seconds = [&](const std::string& op, int64_t bytes) {
    if (cluster_) {
      return cluster_->collective_seconds(op, bytes, {W, c.mesh.stride(dist::MeshDim::kCp)});
    }
    const CommCalibration& fit = comm_for(W);
    return fit.seconds(op, bytes) + fit.wait_seconds(bytes);
  };
  const int64_t local = e.shard_optimizer_state ? (p.parameters + W - 1) / W : p.parameters;
  // p, g and each state buffer read; p and each buffer written (AdamW: 7 words a parameter).
  const int64_t words = 3 + 2 * static_cast<int64_t>(optimizer_buffers_);
  t.optimizer_s = cluster_ ? cluster_->memory_seconds(4 * words * local)
                           : contention_ * machine_.memory_seconds(4 * words * local);
  if (W > 1) {
    const int64_t comm_elem = e.bf16_communication ? 2 : 4;
    for (const auto& col : e.collectives) {
      using Of = strategies::StepEffects::Collective::Of;
      using When = strategies::StepEffects::Collective::When;
      if (col.when == When::kForward) {
        // A block's parameters (f32) gathered before its forward and its backward, per
        // micro-batch; the caller waits for each.
        const double n = k * 2.0 * static_cast<double>(p.num_blocks) + 1.0;
        const double s = n * seconds(col.op, p.block_parameters * 4);
        t.comm_s += s;
        t.exposed_comm_s += s;
        t.waits += n;
        continue;
      }
      const int64_t elem = col.of == Of::kGradients ? comm_elem : 4;
      const int64_t total = p.parameters * elem;
      // Messages: buckets (bucket_bytes counts f32 gradient bytes), else one per block and the
      // root unit (fsdp's reduce-scatter).
      int64_t messages = p.num_blocks + 1;
      if (e.bucket_bytes > 0) {
        const int64_t per_msg = std::max<int64_t>(1, e.bucket_bytes / 4 * elem);
        messages = std::max<int64_t>(1, (total + per_msg - 1) / per_msg);
      }
      const int64_t msg = (total + messages - 1) / messages;
      const double one = seconds(col.op, msg);
      const double s = static_cast<double>(messages) * one;
      t.comm_s += s;
      if (col.when == When::kBackward && overlap) {
        const double exposed = std::max(one, s - p.backward_s);  // the last is never hidden
        t.exposed_comm_s += exposed;
        t.waits += one > 0 ? exposed / one : 1.0;
      } else {
        t.exposed_comm_s += s;
        t.waits += static_cast<double>(messages);
      }
    }
  }
}

}  // namespace acc::search
