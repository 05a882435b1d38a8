#pragma once
// The gradient-synchronisation side of a strategy. A Trainer owns one: the local one (no
// communication), or the one of ddp / zero1 / zero2 / fsdp. Private to the strategies library.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "acc/dist/process_group.hpp"
#include "acc/models/language_model.hpp"
#include "acc/optim/optimizer.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc::strategies {

using NamedParams = std::vector<std::pair<std::string, Tensor>>;

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  /// The optimizer over what this rank updates (all parameters, or this rank's shards).
  virtual std::unique_ptr<optim::Optimizer> make_optimizer(const optim::OptimizerFactory& f) = 0;
  /// Before the first micro-batch of a step.
  virtual void begin_step() {}
  /// False: gradients accumulate locally and are not synchronised (all but the last micro-batch).
  virtual void set_sync(bool sync) { sync_ = sync; }
  /// After the backward of a micro-batch: waits for the reductions launched during it. Idempotent.
  virtual void finish_backward() {}
  /// Sum of squares of the gradients this rank holds.
  virtual double local_grad_norm_sq() = 0;
  /// True when each rank holds a different part of the gradients (norms must be all-reduced).
  virtual bool grads_sharded() const { return false; }
  /// Benchmark-only (ApplyOptions::benchmark_skip_gradient_sync): the Trainer already turns
  /// gradient synchronisation off; a method with other communication in the step (fsdp's
  /// parameter gathers) turns that off here too.
  virtual void set_benchmark_skip(bool /*skip*/) {}
  /// After the optimizer step (e.g. gather the updated parameter shards).
  virtual void end_step() {}
  virtual MemoryReport memory_report() const = 0;
  /// Full parameters by name (copies when sharded).
  virtual NamedParams full_parameters() = 0;

 protected:
  bool sync_ = true;
};

struct DataParallelOptions {
  int64_t bucket_bytes = 25 << 20;
  bool bf16_communication = false;  // amp
};

std::unique_ptr<DataParallel> make_local(models::LanguageModel& model);
std::unique_ptr<DataParallel> make_ddp(models::LanguageModel& model, dist::ProcessGroupPtr group,
                                       const DataParallelOptions& o);
/// ZeRO stage 1 (optimizer state sharded) or 2 (+ gradients sharded).
std::unique_ptr<DataParallel> make_zero(models::LanguageModel& model, dist::ProcessGroupPtr group,
                                        int stage, const DataParallelOptions& o);
std::unique_ptr<DataParallel> make_fsdp(models::LanguageModel& model, dist::ProcessGroupPtr group,
                                        const DataParallelOptions& o);

// ---- shared pieces ----

/// Sum of squares of the defined gradients of `params`, in double.
double grad_norm_sq(const NamedParams& params);
/// Bytes of every tensor in an optimizer's state dict.
int64_t optimizer_state_bytes(const optim::Optimizer& opt);

/// Parameters in reverse registration order (the order gradients become ready), grouped into
/// buckets of at most `bucket_bytes` (a larger parameter gets a bucket of its own), each bucket
/// padded to a multiple of `world` elements so it splits into equal chunks.
struct BucketLayout {
  struct Slot {
    std::string name;
    Tensor param;
    int64_t offset = 0;  // within the bucket, in elements
  };
  struct Bucket {
    std::vector<Slot> slots;
    int64_t numel = 0;        // real elements
    int64_t padded = 0;       // multiple of world
    int64_t flat_offset = 0;  // start within the flat concatenation of all buckets
  };
  BucketLayout(const NamedParams& params, int world, int64_t bucket_bytes);
  std::vector<Bucket> buckets;
  int64_t total = 0;  // padded elements over all buckets
  /// bucket index of each parameter name
  std::vector<std::pair<std::string, size_t>> index;
  size_t bucket_of(const std::string& name) const;
};

/// Writes the gradients of `bucket`'s parameters times `scale` into `dst` (bucket.padded
/// elements; a parameter without a gradient and the padding become zeros). Data-parallel
/// strategies pass 1 / world: the average's division is folded into this copy (PyTorch DDP
/// pre-divides too), so the reduction is a plain sum and nobody makes another pass over the
/// bucket. With `drop_grads` each parameter's own gradient is released once copied.
void pack_bucket_grads(const BucketLayout::Bucket& bucket, float* dst, float scale,
                       bool drop_grads);

/// Makes `param` a view of `storage` at `offset` (elements), keeping it the same tensor (same
/// TensorImpl, so the module and autograd see it).
void repoint(Tensor& param, const std::shared_ptr<Storage>& storage, int64_t offset);

/// A 1-D leaf view of `base` elements [start, start + n) that requires grad: an optimizer piece.
Tensor piece_of(const Tensor& base, int64_t start, int64_t n);

}  // namespace acc::strategies
