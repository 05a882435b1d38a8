// The Trainer runs a training plan (method.hpp) and names no method: model transforms, then the
// gradient synchronisation the plan asks for (or the local one), the optimizer over the pieces
// this rank updates, and the step schedule.

#include <cmath>
#include <iterator>
#include <map>
#include <set>
#include <utility>

#include "acc/autograd/ops.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/language_model.hpp"
#include "acc/optim/clip_grad.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/util/error.hpp"
#include "acc/util/progress.hpp"
#include "grad_sync.hpp"
#include "method.hpp"
#include "pipeline.hpp"

namespace acc::strategies {

struct Trainer::Impl {
  TrainingPlan plan;
  std::vector<Undo> undos;  // of the model transforms, in the order they were applied
  std::unique_ptr<GradSync> sync;
  std::vector<OptimPiece> pieces;

  // The GradSync's parameter and gradient entries, then `more` (optimizer state written in the
  // same local terms), in global terms: tensor-parallel shards as boxes of their parameters
  // (lift_layouts). What the norm, full_parameters() and placements() read.
  PlacementTable global_placements(const dist::ParallelContext* ctx,
                                   PlacementTable more = {}) const {
    PlacementTable table;
    sync->add_placements(table);
    table.insert(table.end(), std::make_move_iterator(more.begin()),
                 std::make_move_iterator(more.end()));
    table = lift_layouts(std::move(table), *plan.layouts, ctx);
    if (plan.pipeline) plan.pipeline->lift(table);
    return table;
  }

  // Pipeline stages hold different parameters: the norm and full_parameters() gather over the
  // world even when every tensor a rank holds is whole.
  bool pipelined(const dist::ParallelContext* ctx) const {
    return plan.pipeline && ctx && ctx->size(dist::MeshDim::kPp) > 1;
  }

  // The global batch's loss from this rank's mean over its micro-batches: under a pipeline only
  // the last stage computed it (the others hold 0), so it is summed over pp first; then it is
  // averaged over the ranks that read different data.
  double global_loss(const dist::ParallelContext* ctx, double local) const {
    const bool over_pp = pipelined(ctx);
    const bool over_dp = ctx && ctx->dp_cp_group()->size() > 1;
    if (!over_pp && !over_dp) return local;
    Tensor t = from_vector(std::vector<float>{static_cast<float>(local)}, {1});
    if (over_pp) ctx->group(dist::MeshDim::kPp)->allreduce(t, dist::ReduceOp::kSum)->wait();
    if (over_dp) ctx->dp_cp_group()->allreduce(t, dist::ReduceOp::kAvg)->wait();
    return t.item();
  }

  // Everything the plan did to the model, undone in reverse.
  void teardown() {
    pieces.clear();
    sync.reset();
    nn::undo_all(std::exchange(undos, {}))();
  }
};

namespace {

// The context a Trainer runs on: the one given (its mesh must be the strategy's); else the
// strategy's mesh (mesh_for: tp from tensor_parallel, dp the rest) over the group given, or over
// the world when acc::dist is initialised; else none (one process without MPI).
dist::ParallelContextPtr context_of(const ApplyOptions& o, const Strategy& strategy) {
  if (o.context) {
    ACC_CHECK(!o.group || o.group == o.context->world(),
              "apply: give a context or a group, not both (the group '", o.group->name(),
              "' is not the context's world '", o.context->world()->name(), "')");
    const dist::DeviceMesh want = mesh_for(strategy, o.context->world_size());
    const dist::DeviceMesh& have = o.context->mesh();
    // The dimensions the strategy's methods own must be theirs; a context may add others the
    // strategy leaves alone (ranks along them hold replicas: mesh_test's replicated tp).
    ACC_CHECK((want.tp == 1 || have.tp == want.tp) && (want.cp == 1 || have.cp == want.cp) &&
                  (want.pp == 1 || have.pp == want.pp),
              "apply: the strategy ", describe(strategy), " runs on mesh ", want.to_string(),
              ", the context given has ", have.to_string());
    return o.context;
  }
  dist::ProcessGroupPtr group = o.group;
  if (!group && dist::is_initialized()) group = dist::ProcessGroup::world();
  if (!group) {
    const dist::DeviceMesh mesh = mesh_for(strategy, 1);
    (void)mesh;  // one process: every size must be 1 (mesh_for names the one that is not)
    return nullptr;
  }
  const dist::DeviceMesh mesh = mesh_for(strategy, group->size());
  if (mesh.dp == group->size()) return dist::ParallelContext::data_parallel(group);
  return std::make_shared<const dist::ParallelContext>(mesh, group);
}

// The optimizer over this rank's pieces. The factory's grouping sees the whole parameters (their
// real shapes); each group then gets this rank's pieces of its parameters, under the same names
// and options. A factory without a grouping of its own gets the pieces.
std::unique_ptr<optim::Optimizer> build_optimizer(const optim::OptimizerFactory& factory,
                                                  std::vector<optim::ParamGroup> groups,
                                                  const std::vector<OptimPiece>& pieces) {
  if (!factory.has_grouping()) {
    NamedTensors params;
    for (const auto& p : pieces) params.emplace_back(p.name, p.leaf);
    return factory(std::move(params));
  }
  std::multimap<std::string, const OptimPiece*> by_name;
  for (const auto& p : pieces) by_name.emplace(p.name, &p);
  std::vector<optim::ParamGroup> local;
  for (auto& g : groups) {
    NamedTensors mine;
    for (const auto& [name, whole] : g.params) {
      auto [lo, hi] = by_name.equal_range(name);
      for (auto it = lo; it != hi; ++it) mine.emplace_back(name, it->second->leaf);
    }
    if (mine.empty()) continue;
    g.params = std::move(mine);
    local.push_back(std::move(g));
  }
  return factory.build(std::move(local));
}

// The loss a Trainer minimises: the one given, else a language model's next-token loss.
LossFn loss_of(const ApplyOptions& o, const nn::Module& model) {
  if (o.loss) return o.loss;
  ACC_CHECK(dynamic_cast<const models::LanguageModel*>(&model) != nullptr, "apply: the model (",
            model.type_name(),
            ") is not a language model, so it has no loss of its own: give ApplyOptions::loss, a "
            "function (Module&, const Batch&) -> its mean loss");
  return language_model_loss();
}

// What ranks must agree on about the model: a language model's type and config; any other
// module's class (its parameter shapes are compared beside it).
nlohmann::json model_facts(const nn::Module& model) {
  if (const auto* lm = dynamic_cast<const models::LanguageModel*>(&model)) {
    return {{"type", lm->model_type()}, {"config", lm->config_json()}};
  }
  return {{"type", model.type_name()}};
}

}  // namespace

LossFn language_model_loss() {
  return [](nn::Module& m, const data::Batch& batch) {
    auto* lm = dynamic_cast<models::LanguageModel*>(&m);
    ACC_CHECK_AS(TypeError, lm != nullptr, "language_model_loss: the model (", m.type_name(),
                 ") is not a models::LanguageModel");
    return lm->loss(batch.idx(), batch.targets());
  };
}

Trainer::Trainer(nn::ModulePtr model, optim::OptimizerFactory factory, Strategy strategy,
                 ApplyOptions options)
    : model_(std::move(model)),
      strategy_(std::move(strategy)),
      options_(std::move(options)),
      impl_(std::make_unique<Impl>()) {
  ACC_CHECK(model_ != nullptr, "apply: model is null");
  ACC_CHECK(static_cast<bool>(factory), "apply: optimizer factory is empty");
  ACC_CHECK(options_.grad_clip >= 0, "apply: grad_clip must be >= 0, got ", options_.grad_clip);
  context_ = context_of(options_, strategy_);
  if (context_ && context_->world_size() > 1) check_ranks_agree();
  impl_->plan = make_plan(strategy_, context_, loss_of(options_, *model_), options_.sample_batch,
                          /*default_loss=*/!options_.loss);
  const TrainingPlan& plan = impl_->plan;
  micro_batches_ = plan.micro_batches;
  // Ranks that differ along dp or cp train on different data: without a data-parallel method
  // their replicas would drift apart. (Ranks along tp or pp without a method of theirs hold
  // replicas that compute the same thing on the same data.)
  const int dp_cp = context_ ? context_->dp_cp_group()->size() : 1;
  ACC_CHECK(dp_cp == 1 || plan.grad_sync, "apply: ", dp_cp,
            " data-parallel ranks (dp x cp of mesh ", context_ ? context_->mesh().to_string() : "",
            ") but no data-parallel method in the strategy (add ddp, zero1, zero2 or fsdp)");
  // Groups of whole parameters, before any method reshapes them into pieces.
  std::vector<optim::ParamGroup> groups;
  if (factory.has_grouping()) groups = factory.group(model_->named_parameters());

  // Undone while unwinding when anything below throws (the destructor does not run then).
  struct Rollback {
    Impl* impl;
    bool armed = true;
    ~Rollback() {
      if (armed) impl->teardown();
    }
  } rollback{impl_.get()};
  for (const auto& t : plan.model_transforms) impl_->undos.push_back(t.apply(*model_));
  impl_->sync = plan.grad_sync && context_ ? plan.grad_sync(*model_, *context_, plan.sync_options)
                                           : make_local(*model_, context_.get());
  impl_->pieces = impl_->sync->optimizer_pieces();
  optimizer_ = build_optimizer(factory, std::move(groups), impl_->pieces);
  rollback.armed = false;
}

void Trainer::check_ranks_agree() {
  nlohmann::json parameters = nlohmann::json::object();
  for (const auto& [name, p] : model_->named_parameters()) parameters[name] = p.shape();
  const nlohmann::json facts = {{"model", model_facts(*model_)},
                                {"parameters", parameters},
                                {"strategy", to_json(strategy_)},
                                {"grad_clip", options_.grad_clip},
                                {"run", options_.agreement}};
  dist::check_agreement(*context_->world(), facts);
}

Trainer::~Trainer() {
  optimizer_.reset();  // holds the pieces
  impl_->teardown();
}

double Trainer::train_step(const data::Batch& batch) {
  ACC_CHECK(losses_in_step_ == 0, "train_step: a plain-loop step is open (loss() called ",
            losses_in_step_, " time(s) since the last step())");
  ACC_CHECK(batch.size() >= 1, "train_step: the batch has no samples (", batch.describe(), ")");
  if (impl_->plan.pipeline) return pipeline_step(batch);
  const std::vector<data::Batch> parts =
      batch.split(micro_batches_, "train_step (micro-batches: grad_accum steps)");
  double loss_sum = 0;
  for (int i = 0; i < micro_batches_; ++i) {
    Tensor l;
    try {
      l = loss(parts[static_cast<size_t>(i)]);
    } catch (...) {
      // Nothing of this micro-batch reached the gradient synchronisation (its forward failed or
      // its loss was refused): the step is abandoned and the next train_step starts afresh.
      losses_in_step_ = 0;
      throw;
    }
    loss_sum += l.item();
    Tensor scaled = micro_batches_ > 1 ? scale(l, 1.0 / micro_batches_) : l;
    progress::phase(progress::Phase::kBackward);
    scaled.backward();
  }
  step();
  return impl_->global_loss(context_.get(), loss_sum / micro_batches_);
}

// The pipeline's step: its schedule runs every micro-batch's forward and backward through this
// rank's stages with the gradient synchronisation off; then the tied embedding's two copies sum
// their gradients, the data-parallel method reduces what accumulated, and the update runs as in
// the plain loop.
double Trainer::pipeline_step(const data::Batch& batch) {
  Pipeline& pipe = *impl_->plan.pipeline;
  GradSync& sync = *impl_->sync;
  model_->zero_grad();
  sync.begin_step();
  sync.set_sync(false);
  const double loss_sum = pipe.run(batch);
  pipe.reduce_tied_gradient(*model_);
  sync.sync_accumulated();
  update();
  return impl_->global_loss(context_.get(), loss_sum / pipe.micro_batches());
}

Tensor Trainer::loss(const Tensor& idx, const Tensor& targets) {
  return loss(data::Batch(idx, targets));
}

Tensor Trainer::loss(const data::Batch& micro_batch) {
  ACC_CHECK(!impl_->plan.pipeline,
            "Trainer::loss: the plain loop cannot run pipeline_parallel's schedule (each rank "
            "holds only its stages): call train_step(batch), which runs it");
  ACC_CHECK(losses_in_step_ < micro_batches_, "Trainer::loss: call ", losses_in_step_ + 1,
            " in one step, but the strategy accumulates ", micro_batches_,
            " micro-batch(es) per step: call step() after the last one's backward");
  GradSync& sync = *impl_->sync;
  if (losses_in_step_ == 0) {
    model_->zero_grad();
    sync.begin_step();
  }
  sync.set_sync(losses_in_step_ + 1 == micro_batches_);
  ++losses_in_step_;
  progress::phase(progress::Phase::kForward);
  Tensor l = impl_->plan.loss(*model_, micro_batch);
  ACC_CHECK(l.defined(), "Trainer::loss: the loss function returned an undefined tensor (batch ",
            micro_batch.describe(), ")");
  ACC_CHECK_AS(ShapeError, l.numel() == 1,
               "Trainer::loss: the loss function must return the mean "
               "loss, one element, but returned shape ",
               l.shape(), " (batch ", micro_batch.describe(), "): reduce it, e.g. with mean()");
  ACC_CHECK_AS(TypeError, l.dtype() == DType::kFloat32, "Trainer::loss: the loss must be f32, got ",
               dtype_name(l.dtype()));
  ACC_CHECK(l.requires_grad(),
            "Trainer::loss: the loss does not depend on any parameter that "
            "requires grad (computed under NoGradGuard, or detached?)");
  return l;
}

void Trainer::step() {
  ACC_CHECK(losses_in_step_ == micro_batches_, "Trainer::step: ", losses_in_step_,
            " loss() call(s) in this step, the strategy accumulates ", micro_batches_,
            " micro-batch(es) per step (grad_accum)");
  losses_in_step_ = 0;
  update();
}

void Trainer::update() {
  progress::phase(progress::Phase::kUpdate);
  for (const auto& fn : std::exchange(before_update_, {})) fn();
  GradSync& sync = *impl_->sync;
  sync.finish_backward();
  sum_partial_gradients();

  // Global gradient norm from the placement table, each element counted once: when every rank
  // holds every gradient whole (replicas along dp, tp, ...), each sums its own copy; otherwise the
  // pieces of replica 0 are summed over the world (a tensor replicated along tp is then counted
  // by its tp-rank-0 copy only, not tp times).
  const PlacementTable grads = impl_->global_placements(context_.get());
  const bool sharded =
      dist::any_sharded(grads, TensorKind::kGradient) || impl_->pipelined(context_.get());
  double norm_sq = 0;
  for (const auto& e : grads) {
    if (e.kind != TensorKind::kGradient || !e.local.defined() || (sharded && e.replica != 0)) {
      continue;
    }
    Tensor c = e.local.contiguous();
    norm_sq += kernels::sum_squares(c.data<float>(), c.numel());
  }
  if (sharded && context_ && context_->world_size() > 1) {
    Tensor t = from_vector(std::vector<float>{static_cast<float>(norm_sq)}, {1});
    // f32 is enough for a norm; summed in the world's reduction order.
    context_->world()->allreduce(t, dist::ReduceOp::kSum)->wait();
    norm_sq = t.item();
  }
  last_grad_norm_ = std::sqrt(norm_sq);
  // Clipping is fused into the update: the same update as scaling the gradients first.
  optimizer_->step_scaled(
      options_.grad_clip > 0 ? optim::clip_coefficient(options_.grad_clip, last_grad_norm_) : 1.0);
  sync.end_step();
}

// Megatron sequence parallelism leaves the replicated parameters inside the blocks with a
// partial gradient on each tp rank (its chunk of the sequence): summed over tp here, after the
// data-parallel reduction (both are sums, so the order does not matter) and before anything reads
// them. Every GradSync lays the tp ranks' local tensors out alike (their shapes are equal), so
// each rank's piece of such a gradient meets the same piece on its tp peers.
void Trainer::sum_partial_gradients() {
  const std::vector<std::string>& partial = *impl_->plan.partial_over_tp;
  if (partial.empty() || !context_ || context_->size(dist::MeshDim::kTp) == 1) return;
  const std::set<std::string> names(partial.begin(), partial.end());
  PlacementTable table;
  impl_->sync->add_placements(table);
  std::vector<dist::WorkPtr> works;
  for (auto& e : table) {
    if (e.kind != TensorKind::kGradient || !names.count(e.param) || !e.local.defined()) continue;
    ACC_CHECK_AS(InternalError, e.local.is_contiguous(), "sequence_parallel: the gradient of '",
                 e.name, "' is not contiguous, so it cannot be summed over tp in place");
    works.push_back(context_->group(dist::MeshDim::kTp)->allreduce(e.local, dist::ReduceOp::kSum));
  }
  for (auto& w : works) w->wait();
}

std::vector<dist::ProcessGroupPtr> Trainer::method_groups() const {
  std::vector<dist::ProcessGroupPtr> out;
  if (impl_->plan.pipeline && impl_->plan.pipeline->embedding_group()) {
    out.push_back(impl_->plan.pipeline->embedding_group());
  }
  return out;
}

void Trainer::before_next_update(std::function<void()> fn) {
  before_update_.push_back(std::move(fn));
}

PlacementTable Trainer::placements() const {
  PlacementTable state_entries;
  std::map<std::string, Shape> shapes;
  for (const auto& [name, p] : model_->named_parameters()) shapes[name] = p.shape();
  std::map<std::string, Tensor> state;
  for (const auto& [key, t] : optimizer_->state_dict()) state[key] = t;
  for (const auto& piece : impl_->pieces) {
    const std::string prefix = "state." + piece.name + ".";
    for (auto it = state.lower_bound(prefix); it != state.end() && it->first.rfind(prefix, 0) == 0;
         ++it) {
      const std::string field = it->first.substr(prefix.size());
      if (field == "step" || field.find('.') != std::string::npos) continue;
      PlacementEntry e;
      e.name = it->first;
      e.param = piece.name;
      e.kind = TensorKind::kOptimizerState;
      e.field = field;
      e.global_shape = shapes.at(piece.name);
      e.dtype = it->second.dtype();
      e.spec = piece.spec;
      e.box = dist::Box::whole(e.global_shape);
      if (piece.range.length != numel_of(e.global_shape)) e.flat = piece.range;
      e.replica = piece.replica;
      e.replicas = piece.replicas;
      e.local = it->second;
      state_entries.push_back(std::move(e));
    }
  }
  return impl_->global_placements(context_.get(), std::move(state_entries));
}

MemoryReport Trainer::memory_report() const {
  MemoryReport r;
  for (const auto& e : placements()) {
    if (!e.local.defined()) continue;
    const auto bytes = static_cast<int64_t>(e.local.nbytes());
    if (e.kind == TensorKind::kParameter) r.parameters += bytes;
    if (e.kind == TensorKind::kGradient) r.gradients += bytes;
  }
  for (const auto& [k, t] : optimizer_->state_dict()) r.optimizer_state += t.nbytes();
  r.peak_gathered_parameters = impl_->sync->peak_gathered_bytes();
  return r;
}

// From the placement table: when every rank holds every parameter whole, they are this rank's own
// tensors; otherwise each rank writes the pieces of replica 0 it holds into zeroed full buffers
// and one sum over the world assembles them (the pieces are disjoint, so the sum adds zeros only
// and is exact).
std::vector<std::pair<std::string, Tensor>> Trainer::full_parameters() {
  const PlacementTable table = impl_->global_placements(context_.get());
  const bool partial =
      dist::any_sharded(table, TensorKind::kParameter) || impl_->pipelined(context_.get());
  // The whole model's parameters and their global shapes: a tensor-parallel shard's local tensor
  // is smaller (its layout has the global shape; a rank whose fsdp chunks hold none of a parameter
  // has no entry of it), and a pipeline stage holds only its own (the pipeline recorded them all).
  std::vector<std::pair<std::string, Shape>> shapes;
  if (impl_->plan.pipeline && !impl_->plan.pipeline->whole_parameters().empty()) {
    shapes = impl_->plan.pipeline->whole_parameters();
  } else {
    for (const auto& [name, p] : model_->named_parameters()) shapes.emplace_back(name, p.shape());
  }
  const ParamLayouts& layouts = *impl_->plan.layouts;
  for (auto& [name, shape] : shapes) {
    auto it = layouts.find(name);
    if (it != layouts.end()) shape = it->second.global_shape;
  }
  std::vector<std::pair<std::string, Tensor>> out;
  if (!partial) {
    for (const auto& [name, shape] : shapes) {
      for (const auto& e : table) {
        if (e.kind == TensorKind::kParameter && e.name == name) out.emplace_back(name, e.local);
      }
    }
    return out;
  }
  std::map<std::string, int64_t> offset;
  int64_t total = 0;
  for (const auto& [name, shape] : shapes) {
    offset[name] = total;
    total += numel_of(shape);
  }
  NoGradGuard ng;
  Tensor flat = zeros({total});
  for (const auto& e : table) {
    if (e.kind != TensorKind::kParameter || e.replica != 0 || e.held_numel() == 0) continue;
    const Tensor held = e.local.reshape({-1});
    for (const auto& [run, at] : e.global_runs()) {
      flat.narrow(0, offset.at(e.name) + run.offset, run.length)
          .copy_(held.narrow(0, at, run.length));
    }
  }
  if (context_ && context_->world_size() > 1) {
    context_->world()->allreduce(flat, dist::ReduceOp::kSum)->wait();
  }
  for (const auto& [name, shape] : shapes) {
    out.emplace_back(name, flat.narrow(0, offset.at(name), numel_of(shape)).view(shape));
  }
  return out;
}

std::unique_ptr<Trainer> apply(nn::ModulePtr model, optim::OptimizerFactory factory,
                               const Strategy& strategy, ApplyOptions options) {
  return std::make_unique<Trainer>(std::move(model), std::move(factory), strategy,
                                   std::move(options));
}

}  // namespace acc::strategies
