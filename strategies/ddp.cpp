// ddp: every rank keeps the whole model and optimizer; gradients are averaged in buckets that are
// all-reduced while backward is still running (BucketReducer), so communication overlaps compute.
// Config: {"bucket_mb": 25}.

#include "acc/tensor/kernels.hpp"
#include "data_parallel.hpp"
#include "methods.hpp"

#include "acc/util/error.hpp"
#include "reducer.hpp"

namespace acc::strategies {
namespace {

/// Rank 0's parameters and buffers on every rank, so that all replicas start identical.
void broadcast_state(models::LanguageModel& model, dist::ProcessGroup& group) {
  std::vector<dist::WorkPtr> works;
  NoGradGuard ng;
  for (auto& [name, t] : model.state_dict()) {
    Tensor x = t;
    works.push_back(group.broadcast(x, 0));
  }
  for (auto& w : works) w->wait();
}

class Ddp : public DataParallel {
 public:
  Ddp(models::LanguageModel& m, dist::ProcessGroupPtr g, const DataParallelOptions& o)
      : model_(m), group_(std::move(g)) {
    broadcast_state(model_, *group_);
    reducer_ = std::make_unique<BucketReducer>(model_.named_parameters(), group_, o.bucket_bytes,
                                               BucketReducer::Mode::kAllreduce,
                                               o.bf16_communication, /*drop_param_grads=*/false);
  }
  std::unique_ptr<optim::Optimizer> make_optimizer(const optim::OptimizerFactory& f) override {
    auto opt = f(model_.named_parameters());
    opt_ = opt.get();
    return opt;
  }
  void set_sync(bool sync) override {
    sync_ = sync;
    reducer_->set_sync(sync);
  }
  void finish_backward() override {
    if (sync_) reducer_->finish();
  }
  double local_grad_norm_sq() override {
    double s = 0;
    for (size_t b = 0; b < reducer_->layout().buckets.size(); ++b) {
      const Tensor& g = reducer_->bucket_grad(b);
      s += kernels::sum_squares(g.data<float>(), g.numel());
    }
    return s;
  }
  MemoryReport memory_report() const override {
    MemoryReport r;
    for (const auto& [n, p] : model_.named_parameters()) r.parameters += p.nbytes();
    for (size_t b = 0; b < reducer_->layout().buckets.size(); ++b) {
      r.gradients += reducer_->bucket_grad(b).nbytes();
    }
    if (opt_) r.optimizer_state = optimizer_state_bytes(*opt_);
    return r;
  }
  NamedParams full_parameters() override { return model_.named_parameters(); }

 private:
  models::LanguageModel& model_;
  dist::ProcessGroupPtr group_;
  std::unique_ptr<BucketReducer> reducer_;
  optim::Optimizer* opt_ = nullptr;
};

}  // namespace

std::unique_ptr<DataParallel> make_ddp(models::LanguageModel& model, dist::ProcessGroupPtr group,
                                       const DataParallelOptions& o) {
  return std::make_unique<Ddp>(model, std::move(group), o);
}

void broadcast_model_state(models::LanguageModel& model, dist::ProcessGroup& group) {
  broadcast_state(model, group);
}

MethodSpec ddp_method() {
  return {"ddp", "data_parallel", [](const nlohmann::json& c, Plan& plan) {
            check_keys("ddp", c, {"bucket_mb"});
            plan.data_parallel = "ddp";
            plan.dp_options.bucket_bytes = bucket_bytes_from("ddp", c);
          }};
}

}  // namespace acc::strategies
