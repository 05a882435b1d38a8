// ZeRO stages 1 and 2 (Rajbhandari et al.), shared by zero1.cpp and zero2.cpp. Parameters move
// into one flat buffer laid out like the gradient buckets; each rank owns chunk `rank` of every
// bucket and its optimizer updates only the parameter pieces inside its chunks (state: 1/world of
// the full optimizer state). After the step the updated chunks are all-gathered so every rank has
// the whole model again.
//   stage 1: buckets are all-reduced; each rank reads its chunks of the averaged buckets.
//   stage 2: buckets are reduce-scattered; each rank keeps only its chunks (1/world of gradients),
//            and each parameter's own gradient is freed as soon as it is copied into its bucket.
// Pieces are named after their parameters, so optimizer state stays addressable by name.

#include <cstring>

#include "acc/tensor/kernels.hpp"
#include "acc/util/error.hpp"
#include "data_parallel.hpp"
#include "reducer.hpp"

namespace acc::strategies {

void broadcast_model_state(models::LanguageModel& model, dist::ProcessGroup& group);

namespace {

class Zero : public DataParallel {
 public:
  Zero(models::LanguageModel& m, dist::ProcessGroupPtr g, int stage, const DataParallelOptions& o)
      : model_(m), group_(std::move(g)), stage_(stage) {
    broadcast_model_state(model_, *group_);
    const NamedParams params = model_.named_parameters();
    reducer_ = std::make_unique<BucketReducer>(
        params, group_, o.bucket_bytes,
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
      const int64_t cb = bucket.padded / W, c0 = r * cb, c1 = c0 + cb;
      for (const auto& slot : bucket.slots) {
        const int64_t s0 = std::max(slot.offset, c0);
        const int64_t s1 = std::min(slot.offset + slot.param.numel(), c1);
        if (s1 <= s0) continue;
        pieces_.emplace_back(slot.name, piece_of(flat_, bucket.flat_offset + s0, s1 - s0));
        piece_grad_.push_back({b, s0, s1 - s0});
      }
    }
  }

  std::unique_ptr<optim::Optimizer> make_optimizer(const optim::OptimizerFactory& f) override {
    attach_piece_grads();
    auto opt = f(pieces_);
    opt_ = opt.get();
    return opt;
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
  bool grads_sharded() const override { return stage_ == 2; }
  double local_grad_norm_sq() override {
    double s = 0;
    for (size_t b = 0; b < reducer_->layout().buckets.size(); ++b) {
      const Tensor& g = stage_ == 1 ? reducer_->bucket_grad(b) : reducer_->chunk_grad(b);
      s += kernels::sum_squares(g.data<float>(), g.numel());
    }
    return s;
  }
  void end_step() override {
    // Every rank's updated chunks to everyone.
    const BucketLayout& layout = reducer_->layout();
    const int W = group_->size(), r = group_->rank();
    std::vector<dist::WorkPtr> works;
    NoGradGuard ng;
    for (const auto& bucket : layout.buckets) {
      const int64_t cb = bucket.padded / W;
      Tensor mine = flat_.narrow(0, bucket.flat_offset + r * cb, cb);  // in place
      Tensor all = flat_.narrow(0, bucket.flat_offset, bucket.padded);
      works.push_back(group_->allgather(all, mine));
    }
    for (auto& w : works) w->wait();
  }
  MemoryReport memory_report() const override {
    MemoryReport r;
    r.parameters = static_cast<int64_t>(flat_.nbytes());
    for (size_t b = 0; b < reducer_->layout().buckets.size(); ++b) {
      r.gradients += static_cast<int64_t>(
          (stage_ == 1 ? reducer_->bucket_grad(b) : reducer_->chunk_grad(b)).nbytes());
    }
    if (opt_) r.optimizer_state = optimizer_state_bytes(*opt_);
    return r;
  }
  NamedParams full_parameters() override { return model_.named_parameters(); }

 private:
  // Piece gradients are views of the reducer's buffers (re-attached after every backward, as an
  // optimizer's zero_grad may have dropped them).
  void attach_piece_grads() {
    const int64_t cb_div = group_->size();
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const auto& [b, s0, n] = piece_grad_[i];
      Tensor g;
      if (stage_ == 1) {
        g = reducer_->bucket_grad(b).narrow(0, s0, n);
      } else {
        const int64_t cb = reducer_->layout().buckets[b].padded / cb_div;
        g = reducer_->chunk_grad(b).narrow(0, s0 - group_->rank() * cb, n);
      }
      pieces_[i].second.set_grad(g);
    }
  }

  struct PieceGrad {
    size_t bucket;
    int64_t start;  // within the bucket
    int64_t n;
  };
  models::LanguageModel& model_;
  dist::ProcessGroupPtr group_;
  int stage_;
  std::unique_ptr<BucketReducer> reducer_;
  Tensor flat_;
  NamedParams pieces_;
  std::vector<PieceGrad> piece_grad_;
  optim::Optimizer* opt_ = nullptr;
};

}  // namespace

std::unique_ptr<DataParallel> make_zero(models::LanguageModel& model, dist::ProcessGroupPtr group,
                                        int stage, const DataParallelOptions& o) {
  ACC_CHECK(stage == 1 || stage == 2, "zero: stage must be 1 or 2, got ", stage);
  return std::make_unique<Zero>(model, std::move(group), stage, o);
}

}  // namespace acc::strategies
