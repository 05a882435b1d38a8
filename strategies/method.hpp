#pragma once
// Methods as registered transforms of a training plan. Private to the strategies library.
//
// A strategy is a list of methods; each method is one file under strategies/ that defines a
// MethodSpec: its name, its config keys (validated), its slot (what it composes with) and an
// `apply` that contributes to the TrainingPlan. registry.cpp lists the specs and holds the
// composition rules; the Trainer builds and runs the plan and names no method.
//
// What a plan holds, in the order the Trainer applies it:
//   1. model transforms (amp's bf16 block boundaries, checkpoint's recomputation), each returning
//      its undo; undone in reverse when the Trainer goes;
//   2. gradient synchronisation and optimizer sharding (at most one grad_sync method): a factory
//      of the GradSync that owns the communication and says which pieces this rank optimises;
//   3. the step schedule: micro-batches per step (grad_accum);
//   4. the loss function (the model's next-token loss by default).
//
// How the parallel methods register
//  - tensor_parallel (tensor_parallel.cpp): slot "tensor_parallel", sets the mesh's tp; a model
//    transform that swaps the attention and MLP linears (found by trace::find_attention_patterns /
//    find_mlp_patterns) for column/row-parallel ones over the context's tp group
//    (tp_transform.hpp, over tp_layers.hpp) and records their layouts (plan.layouts): the
//    GradSyncs see local tensors, the Trainer lifts their placement entries into Shard(d) along tp
//    with boxes (lift_layouts); grad_sync runs over the context's dp x cp group.
//  - sequence_parallel (sequence_parallel.cpp): slot "sequence_parallel", a kind per config.
//    Ulysses sets the mesh's cp; a model transform wraps every attention core in all-to-alls over
//    the context's cp group (sequence traded for heads and back), and it wraps plan.loss to run
//    this cp rank's chunk of the sequence at its position offset (plan.sequence_split says what
//    that chunk is, for pipeline_parallel's stages, which run without plan.loss). Megatron-SP runs
//    over tp: it asks tensor_parallel's transform for it (plan.megatron_sp), which splits the
//    norm/dropout regions between the tp ops along the sequence.
//  - pipeline_parallel (pipeline_parallel.cpp): slot "pipeline_parallel", sets the mesh's pp; a
//    model transform, applied last, that keeps only this rank's stages (the other modules become
//    empty StageElsewhere, so the placement table has no entry for them), and plan.pipeline, whose
//    validated schedule Trainer::train_step runs instead of the plain micro-batch loop
//    (pipeline.hpp).
// Each is one more file and one more line in registry.cpp; the composition rules gain the pairs
// they exclude.

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "acc/data/batch.hpp"
#include "acc/models/language_model.hpp"
#include "acc/strategies/search.hpp"
#include "acc/strategies/strategy.hpp"
#include "grad_sync.hpp"

namespace acc::strategies {

class Pipeline;  // pipeline.hpp

/// What a rank runs of a micro-batch under Ulysses' sequence split: its chunk of the sequence,
/// the position of the chunk's first token, and the weight of the chunk's mean loss that makes
/// the average over cp the micro-batch's token mean (sequence_parallel.cpp's file comment).
struct SequenceChunk {
  data::Batch batch;
  int64_t position_offset = 0;
  double loss_weight = 1.0;

  /// The forward options the chunk runs under: the current ones with its first token's position.
  nn::ForwardOptions options() const;
  /// The chunk's mean loss weighed by loss_weight (returned as it is when that is 1).
  Tensor weigh(const Tensor& mean_loss) const;
};

/// The sequence split (sequence_parallel's Ulysses sets `chunk`; empty without one): read when a
/// step runs, so a method applied before sequence_parallel (pipeline_parallel, which runs each
/// stage on the chunk) sees it.
struct SequenceSplit {
  std::function<SequenceChunk(const data::Batch&)> chunk;
};

/// Undoes a model transform (the one nn::Undo: wrappers, replacements and methods' transforms).
using Undo = nn::Undo;

struct TrainingPlan {
  /// The run's mesh and groups (set by the Trainer before the plan is built: methods read sizes
  /// and coordinates from it, and communicate only over its groups).
  dist::ParallelContextPtr context;

  struct Transform {
    std::string method;
    std::function<Undo(nn::Module&)> apply;
  };
  std::vector<Transform> model_transforms;

  /// The grad_sync method's name ("" when none: the local, single-rank GradSync).
  std::string grad_sync_method;
  std::function<std::unique_ptr<GradSync>(nn::Module&, const dist::ParallelContext&,
                                          const GradSyncOptions&)>
      grad_sync;
  /// Options any method may set (amp turns bf16 communication on).
  GradSyncOptions sync_options;

  /// The step schedule: micro-batches per optimizer step, gradients synchronised on the last.
  int micro_batches = 1;

  /// A micro-batch -> its mean loss: the user's loss function (ApplyOptions::loss, a language
  /// model's next-token loss by default), which a method may wrap.
  LossFn loss;
  /// A language model's logits and targets -> the mean loss: what `loss` computes after the
  /// model's forward (by default), for a pipeline's last stage, which runs head() itself.
  /// tensor_parallel replaces it with the vocabulary-parallel cross-entropy when it splits the
  /// vocabulary.
  std::function<Tensor(models::LanguageModel&, const Tensor& logits, const Tensor& targets)>
      logits_loss;
  /// ApplyOptions::sample_batch: shapes to trace a module other than a language model on.
  data::Batch sample_batch;
  /// `loss` is the language model's own next-token loss (no ApplyOptions::loss given): a method
  /// may replace it with an equal one of its own (tensor_parallel's vocabulary-parallel loss).
  bool default_loss = false;

  /// The layouts of the parameters a model transform sharded (tensor_parallel), filled when the
  /// transforms are applied: the Trainer lifts its placement tables through them.
  std::shared_ptr<ParamLayouts> layouts = std::make_shared<ParamLayouts>();
  /// Megatron sequence parallelism (the sequence_parallel method's kind "megatron") asks the
  /// tensor_parallel transform for it here; the transform names the parameters whose gradients
  /// are then partial over tp, which the Trainer sums over tp before anything reads them.
  std::shared_ptr<bool> megatron_sp = std::make_shared<bool>(false);
  /// Ulysses' split of each micro-batch along the sequence (sequence_parallel sets it).
  std::shared_ptr<SequenceSplit> sequence_split = std::make_shared<SequenceSplit>();
  /// tensor_parallel's size (0: not in the strategy), set when it is applied with a context.
  int tensor_parallel = 0;
  std::shared_ptr<std::vector<std::string>> partial_over_tp =
      std::make_shared<std::vector<std::string>>();
  /// pipeline_parallel's runtime (null without it): the Trainer runs its schedule in train_step.
  std::shared_ptr<Pipeline> pipeline;
};

// Every member has an initialiser (`{}` at least): each method file's designated initialiser
// leaves out what it does not use, which GCC 12's -Wmissing-field-initializers reports of a member
// without one.
struct MethodSpec {
  std::string name{};
  /// Methods in the same exclusive slot cannot be combined (one grad_sync method at most).
  std::string slot{};
  bool exclusive_slot = false;
  /// Config keys the method accepts.
  std::vector<std::string> config_keys{};
  /// Validates the config (acc::ValueError naming the key and value) and contributes to the plan.
  std::function<void(const nlohmann::json& config, TrainingPlan& plan)> apply{};
  /// The search's view of the method (search.hpp): when it is tried, with which configs, and what
  /// it does to a step's memory and time. Each method file declares its own.
  bool needs_bf16 = false;
  bool needs_ranks = false;
  std::function<std::vector<nlohmann::json>(const SearchContext&)> search_choices{};
  std::function<void(const nlohmann::json&, const SearchContext&, StepEffects&)> effects{};
  /// A method that owns a mesh dimension sets its size (tensor_parallel: tp); the Trainer builds
  /// the run's mesh from them (mesh_for).
  std::function<void(const nlohmann::json&, dist::DeviceMesh&)> mesh{};
  /// Its model transform changes what a rank holds and computes (tensor_parallel's shards,
  /// sequence_parallel's split sequence): the search traces a candidate through it
  /// (layout_rewrite) rather than pricing one rank holding everything.
  bool layout = false;
  /// Checks the config against the whole strategy (a method that needs another), after every
  /// entry parsed: acc::ValueError naming both.
  std::function<void(const nlohmann::json&, const Strategy&)> check_with{};
  /// Methods it never composes with, whatever either's config, each with why (parse_strategy
  /// refuses the pair with it; the search skips such combinations before building them).
  std::vector<std::pair<std::string, std::string>> never_with{};
};

MethodSpec ddp_method();
MethodSpec zero1_method();
MethodSpec zero2_method();
MethodSpec fsdp_method();
MethodSpec amp_method();
MethodSpec recompute_method();
MethodSpec grad_accum_method();
MethodSpec tensor_parallel_method();
MethodSpec sequence_parallel_method();
MethodSpec pipeline_parallel_method();

/// The integer `key` of a method's config (present: the caller checks that), in [lo, hi]. Throws
/// acc::ValueError "<method>: <key> must be an integer in [lo, hi], got <value>".
int int_from(const std::string& method, const nlohmann::json& config, const char* key, int lo,
             int hi);

/// The bucket size from {"bucket_mb": x} (default 25), validated.
int64_t bucket_bytes_from(const std::string& method, const nlohmann::json& config);
/// The bucket sizes the search tries for a bucketed method: the default 25 MiB and 100 MiB (fewer,
/// larger messages: less latency per step, less overlap with backward).
std::vector<nlohmann::json> bucket_choices(const SearchContext&);

/// The plan of a parsed strategy, starting from `loss` (which methods may wrap or replace). Methods
/// apply in strategy order, except tensor_parallel, first (its loss is the one others wrap); model
/// transforms run in that order too, except tensor_parallel's, first (the others wrap blocks and
/// cores whose linears it replaces; it traces the model as the user built it), and
/// sequence_parallel's, last (Ulysses' all-to-alls outermost around the attention cores), then
/// pipeline_parallel's (it cuts the model whose blocks the others wrapped).
TrainingPlan make_plan(const Strategy& s, dist::ParallelContextPtr context, LossFn loss = {},
                       data::Batch sample_batch = {}, bool default_loss = false);

}  // namespace acc::strategies
