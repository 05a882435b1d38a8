// ddp: every rank keeps the whole model and optimizer; gradients are averaged in buckets that are
// all-reduced while backward is still running (BucketReducer), so communication overlaps compute.
// Config: {"bucket_mb": 25}.

#include "acc/util/error.hpp"
#include "grad_sync.hpp"
#include "method.hpp"
#include "reducer.hpp"

namespace acc::strategies {
namespace {

class Ddp : public GradSync {
 public:
  Ddp(nn::Module& m, const dist::ParallelContext& ctx, const GradSyncOptions& o)
      : model_(m), group_(ctx.dp_cp_group()), where_(whole_placement(&ctx)) {
    broadcast_model_state(model_, *group_);
    reducer_ = std::make_unique<BucketReducer>(model_.named_parameters(), group_, o.bucket_bytes,
                                               BucketReducer::Mode::kAllreduce,
                                               o.bf16_communication, /*drop_param_grads=*/false);
  }
  ~Ddp() override {
    reducer_.reset();    // its hooks go with it
    model_.zero_grad();  // the gradients are views of the reducer's buckets
  }
  void set_sync(bool sync) override {
    sync_ = sync;
    reducer_->set_sync(sync);
  }
  void finish_backward() override {
    if (sync_) reducer_->finish();
  }
  void sync_accumulated() override {
    set_sync(true);
    reducer_->sync_now();
  }
  std::vector<OptimPiece> optimizer_pieces() override { return whole_pieces(model_, where_); }
  void add_placements(PlacementTable& table) const override {
    add_whole_params_and_grads(table, model_, where_);
  }

 private:
  nn::Module& model_;
  dist::ProcessGroupPtr group_;  // the context's dp x cp group
  WholePlacement where_;
  std::unique_ptr<BucketReducer> reducer_;
};

}  // namespace

std::unique_ptr<GradSync> make_ddp(nn::Module& model, const dist::ParallelContext& ctx,
                                   const GradSyncOptions& o) {
  return std::make_unique<Ddp>(model, ctx, o);
}

MethodSpec ddp_method() {
  return {.name = "ddp",
          .slot = "grad_sync",
          .exclusive_slot = true,
          .config_keys = {"bucket_mb"},
          .apply =
              [](const nlohmann::json& c, TrainingPlan& plan) {
                plan.grad_sync_method = "ddp";
                plan.sync_options.bucket_bytes = bucket_bytes_from("ddp", c);
                plan.grad_sync = make_ddp;
              },
          .needs_ranks = true,
          .search_choices = bucket_choices,
          .effects =
              [](const nlohmann::json& c, const SearchContext&, StepEffects& e) {
                // Gradients accumulate in full padded buckets (kept) and are all-reduced bucket by
                // bucket while backward runs.
                e.bucket_bytes = bucket_bytes_from("ddp", c);
                e.gradient_buckets = true;
                e.collectives.push_back({"allreduce", StepEffects::Collective::Of::kGradients,
                                         StepEffects::Collective::When::kBackward});
              }};
}

}  // namespace acc::strategies
