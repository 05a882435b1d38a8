#include <cmath>

#include "acc/autograd/ops.hpp"
#include "acc/dist/dist.hpp"
#include "acc/optim/clip_grad.hpp"
#include "acc/util/error.hpp"
#include "data_parallel.hpp"
#include "methods.hpp"

namespace acc::strategies {

Plan make_plan(const Strategy& s);

namespace {

dist::ProcessGroupPtr default_group() {
  return dist::is_initialized() ? dist::ProcessGroup::world() : nullptr;
}

}  // namespace

Trainer::Trainer(models::LanguageModelPtr model, optim::OptimizerFactory factory, Strategy strategy,
                 ApplyOptions options)
    : model_(std::move(model)), strategy_(std::move(strategy)), options_(std::move(options)) {
  ACC_CHECK(model_ != nullptr, "apply: model is null");
  ACC_CHECK(static_cast<bool>(factory), "apply: optimizer factory is empty");
  ACC_CHECK(options_.grad_clip >= 0, "apply: grad_clip must be >= 0, got ", options_.grad_clip);
  const Plan plan = make_plan(strategy_);
  group_ = options_.group ? options_.group : default_group();
  grad_accum_ = plan.grad_accum;
  amp_ = plan.amp;
  if (amp_) install_amp(*model_);
  const bool multi = group_ && group_->size() > 1;
  if (plan.data_parallel == "local" || !group_) {
    ACC_CHECK(!multi, "apply: ", group_->size(),
              " ranks but no data-parallel method in the strategy (add ddp, zero1, zero2 or fsdp)");
    dp_ = make_local(*model_);
  } else if (plan.data_parallel == "ddp") {
    dp_ = make_ddp(*model_, group_, plan.dp_options);
  } else if (plan.data_parallel == "zero1") {
    dp_ = make_zero(*model_, group_, 1, plan.dp_options);
  } else if (plan.data_parallel == "zero2") {
    dp_ = make_zero(*model_, group_, 2, plan.dp_options);
  } else {
    dp_ = make_fsdp(*model_, group_, plan.dp_options);
  }
  optimizer_ = dp_->make_optimizer(factory);
}

Trainer::~Trainer() = default;

double Trainer::train_step(const data::Batch& batch) {
  const int64_t B = batch.idx.size(0);
  ACC_CHECK(B % grad_accum_ == 0, "train_step: batch of ", B, " sequences does not split into ",
            grad_accum_, " micro-batches (grad_accum steps)");
  const int64_t mb = B / grad_accum_;
  model_->zero_grad();
  dp_->begin_step();
  double loss_sum = 0;
  const bool skip = options_.benchmark_skip_gradient_sync;
  dp_->set_benchmark_skip(skip);
  for (int i = 0; i < grad_accum_; ++i) {
    dp_->set_sync(!skip && i + 1 == grad_accum_);
    Tensor idx = batch.idx.narrow(0, i * mb, mb);
    Tensor tgt = batch.targets.narrow(0, i * mb, mb);
    Tensor loss = model_->loss(idx, tgt);
    loss_sum += loss.item();
    Tensor scaled = grad_accum_ > 1 ? scale(loss, 1.0 / grad_accum_) : loss;
    scaled.backward();
  }
  dp_->finish_backward();
  // Global gradient norm (sharded gradients: sum of squares over the ranks).
  double norm_sq = dp_->local_grad_norm_sq();
  if (dp_->grads_sharded() && group_ && !skip) {
    Tensor t = from_vector(std::vector<float>{static_cast<float>(norm_sq)}, {1});
    // f32 is enough for a norm; summed in the group's reduction order.
    group_->allreduce(t, dist::ReduceOp::kSum)->wait();
    norm_sq = t.item();
  }
  last_grad_norm_ = std::sqrt(norm_sq);
  // Clipping is fused into the update: the same update as scaling the gradients first.
  optimizer_->step_scaled(
      options_.grad_clip > 0 ? optim::clip_coefficient(options_.grad_clip, last_grad_norm_) : 1.0);
  if (!skip) dp_->end_step();
  double loss = loss_sum / grad_accum_;
  if (group_ && group_->size() > 1) {
    Tensor t = from_vector(std::vector<float>{static_cast<float>(loss)}, {1});
    group_->allreduce(t, dist::ReduceOp::kAvg)->wait();
    loss = t.item();
  }
  return loss;
}

MemoryReport Trainer::memory_report() const {
  return dp_->memory_report();
}

std::vector<std::pair<std::string, Tensor>> Trainer::full_parameters() {
  return dp_->full_parameters();
}

std::unique_ptr<Trainer> apply(models::LanguageModelPtr model, optim::OptimizerFactory factory,
                               const Strategy& strategy, ApplyOptions options) {
  return std::make_unique<Trainer>(std::move(model), std::move(factory), strategy,
                                   std::move(options));
}

}  // namespace acc::strategies
