// fsdp (ZeRO-3): parameters, gradients and optimizer state all sharded over the data-parallel
// ranks. The sharding units are the modules the config names, else the model's repeated blocks
// (found from the module tree, as the tracer finds them), plus one root unit for everything else
// (embeddings, final norm). Each rank keeps chunk `rank` of every unit's flat parameters. A block's
// parameters are all-gathered just before its forward and freed right after it; gathered again when
// backward reaches the block (a pre-hook on the block output's backward node) and freed once all
// its gradients are accumulated, which is also when they are reduce-scattered into this rank's
// gradient chunk. So at most one gathered block (plus the root unit, gathered for the whole step)
// is resident. At most kReducesInFlight reduce-scatters run at once: before the next starts, the
// oldest is waited for, so the gradient buffers in flight are bounded however far this rank runs
// ahead of the others (ranks that share cores lag each other by whole blocks; unbounded, a rank
// ahead held every block's gradient buffer until the end of backward: +28% peak at 4 ranks on 2
// cores). PyTorch's FSDP2 bounds its reduce-scatters the same way. Destroying it gathers every unit
// once more and gives each parameter storage of its own (see ~Fsdp). Config: {"units": [...]}: the
// modules to shard by (a ModuleList for its children; strategies/common.cpp unit_names), else the
// repeated blocks; a model with neither is one unit. A parameter shared between units is refused by
// name.

#include <algorithm>
#include <deque>
#include <exception>

#include "acc/autograd/engine.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "grad_sync.hpp"
#include "method.hpp"

namespace acc::strategies {
namespace {

struct Unit {
  std::string name;
  nn::ModulePtr module;  // null for the root unit
  BucketLayout layout;   // one bucket: the unit's flat parameters
  Tensor shard;          // this rank's chunk of the flat parameters
  Tensor grad_shard;     // this rank's chunk of the averaged gradients
  Tensor full;           // the gathered flat parameters (defined while gathered)
  int ready = 0;
  bool reduced = false;
  dist::WorkPtr reduce_work;
  Tensor reduce_in;   // the packed gradients being reduced, held until the reduction is waited for
  Tensor reduce_out;  // where the reduction lands (a bf16 buffer when amp)

  Unit(std::string n, nn::ModulePtr m, const NamedTensors& params, int world)
      : name(std::move(n)), module(std::move(m)), layout(params, world, int64_t{1} << 62) {}
  const BucketLayout::Bucket& bucket() const { return layout.buckets.at(0); }
};

// One reduce-scatter may still run while the next block's backward computes (the overlap); the
// next block's waits for it. The memory model counts the buffers this allows
// (search::MemoryModel::predict, trace::BlockwiseGradients).
//
// Decision: a reduction's input lives until it is waited for here, on the training thread, not
// until the communication thread sees it complete. Freed on completion, whether it was alive at
// the next block's backward peak depended on how fast the peers were that step: the peak of fsdp
// with every block recomputed under Ulysses at 4 ranks on 2 cores moved by 5-15 % between runs
// of the same candidate (the all-to-alls of the recomputed forward drive the reduction to
// completion, or do not). Now the step's peak is the same in every run and is what the model
// predicts, and a budget set from it holds whatever the peers' speed. PyTorch's FSDP2 frees its
// reduce-scatter input at the same point (the next reduce-scatter's wait).
constexpr size_t kReducesInFlight = 1;

struct FsdpState : BackwardRounds<FsdpState> {
  dist::ProcessGroupPtr group;
  bool bf16 = false;
  bool sync = true;
  std::vector<std::unique_ptr<Unit>> units;  // blocks first, the root unit last
  std::deque<Unit*> reducing;                // reduce-scatters in flight, oldest first
  // Released parameters point at a meta storage: any use outside a gathered window (e.g. a forward
  // outside Trainer::train_step) fails with a device error naming the op, never reads freed memory.
  std::shared_ptr<Storage> released = std::make_shared<Storage>(0, Device::kMeta);
  int64_t gathered_bytes = 0, peak_gathered_bytes = 0;

  Unit& root() { return *units.back(); }

  void gather(Unit& u) {
    if (u.full.defined()) return;
    NoGradGuard ng;
    u.full = empty({u.bucket().padded});
    group->allgather(u.full, u.shard)->wait();
    for (const auto& slot : u.bucket().slots) {
      Tensor p = slot.param;
      repoint(p, u.full.storage(), slot.offset);
    }
    gathered_bytes += static_cast<int64_t>(u.full.nbytes());
    peak_gathered_bytes = std::max(peak_gathered_bytes, gathered_bytes);
  }

  void release(Unit& u) {
    if (!u.full.defined()) return;
    for (const auto& slot : u.bucket().slots) {
      Tensor p = slot.param;
      repoint(p, released, 0);
    }
    gathered_bytes -= static_cast<int64_t>(u.full.nbytes());
    u.full = Tensor();
  }

  void reset_round() {
    for (auto& u : units) {
      u->ready = 0;
      u->reduced = false;
    }
  }

  // A unit whose gradients are all made is reduce-scattered; in a micro-batch that does not
  // synchronise (gradient accumulation) its whole gradients stay, and a block's gathered
  // parameters are freed all the same (as PyTorch's FSDP reshards after backward under no_sync):
  // one gathered block at a time in every micro-batch.
  void on_ready(size_t unit) {
    start_round();
    Unit& u = *units[unit];
    if (u.reduced) return;
    if (++u.ready < static_cast<int>(u.bucket().slots.size())) return;
    if (sync) {
      reduce(u);
    } else if (u.module) {
      u.reduced = true;
      release(u);
    }
  }

  // The unit's gradients into one buffer, reduce-scattered into this rank's chunk; the unit's
  // gathered parameters and full gradients are freed (the root unit's parameters stay gathered
  // until the step's backward is over).
  void reduce(Unit& u) {
    NoGradGuard ng;
    u.reduced = true;
    while (reducing.size() >= kReducesInFlight) complete_oldest();
    Tensor buf = empty({u.bucket().padded});
    pack_bucket_grads(u.bucket(), buf.data<float>(), 1.0f / static_cast<float>(group->size()),
                      /*drop_grads=*/true);
    // The full buffer is only the reduction's input, held until complete_oldest (see
    // kReducesInFlight).
    u.reduce_in = bf16 ? buf.to(DType::kBFloat16) : buf;
    buf = Tensor();
    u.reduce_out = bf16 ? empty(u.grad_shard.shape(), {DType::kBFloat16}) : u.grad_shard;
    u.reduce_work = group->reduce_scatter(u.reduce_out, u.reduce_in, dist::ReduceOp::kSum);
    reducing.push_back(&u);
    if (u.module) release(u);
  }

  // Waits for the oldest reduce-scatter in flight, frees its input buffer and moves its result
  // into the gradient chunk. A wait that throws leaves the buffers held: the Work may still be
  // reading them.
  void complete_oldest() {
    NoGradGuard ng;
    Unit& u = *reducing.front();
    reducing.pop_front();
    u.reduce_work->wait();
    if (bf16) u.grad_shard.copy_(u.reduce_out);
    u.reduce_work.reset();
    u.reduce_in = Tensor();
    u.reduce_out = Tensor();
  }

  void finish() {
    if (!round_active) return;
    if (!sync) {  // the root stays gathered for the next micro-batch
      end_round();
      return;
    }
    for (auto& u : units) {
      if (!u->reduced) reduce(*u);
    }
    while (!reducing.empty()) complete_oldest();
    release(root());
    end_round();
  }
};

class Fsdp : public GradSync {
 public:
  Fsdp(nn::Module& m, const dist::ParallelContext& ctx, const GradSyncOptions& o,
       const nlohmann::json& config)
      : model_(m), state_(std::make_shared<FsdpState>()), where_(flat_placement(ctx)) {
    state_->group = ctx.dp_cp_group();
    state_->bf16 = o.bf16_communication;
    const int W = state_->group->size(), r = state_->group->rank();

    // Units: the blocks (named in the config, else the repeated blocks; none: the model is one
    // unit), then the root (every parameter not inside a block). Resolved, and each parameter
    // found in exactly one unit, before anything of the model changes.
    const std::vector<std::string> block_names = unit_names(model_, config, "fsdp");
    NamedTensors rest;
    std::vector<NamedTensors> unit_params(block_names.size());
    for (const auto& [name, p] : model_.named_parameters()) {
      size_t unit = block_names.size();
      for (size_t i = 0; i < block_names.size() && unit == block_names.size(); ++i) {
        if (name.rfind(block_names[i] + ".", 0) == 0) unit = i;
      }
      (unit < block_names.size() ? unit_params[unit] : rest).emplace_back(name, p);
    }
    // A parameter shared between units (a block instance used twice, a weight tied across units)
    // is listed once by the model, under its first name: a unit that holds it under another would
    // shard it twice and train one copy only.
    for (size_t i = 0; i < block_names.size(); ++i) {
      for (const auto& [n, held] : model_.submodule(block_names[i])->named_parameters()) {
        const Tensor& p = held;  // a structured binding cannot be captured (clang < 16)
        const bool own = std::any_of(unit_params[i].begin(), unit_params[i].end(),
                                     [&](const auto& e) { return e.second.is_same(p); });
        if (own) continue;
        std::string first = "?";
        for (const auto& [name, q] : model_.named_parameters()) {
          if (q.is_same(p)) first = name;
        }
        ACC_THROW(ValueError, "fsdp: parameter '", block_names[i], ".", n, "' of unit '",
                  block_names[i], "' is also '", first,
                  "' (shared with another unit or the root): fsdp shards each parameter in one "
                  "unit; name units that share no parameter (\"units\")");
      }
    }
    broadcast_model_state(model_, *state_->group);
    for (size_t i = 0; i < block_names.size(); ++i) {
      state_->units.push_back(std::make_unique<Unit>(
          block_names[i], model_.submodule(block_names[i]), unit_params[i], W));
    }
    state_->units.push_back(std::make_unique<Unit>("<root>", nullptr, rest, W));

    // Shards from the current (identical) full parameters; then free the full parameters.
    NoGradGuard ng;
    for (auto& u : state_->units) {
      const FlatRange chunk = dist::shard_range(u->bucket().padded, W, r);
      Tensor full = zeros({u->bucket().padded});
      for (const auto& slot : u->bucket().slots) {
        full.narrow(0, slot.offset, slot.param.numel()).copy_(slot.param.reshape({-1}));
      }
      u->shard = full.narrow(0, chunk.offset, chunk.length).clone();
      u->grad_shard = zeros({chunk.length});
      for (const SlotShard& sh : shards_of(u->bucket(), W, r)) {
        ShardPiece piece;
        piece.name = sh.slot->name;
        piece.shape = sh.slot->param.shape();
        piece.range = sh.in_param;
        piece.in_chunk = sh.in_chunk;
        piece.leaf = piece_of(u->shard, sh.in_chunk, sh.in_param.length);
        piece.grad = u->grad_shard.narrow(0, sh.in_chunk, sh.in_param.length);
        pieces_.push_back(std::move(piece));
      }
      for (const auto& slot : u->bucket().slots) {
        Tensor p = slot.param;
        repoint(p, state_->released, 0);
      }
    }
    sort_by_model(pieces_, model_);
    attach_piece_grads();

    // Hooks: gather before a block's forward, free after it; gather again when backward reaches
    // it; reduce-scatter and free once its gradients are complete.
    std::weak_ptr<FsdpState> weak = state_;
    for (size_t i = 0; i < state_->units.size(); ++i) {
      Unit& u = *state_->units[i];
      for (const auto& slot : u.bucket().slots) {
        param_hooks_.add(slot.param, [weak, i](Tensor&) {
          if (auto s = weak.lock()) s->on_ready(i);
        });
      }
      if (!u.module) continue;
      const int pre = u.module->register_forward_pre_hook([weak, i](nn::Module&, const Tensor&) {
        if (auto s = weak.lock()) s->gather(*s->units[i]);
      });
      const int post =
          u.module->register_forward_hook([weak, i](nn::Module&, const Tensor&, const Tensor& out) {
            auto s = weak.lock();
            if (!s) return;
            if (out.requires_grad() && out.grad_fn()) {
              out.grad_fn()->add_pre_hook([weak, i](const std::vector<Tensor>&) {
                if (auto st = weak.lock()) st->gather(*st->units[i]);
              });
            }
            s->release(*s->units[i]);
          });
      module_hooks_.push_back({u.module, {pre, post}});
    }
  }

  // Undoes the sharding: every unit gathered (a collective, so every rank must destroy its
  // Trainer) and each parameter given storage of its own. While an exception unwinds, another
  // rank may never reach this gather, so nothing is gathered and the parameters stay released
  // (any use fails with a device error naming the op, never a hang or a stale value).
  ~Fsdp() override {
    param_hooks_.remove_all();
    for (auto& [module, ids] : module_hooks_) {
      for (int id : ids) module->remove_hook(id);
    }
    if (std::uncaught_exceptions() > 0) return;
    try {
      for (auto& u : state_->units) {
        state_->gather(*u);
        for (const auto& slot : u->bucket().slots) {
          Tensor p = slot.param;
          repoint_to_own(p, u->full.narrow(0, slot.offset, p.numel()));
          p.set_grad(Tensor());
        }
        u->full = Tensor();
      }
    } catch (const Error& e) {
      logging::error("fsdp: could not gather the parameters back into the model: {}", e.what());
    }
  }

  void begin_step() override { state_->gather(state_->root()); }
  void set_sync(bool sync) override {
    sync_ = sync;
    state_->sync = sync;
  }
  void finish_backward() override {
    if (!sync_) return;
    state_->finish();
    attach_piece_grads();
  }
  std::vector<OptimPiece> optimizer_pieces() override { return optim_pieces(pieces_, where_); }
  void add_placements(PlacementTable& table) const override {
    for (const ShardPiece& p : pieces_) {
      add_piece(table, p, TensorKind::kParameter, p.leaf, where_);
      add_piece(table, p, TensorKind::kGradient, p.grad, where_);
    }
  }
  int64_t peak_gathered_bytes() const override { return state_->peak_gathered_bytes; }

 private:
  void attach_piece_grads() {
    for (ShardPiece& p : pieces_) p.leaf.set_grad(p.grad);
  }

  nn::Module& model_;
  std::shared_ptr<FsdpState> state_;
  WholePlacement where_;  // parameters, gradients and state split over the dp x cp group
  std::vector<ShardPiece> pieces_;
  ParamHooks param_hooks_;
  std::vector<std::pair<nn::ModulePtr, std::vector<int>>> module_hooks_;
};

}  // namespace

std::unique_ptr<GradSync> make_fsdp(nn::Module& model, const dist::ParallelContext& ctx,
                                    const GradSyncOptions& o, const nlohmann::json& config) {
  return std::make_unique<Fsdp>(model, ctx, o, config);
}

MethodSpec fsdp_method() {
  return {.name = "fsdp",
          .slot = "grad_sync",
          .exclusive_slot = true,
          .config_keys = {"units"},
          .apply =
              [](const nlohmann::json& c, TrainingPlan& plan) {
                check_units_config(c, "fsdp");
                plan.grad_sync_method = "fsdp";
                plan.grad_sync = [c](nn::Module& m, const dist::ParallelContext& ctx,
                                     const GradSyncOptions& o) { return make_fsdp(m, ctx, o, c); };
              },
          .needs_ranks = true,
          .search_choices =
              [](const SearchContext&) {
                return std::vector<nlohmann::json>{nlohmann::json::object()};
              },
          .effects =
              [](const nlohmann::json&, const SearchContext&, StepEffects& e) {
                // Parameters, gradients and optimizer state sharded; each block's parameters are
                // gathered for its forward and again for its backward (the root unit stays gathered
                // for the step), gradients reduce-scattered block by block.
                e.shard_parameters = e.shard_gradients = e.shard_optimizer_state = true;
                e.gathered_blocks = 2;
                e.collectives.push_back({"allgather", StepEffects::Collective::Of::kParameters,
                                         StepEffects::Collective::When::kForward});
                e.collectives.push_back({"reduce_scatter", StepEffects::Collective::Of::kGradients,
                                         StepEffects::Collective::When::kBackward});
              }};
}

}  // namespace acc::strategies
