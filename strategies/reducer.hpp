#pragma once
// The bucketed gradient reducer behind ddp, zero1 and zero2 (flashlight's CoalescingReducer and
// PyTorch's DDP Reducer are the models). Each parameter's post-accumulate-grad hook marks it
// ready; when every parameter of a bucket is ready the bucket's gradients are copied into one
// buffer and its reduction starts at once, asynchronously, while backward goes on computing the
// next layers. finish() (queued to run when backward ends, and idempotent) launches what is left
// and waits. Buckets follow reverse registration order, the order gradients become ready.
//
// Reductions average over the group (each rank's loss is the mean over its own slice of the
// global batch, so the average is the single-process gradient of the global batch).

#include <memory>
#include <vector>

#include "grad_sync.hpp"

namespace acc::strategies {

class BucketReducer {
 public:
  enum class Mode {
    kAllreduce,      // every rank gets the full averaged bucket
    kReduceScatter,  // every rank gets its chunk (1/world) of the averaged bucket
  };
  /// `drop_param_grads`: free each parameter's own gradient once copied into its bucket (the
  /// reduced gradients then live only in the reducer's buffers).
  BucketReducer(const NamedTensors& params, dist::ProcessGroupPtr group, int64_t bucket_bytes,
                Mode mode, bool bf16_communication, bool drop_param_grads);
  /// Removes its gradient hooks from the parameters.
  ~BucketReducer();

  const BucketLayout& layout() const;
  /// Full averaged gradient of bucket b (kAllreduce), padded.
  const Tensor& bucket_grad(size_t b) const;
  /// This rank's chunk of the averaged gradient of bucket b (kReduceScatter).
  const Tensor& chunk_grad(size_t b) const;
  void set_sync(bool sync);
  /// Launches the buckets not launched yet (parameters that got no gradient count as zero) and
  /// waits for every reduction of this backward; with kAllreduce and kept parameter gradients,
  /// points each parameter's grad at its averaged slice of the bucket. Idempotent.
  void finish();
  /// Reduces every bucket now from the gradients the parameters hold (after backward passes with
  /// sync off), as a synchronised backward would have, and waits: finish() outside a backward.
  void sync_now();

  struct State;

 private:
  std::shared_ptr<State> state_;
  ParamHooks hooks_;
};

}  // namespace acc::strategies
