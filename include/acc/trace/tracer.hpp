#pragma once
// acc::trace::trace: captures any acc::nn model as a graph by running its forward (and backward)
// on meta tensors, shapes only. The model's own parameters and buffers are swapped for meta
// storages for the duration of the trace and restored afterwards, so a real CPU model can be
// traced in place, without its memory and without touching its values or gradients. Errors the
// model's forward raises for bad input (a sequence longer than the model allows, a shape
// mismatch) propagate unchanged.
//
// What to run: a LanguageModel with (idx, targets) runs its loss; any other module runs forward on
// the first input and back-propagates from the sum of the output; or pass a loss function.

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "acc/nn/module.hpp"
#include "acc/trace/graph.hpp"

namespace acc::trace {

/// Activation recomputation applied while tracing: none, the repeated blocks (the blocks
/// find_blocks() reports) recomputed whole in backward (the `checkpoint` method's "full"), or only
/// their attention cores (nn::recompute_attention_cores: the method's "selective").
enum class Recompute { kNone, kBlock, kSelective };
/// "none" | "block" | "selective"; throws acc::ValueError for anything else.
Recompute parse_recompute(const std::string& name);
const char* recompute_name(Recompute r);

struct TraceOptions {
  bool backward = true;
  Recompute recompute = Recompute::kNone;
  /// With kBlock or kSelective: how many of the repeated blocks, from the first (-1: all), as the
  /// `checkpoint` strategy method's {"blocks": N}.
  int64_t recompute_blocks = -1;
  /// Activations saved inside the repeated blocks kept in bf16, as the `amp` strategy method does.
  bool bf16_activations = false;

  /// Every field above, for keys of traces (trace::TraceCache): a field added above that changes
  /// what is traced must join it.
  using KeyFields = std::tuple<bool, Recompute, int64_t, bool>;
  KeyFields key_fields() const { return {backward, recompute, recompute_blocks, bf16_activations}; }
};
// A tripwire for a new field (one that fits in the padding slips by): does it join key_fields()?
static_assert(sizeof(TraceOptions) == 24, "TraceOptions changed: update TraceOptions::key_fields");

/// A captured step.
struct Trace {
  Graph graph;
  std::string model_type;  // the root module's type name ("GPT", "Llama", "MLP", ...)
  int64_t num_parameters = 0;
  int64_t parameter_bytes = 0;
  std::vector<Shape> input_shapes;
  TraceOptions options;
};

/// Swaps every parameter and buffer of a module onto fresh meta storage (shapes kept, no memory)
/// for its lifetime, gradients set aside too, and puts everything back when it goes: what trace()
/// does around its run, and what a caller does around a transform it only traces (the search's
/// tensor-parallel rewrite of a user's module: its shards are cut from meta weights, and gathered
/// back into them by the undo, before the real storages return). `on_swap` sees each tensor
/// swapped, once (tied tensors are one).
class MetaStorageGuard {
 public:
  explicit MetaStorageGuard(
      nn::Module& m,
      const std::function<void(const std::string& name, const Tensor& t)>& on_swap = {});
  ~MetaStorageGuard();
  MetaStorageGuard(const MetaStorageGuard&) = delete;
  MetaStorageGuard& operator=(const MetaStorageGuard&) = delete;

 private:
  struct Saved;
  std::vector<Saved> saved_;
};

/// Computes the loss to back-propagate from the (meta) inputs.
using LossFn = std::function<Tensor(nn::Module&, const std::vector<Tensor>&)>;

/// Traces `module` on inputs shaped like `sample_inputs` (cpu or meta; only shapes and dtypes are
/// used). Throws whatever the model throws, acc::ValueError when `sample_inputs` is empty.
Trace trace(nn::Module& module, const std::vector<Tensor>& sample_inputs,
            const TraceOptions& options = {});
Trace trace(nn::Module& module, const LossFn& loss, const std::vector<Tensor>& sample_inputs,
            const TraceOptions& options = {});

}  // namespace acc::trace
