// Pieces shared by the data-parallel strategies, and the local (single-rank) one.

#include <algorithm>
#include <cstring>

#include "acc/tensor/kernels.hpp"
#include "acc/util/error.hpp"
#include "data_parallel.hpp"

namespace acc::strategies {

double grad_norm_sq(const NamedParams& params) {
  double s = 0;
  for (const auto& [name, p] : params) {
    Tensor g = p.grad();
    if (!g.defined() || g.is_meta()) continue;
    Tensor c = g.contiguous();
    s += kernels::sum_squares(c.data<float>(), c.numel());
  }
  return s;
}

int64_t optimizer_state_bytes(const optim::Optimizer& opt) {
  int64_t b = 0;
  for (const auto& [k, t] : opt.state_dict()) b += static_cast<int64_t>(t.nbytes());
  return b;
}

BucketLayout::BucketLayout(const NamedParams& params, int world, int64_t bucket_bytes) {
  ACC_CHECK(bucket_bytes > 0, "bucket size must be > 0 bytes, got ", bucket_bytes);
  Bucket cur;
  auto close = [&] {
    if (cur.slots.empty()) return;
    cur.padded = (cur.numel + world - 1) / world * world;
    cur.flat_offset = total;
    total += cur.padded;
    for (const auto& s : cur.slots) index.emplace_back(s.name, buckets.size());
    buckets.push_back(std::move(cur));
    cur = Bucket();
  };
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const int64_t n = it->second.numel();
    if (!cur.slots.empty() && (cur.numel + n) * 4 > bucket_bytes) close();
    cur.slots.push_back({it->first, it->second, cur.numel});
    cur.numel += n;
  }
  close();
}

size_t BucketLayout::bucket_of(const std::string& name) const {
  for (const auto& [n, b] : index) {
    if (n == name) return b;
  }
  ACC_THROW(InternalError, "bucket layout: no parameter '", name, "'");
}

void pack_bucket_grads(const BucketLayout::Bucket& bucket, float* dst, float scale,
                       bool drop_grads) {
  for (const auto& slot : bucket.slots) {
    Tensor p = slot.param;
    const int64_t n = p.numel();
    float* out = dst + slot.offset;
    Tensor g = p.grad();
    if (!g.defined()) {
      std::memset(out, 0, static_cast<size_t>(n) * sizeof(float));
    } else {
      Tensor gc = g.contiguous();
      const float* src = gc.data<float>();
      if (scale == 1.0f) {
        std::memcpy(out, src, static_cast<size_t>(n) * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = src[i] * scale;
      }
    }
    if (drop_grads) p.set_grad(Tensor());
  }
  const int64_t tail = bucket.padded - bucket.numel;
  if (tail > 0) std::memset(dst + bucket.numel, 0, static_cast<size_t>(tail) * sizeof(float));
}

void repoint(Tensor& param, const std::shared_ptr<Storage>& storage, int64_t offset) {
  TensorImpl* impl = param.impl();
  impl->storage = storage;
  impl->offset = offset;
  impl->strides = contiguous_strides(impl->shape);
}

Tensor piece_of(const Tensor& base, int64_t start, int64_t n) {
  Tensor p = make_view(base, {n}, {1}, base.offset() + start);
  p.set_requires_grad(true);
  return p;
}

namespace {

// One rank, nothing to synchronise.
class Local : public DataParallel {
 public:
  explicit Local(models::LanguageModel& m) : model_(m) {}
  std::unique_ptr<optim::Optimizer> make_optimizer(const optim::OptimizerFactory& f) override {
    auto opt = f(model_.named_parameters());
    opt_ = opt.get();
    return opt;
  }
  double local_grad_norm_sq() override { return grad_norm_sq(model_.named_parameters()); }
  MemoryReport memory_report() const override {
    MemoryReport r;
    for (const auto& [n, p] : model_.named_parameters()) {
      r.parameters += static_cast<int64_t>(p.nbytes());
      if (p.grad().defined()) r.gradients += static_cast<int64_t>(p.grad().nbytes());
    }
    if (opt_) r.optimizer_state = optimizer_state_bytes(*opt_);
    return r;
  }
  NamedParams full_parameters() override { return model_.named_parameters(); }

 private:
  models::LanguageModel& model_;
  optim::Optimizer* opt_ = nullptr;
};

}  // namespace

std::unique_ptr<DataParallel> make_local(models::LanguageModel& model) {
  return std::make_unique<Local>(model);
}

}  // namespace acc::strategies
