// zero1 and zero2: ZeRO stages 1 and 2 (Rajbhandari et al.). Parameters move into one flat buffer
// laid out like the gradient buckets; each rank owns chunk `rank` of every bucket (shard_range)
// and its optimizer updates only the parameter pieces inside its chunks (state: 1/world of the
// full optimizer state). After the step the updated chunks are all-gathered so every rank has the
// whole model again.
//   zero1: buckets are all-reduced; each rank reads its chunks of the averaged buckets.
//   zero2: buckets are reduce-scattered; each rank keeps only its chunks (1/world of gradients),
//          and each parameter's own gradient is freed as soon as it is copied into its bucket.
// Pieces are named after their parameters and carry their flat range in it (the placement
// table), so optimizer grouping and state stay keyed by parameter. Config: {"bucket_mb": 25}.

#include "acc/util/error.hpp"
#include "grad_sync.hpp"
#include "method.hpp"
#include "reducer.hpp"

namespace acc::strategies {
namespace {

class Zero : public GradSync {
 public:
  Zero(nn::Module& m, const dist::ParallelContext& ctx, int stage, const GradSyncOptions& o)
      : model_(m),
        group_(ctx.dp_cp_group()),
        stage_(stage),
        whole_(whole_placement(&ctx)),
        flat_where_(flat_placement(ctx)) {
    broadcast_model_state(model_, *group_);
    reducer_ = std::make_unique<BucketReducer>(
        model_.named_parameters(), group_, o.bucket_bytes,
        stage == 1 ? BucketReducer::Mode::kAllreduce : BucketReducer::Mode::kReduceScatter,
        o.bf16_communication, /*drop_param_grads=*/true);
    // Move the parameters into the flat buffer, in bucket layout.
    const BucketLayout& layout = reducer_->layout();
    flat_ = zeros({layout.total});
    NoGradGuard ng;
    for (const auto& bucket : layout.buckets) {
      for (const auto& slot : bucket.slots) {
        Tensor p = slot.param;
        Tensor dst = flat_.narrow(0, bucket.flat_offset + slot.offset, p.numel());
        dst.copy_(p.reshape({-1}));
        repoint(p, flat_.storage(), bucket.flat_offset + slot.offset);
      }
    }
    // This rank's pieces: the parts of parameters inside chunk `rank` of each bucket.
    const int W = group_->size(), r = group_->rank();
    for (size_t b = 0; b < layout.buckets.size(); ++b) {
      const auto& bucket = layout.buckets[b];
      for (const SlotShard& s : shards_of(bucket, W, r)) {
        ShardPiece piece;
        piece.name = s.slot->name;
        piece.shape = s.slot->param.shape();
        piece.range = s.in_param;
        piece.bucket = b;
        piece.in_bucket = s.slot->offset + s.in_param.offset;
        piece.in_chunk = s.in_chunk;
        piece.leaf = piece_of(flat_, bucket.flat_offset + piece.in_bucket, s.in_param.length);
        pieces_.push_back(std::move(piece));
      }
    }
    sort_by_model(pieces_, model_);
    attach_piece_grads();
  }

  ~Zero() override {
    reducer_.reset();  // removes the gradient hooks
    // Each parameter back into storage of its own, with its current values.
    for (auto& [name, p] : model_.named_parameters()) {
      Tensor t = p;
      repoint_to_own(t, t);
      t.set_grad(Tensor());
    }
  }

  void set_sync(bool sync) override {
    sync_ = sync;
    reducer_->set_sync(sync);
  }
  void finish_backward() override {
    if (!sync_) return;
    reducer_->finish();
    attach_piece_grads();
  }
  void sync_accumulated() override {
    set_sync(true);
    reducer_->sync_now();
    attach_piece_grads();
  }
  void end_step() override {
    // Every rank's updated chunks to everyone.
    const BucketLayout& layout = reducer_->layout();
    const int W = group_->size(), r = group_->rank();
    std::vector<dist::WorkPtr> works;
    NoGradGuard ng;
    for (const auto& bucket : layout.buckets) {
      const FlatRange chunk = dist::shard_range(bucket.padded, W, r);
      Tensor mine = flat_.narrow(0, bucket.flat_offset + chunk.offset, chunk.length);  // in place
      Tensor all = flat_.narrow(0, bucket.flat_offset, bucket.padded);
      works.push_back(group_->allgather(all, mine));
    }
    for (auto& w : works) w->wait();
  }
  std::vector<OptimPiece> optimizer_pieces() override { return optim_pieces(pieces_, flat_where_); }
  void add_placements(PlacementTable& table) const override {
    const BucketLayout& layout = reducer_->layout();
    for (const auto& [name, p] : model_.named_parameters()) {
      add_whole(table, name, p.shape(), p, TensorKind::kParameter, whole_);
      if (stage_ == 1) {  // the whole averaged gradient, a view of its bucket
        const size_t b = layout.bucket_of(name);
        int64_t offset = 0;
        for (const auto& slot : layout.buckets[b].slots) {
          if (slot.name == name) offset = slot.offset;
        }
        add_whole(table, name, p.shape(), reducer_->bucket_grad(b).narrow(0, offset, p.numel()),
                  TensorKind::kGradient, whole_);
      }
    }
    if (stage_ == 2) {  // this rank's pieces of the gradients
      for (const ShardPiece& piece : pieces_) {
        add_piece(table, piece, TensorKind::kGradient, piece.leaf.grad(), flat_where_);
      }
    }
  }

 private:
  // Piece gradients are views of the reducer's buffers (re-attached after every backward, as an
  // optimizer's zero_grad may have dropped them).
  void attach_piece_grads() {
    for (ShardPiece& p : pieces_) {
      Tensor g = stage_ == 1
                     ? reducer_->bucket_grad(p.bucket).narrow(0, p.in_bucket, p.range.length)
                     : reducer_->chunk_grad(p.bucket).narrow(0, p.in_chunk, p.range.length);
      p.leaf.set_grad(g);
    }
  }

  nn::Module& model_;
  dist::ProcessGroupPtr group_;  // the context's dp x cp group
  int stage_;
  WholePlacement whole_;       // parameters (and zero1's gradients): whole on every rank
  WholePlacement flat_where_;  // pieces: split over the dp x cp group
  std::unique_ptr<BucketReducer> reducer_;
  Tensor flat_;
  std::vector<ShardPiece> pieces_;
};

MethodSpec zero_method(int stage) {
  const std::string name = "zero" + std::to_string(stage);
  return {.name = name,
          .slot = "grad_sync",
          .exclusive_slot = true,
          .config_keys = {"bucket_mb"},
          .apply =
              [name, stage](const nlohmann::json& c, TrainingPlan& plan) {
                plan.grad_sync_method = name;
                plan.sync_options.bucket_bytes = bucket_bytes_from(name, c);
                plan.grad_sync = [stage](nn::Module& m, const dist::ParallelContext& ctx,
                                         const GradSyncOptions& o) {
                  return make_zero(m, ctx, stage, o);
                };
              },
          .needs_ranks = true,
          .search_choices = bucket_choices,
          .effects =
              [name, stage](const nlohmann::json& c, const SearchContext&, StepEffects& e) {
                // zero1: gradients all-reduced in full buckets; zero2: reduce-scattered, each rank
                // keeping its chunk (at most two full buckets in flight). Both: optimizer state
                // sharded, updated parameters all-gathered after the step.
                e.bucket_bytes = bucket_bytes_from(name, c);
                e.shard_optimizer_state = true;
                e.shard_gradients = stage == 2;
                e.gradient_buckets = stage == 1;
                e.buckets_take_gradients = stage == 1;
                e.parameter_copies_after_step = stage == 2 ? 2 : 0;  // measured: zero1's stays
                                                                     // under its backward peak
                if (stage == 2) e.buckets_in_flight = 2;
                e.collectives.push_back({stage == 1 ? "allreduce" : "reduce_scatter",
                                         StepEffects::Collective::Of::kGradients,
                                         StepEffects::Collective::When::kBackward});
                e.collectives.push_back({"allgather", StepEffects::Collective::Of::kParameters,
                                         StepEffects::Collective::When::kAfterStep});
              }};
}

}  // namespace

std::unique_ptr<GradSync> make_zero(nn::Module& model, const dist::ParallelContext& ctx, int stage,
                                    const GradSyncOptions& o) {
  ACC_CHECK(stage == 1 || stage == 2, "zero: stage must be 1 or 2, got ", stage);
  return std::make_unique<Zero>(model, ctx, stage, o);
}

MethodSpec zero1_method() {
  return zero_method(1);
}
MethodSpec zero2_method() {
  return zero_method(2);
}

}  // namespace acc::strategies
