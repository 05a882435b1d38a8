#include "reducer.hpp"

#include "acc/autograd/engine.hpp"
#include "acc/util/error.hpp"

namespace acc::strategies {

struct BucketReducer::State : BackwardRounds<BucketReducer::State> {
  static constexpr size_t kMaxInFlight = 2;
  BucketLayout layout;
  dist::ProcessGroupPtr group;
  Mode mode;
  bool bf16;
  bool drop_param_grads;
  bool sync = true;

  std::vector<Tensor> bucket_grads;  // kAllreduce: full padded buckets
  std::vector<Tensor> chunk_grads;   // kReduceScatter: this rank's chunks

  // One round = one synchronised backward (BackwardRounds).
  std::vector<int> ready;      // per bucket: parameters ready
  std::vector<bool> launched;  // per bucket
  struct Pending {
    dist::WorkPtr work;
    size_t bucket;
    Tensor comm;  // what is reduced (bf16 copy, or the f32 buffer itself)
    Tensor out;   // kReduceScatter: the reduced chunk in comm's dtype
  };
  std::vector<Pending> pending;

  State(const NamedTensors& params, dist::ProcessGroupPtr g, int64_t bucket_bytes, Mode m, bool b,
        bool drop)
      : layout(params, g->size(), bucket_bytes),
        group(std::move(g)),
        mode(m),
        bf16(b),
        drop_param_grads(drop) {
    for (const auto& bucket : layout.buckets) {
      if (mode == Mode::kAllreduce) {
        bucket_grads.push_back(zeros({bucket.padded}));
      } else {
        chunk_grads.push_back(zeros({bucket.padded / group->size()}));
      }
    }
    ready.assign(layout.buckets.size(), 0);
    launched.assign(layout.buckets.size(), false);
  }

  void reset_round() {
    std::fill(ready.begin(), ready.end(), 0);
    std::fill(launched.begin(), launched.end(), false);
  }

  void on_ready(const std::string& name) {
    if (!sync) return;
    start_round();
    const size_t b = layout.bucket_of(name);
    if (launched[b]) return;
    if (++ready[b] == static_cast<int>(layout.buckets[b].slots.size())) launch(b);
  }

  // Copies the bucket's gradients, divided by the world size, into one buffer and starts their
  // sum.
  void launch(size_t b) {
    NoGradGuard ng;
    launched[b] = true;
    const BucketLayout::Bucket& bucket = layout.buckets[b];
    if (mode == Mode::kReduceScatter) {
      // Each reduce-scatter holds a full bucket until every rank has reached it; a rank running
      // ahead of slower peers would otherwise pile up the whole model's gradients. Keep at most
      // kMaxInFlight such buckets alive (the wait is on the oldest; later ones are younger).
      size_t alive = 0;
      for (const Pending& q : pending) alive += q.work->is_completed() ? 0 : 1;
      for (size_t i = 0; alive >= kMaxInFlight && i < pending.size(); ++i) {
        if (pending[i].work->is_completed()) continue;
        pending[i].work->wait();
        --alive;
      }
    }
    Tensor buf = mode == Mode::kAllreduce ? bucket_grads[b] : empty({bucket.padded});
    pack_bucket_grads(bucket, buf.data<float>(), 1.0f / static_cast<float>(group->size()),
                      drop_param_grads);
    Pending p;
    p.bucket = b;
    Tensor comm = bf16 ? buf.to(DType::kBFloat16) : buf;
    if (mode == Mode::kAllreduce) {
      p.work = group->allreduce(comm, dist::ReduceOp::kSum);
      if (bf16) p.comm = comm;  // copied back into the f32 bucket at finish
    } else {
      // The full bucket is only the reduction's input: the Work holds it until the reduction
      // completes and then frees it, so full gradients do not pile up.
      p.out = bf16 ? empty({bucket.padded / group->size()}, {DType::kBFloat16}) : chunk_grads[b];
      p.work = group->reduce_scatter(p.out, comm, dist::ReduceOp::kSum);
    }
    pending.push_back(std::move(p));
  }

  void finish() {
    if (!round_active) return;
    for (size_t b = 0; b < layout.buckets.size(); ++b) {
      if (!launched[b]) launch(b);
    }
    NoGradGuard ng;
    for (Pending& p : pending) {
      p.work->wait();
      if (mode == Mode::kAllreduce) {
        if (bf16) bucket_grads[p.bucket].copy_(p.comm);
      } else if (bf16) {
        chunk_grads[p.bucket].copy_(p.out);
      }
    }
    pending.clear();
    if (mode == Mode::kAllreduce && !drop_param_grads) {
      for (size_t b = 0; b < layout.buckets.size(); ++b) {
        for (const auto& slot : layout.buckets[b].slots) {
          Tensor p = slot.param;
          p.set_grad(bucket_grads[b].narrow(0, slot.offset, p.numel()).view(p.shape()));
        }
      }
    }
    end_round();
  }
};

BucketReducer::BucketReducer(const NamedTensors& params, dist::ProcessGroupPtr group,
                             int64_t bucket_bytes, Mode mode, bool bf16_communication,
                             bool drop_param_grads)
    : state_(std::make_shared<State>(params, std::move(group), bucket_bytes, mode,
                                     bf16_communication, drop_param_grads)) {
  std::weak_ptr<State> weak = state_;
  for (const auto& [name, p] : params) {
    Tensor t = p;
    ACC_CHECK(t.requires_grad(), "data parallel: parameter '", name, "' does not require grad");
    hooks_.add(t, [weak, name = name](Tensor&) {
      if (auto s = weak.lock()) s->on_ready(name);
    });
  }
}

BucketReducer::~BucketReducer() = default;

const BucketLayout& BucketReducer::layout() const {
  return state_->layout;
}
const Tensor& BucketReducer::bucket_grad(size_t b) const {
  return state_->bucket_grads.at(b);
}
const Tensor& BucketReducer::chunk_grad(size_t b) const {
  return state_->chunk_grads.at(b);
}
void BucketReducer::set_sync(bool sync) {
  state_->sync = sync;
}
void BucketReducer::finish() {
  state_->finish();
}
void BucketReducer::sync_now() {
  state_->start_round();
  state_->finish();
}

}  // namespace acc::strategies
