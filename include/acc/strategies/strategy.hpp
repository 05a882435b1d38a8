#pragma once
// Strategies: a training strategy is a JSON list of optimisation methods, the format acc-search
// writes and auto_accelerate loads (as ATorch's (method, config) pairs):
//
//   [{"name": "zero2", "config": {"bucket_mb": 25}},
//    {"name": "amp"},
//    {"name": "grad_accum", "config": {"steps": 4}}]
//
// Methods available now (one file each under strategies/, registered in registry.cpp):
//   ddp         gradients bucketed and all-reduced while backward still runs
//   zero1       optimizer state sharded over the data-parallel ranks
//   zero2       zero1 + gradients reduce-scattered (each rank keeps its shard)
//   fsdp        ZeRO-3: parameters sharded too, gathered per unit for forward and backward
//   amp         bf16 for block activations and gradient communication, fp32 master weights
//   checkpoint  activation recomputation: {"blocks": N | "all"} of the units, from the first,
//               keep only their inputs and recompute in backward ({"kind": "full"}, the
//               default); {"kind": "selective"} recomputes only their attention cores from q, k, v
//   grad_accum  k micro-batches per optimizer step, gradients synchronised on the last only
//   tensor_parallel  {"size": t}: Megatron 1D tensor parallelism over the mesh dimension tp (the
//               attention's q|k|v and the MLP's first linears column-parallel, the output
//               projections row-parallel, heads split), dp = ranks / t for the methods above
//   sequence_parallel  {"kind": "ulysses", "size": s}: DeepSpeed-Ulysses over the mesh dimension
//               cp (each rank holds T/s tokens; all-to-alls trade sequence for heads around every
//               attention core); needs a data-parallel method (gradients averaged over dp x cp).
//               {"kind": "megatron"}: Megatron-SP over tensor_parallel's ranks (needs it), the
//               norm and dropout regions between the tp ops split along the sequence
//   pipeline_parallel  {"size": p, "schedule": "1f1b" | "interleaved" | "gpipe", "virtual": v,
//               "micro_batches": m, "stages": [[first, last], ...]}: a language model cut into
//               p x v stages between its blocks over the mesh dimension pp, run by a validated
//               schedule (acc/strategies/pipeline_schedule.hpp) in train_step
// Units (fsdp, checkpoint, amp): {"units": ["encoder.layers", "head"]} names the modules (a
// ModuleList stands for its children); without it, the model's repeated blocks; a model with
// neither is one fsdp unit, and checkpoint refuses it by name. Any nn::Module trains this way, with
// the user's loss (ApplyOptions::loss); a models::LanguageModel has its next-token loss.
// At most one of ddp/zero1/zero2/fsdp; the others compose with any. Unknown names, bad configs
// and incompatible combinations are acc::ValueError naming the entry and the reason.
//
// apply() wraps a model and an optimizer factory into a Trainer whose train_step() runs one
// optimizer step on this rank's slice of the global batch; every strategy trains to the same
// losses as one process with the same global batch.
//
// Reversible: the Trainer changes the model in place (block wrappers, gradient hooks, parameters
// moved into flat buffers or sharded) and undoes all of it when destroyed: the model is left with
// the trained values, each parameter in storage of its own, no wrappers or hooks of the strategy,
// no gradients. Destroying an fsdp Trainer gathers the parameters (a collective: every rank must
// destroy it; during exception unwinding nothing is gathered and the parameters stay released,
// so any later use fails with a device error rather than reading stale values).

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "acc/data/batch.hpp"
#include "acc/dist/device_mesh.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/dist/sharding.hpp"
#include "acc/models/language_model.hpp"
#include "acc/optim/optimizer.hpp"
#include "acc/strategies/pipeline_schedule.hpp"
#include "acc/trace/model_ref.hpp"

namespace acc::strategies {

struct Method {
  std::string name;
  nlohmann::json config = nlohmann::json::object();
};
using Strategy = std::vector<Method>;

/// Validates a strategy JSON (a list of {"name", "config"} objects). Throws acc::ValueError naming
/// the entry index and name for an unknown method, a config key the method does not have, a bad
/// value, a method given twice or an incompatible combination.
Strategy parse_strategy(const nlohmann::json& j);
/// One method's config alone, as parse_strategy checks each entry: its keys, then the method's
/// own checks. Throws acc::ValueError naming the method, the key or the value.
void check_config(const Method& m);
/// The composition rules alone, on methods whose configs are each valid (check_config): a method
/// at most once, one method per exclusive slot, no pair one of
/// which never composes with the other, each method's check against the whole. Throws the
/// acc::ValueError parse_strategy throws for the same list. The search checks each of 10^5
/// combinations of configs it validated one by one with it (parse_strategy of each was 7 % of a
/// plan-only search).
void check_composition(const Strategy& s);
/// A file path, or inline JSON (starting with '[' or '{'), read with acc::parse_json /
/// acc::read_json_file (a repeated key is refused). Throws acc::IoError naming the argument when it
/// is neither inline JSON nor an existing path, or when the file is a directory or unreadable;
/// acc::ValueError for invalid JSON and for what parse_strategy() refuses (naming the file).
Strategy parse_strategy_arg(const std::string& file_or_json);

/// The JSON a --strategy argument holds (inline, or the file's), read as parse_strategy_arg reads
/// it (same errors) but not interpreted: a caller that also accepts a strategy cache
/// (accelerate/cache.hpp) looks at it first.
nlohmann::json read_strategy_arg(const std::string& file_or_json);

/// Whether a --strategy argument is JSON given inline (its first non-blank character is '[' or
/// '{') rather than a file path: how read_strategy_arg tells them apart, and how messages say
/// which it was.
bool is_inline_json(const std::string& file_or_json);
nlohmann::json to_json(const Strategy& s);
/// One line for logs and reports: "zero2 + amp + checkpoint{"blocks":2}" ("single process" when
/// empty). Derived from the methods alone, so a name written in a file is never trusted.
std::string describe(const Strategy& s);
/// Names of the registered methods.
std::vector<std::string> method_names();

/// A micro-batch -> its mean loss (a tensor of one element), computed by running the model on the
/// batch's tensors: the user's loss (ATorch's loss_func). Called once per micro-batch, on this
/// rank's slice of the batch; the Trainer averages it over micro-batches and data-parallel ranks,
/// so it must be a mean over the batch's samples for the strategies to equal one process.
using LossFn = std::function<Tensor(nn::Module&, const data::Batch&)>;

/// A language model's next-token loss: model.loss(batch.idx(), batch.targets()). Throws
/// acc::TypeError naming the module's type when it is no models::LanguageModel, and what
/// Batch::at throws when the batch lacks "idx" or "targets".
LossFn language_model_loss();

struct ApplyOptions {
  /// The run's mesh (dist::ParallelContext): gradients are reduced over its dp x cp group, the
  /// loss averaged over it, the gradient norm counts each element once over the whole mesh, and
  /// checkpoints are written over its world. Default: dp over `group`.
  dist::ParallelContextPtr context = nullptr;
  /// Without a context: the data-parallel group, every rank of it a dp rank (default: the world
  /// when acc::dist is initialised, else one rank).
  dist::ProcessGroupPtr group = nullptr;
  /// Global gradient-norm clipping (0 = off), as torch.nn.utils.clip_grad_norm_.
  double grad_clip = 0.0;
  /// What else every rank must agree on (batch size, sequence length, data, ...). Before its first
  /// collective the Trainer checks that the ranks agree on this, the model's type, config and
  /// parameter shapes, the strategy and grad_clip (dist::check_agreement: one hash allgather;
  /// acc::ValueError naming the first difference, on every rank).
  nlohmann::json agreement = nlohmann::json::object();
  /// The loss of a micro-batch. Empty: language_model_loss() for a models::LanguageModel; any
  /// other module must be given one (acc::ValueError naming its type otherwise).
  LossFn loss = nullptr;
  /// A batch shaped like a micro-batch (its values unused): what a method that traces the model
  /// (tensor_parallel finds its attention and MLP patterns) traces a module other than a language
  /// model on, through `loss`.
  data::Batch sample_batch = {};
};

/// The mesh a strategy runs on over `world` ranks: the sizes its methods set (tensor_parallel's
/// tp), dp the rest. Throws acc::ValueError naming the strategy, the sizes and the world when they
/// do not divide it.
dist::DeviceMesh mesh_for(const Strategy& s, int world);

/// The methods of `s` that change what a rank holds and computes (tensor_parallel,
/// sequence_parallel, pipeline_parallel), in order: the candidates of a search that share them
/// share a layout.
Strategy layout_of(const Strategy& s);
/// layout_of(s) as a key: to_json(layout_of(s)).dump(), "" when it is empty, made without copying
/// the methods (the search keys every candidate's rank models by it, several times each).
std::string layout_key(const Strategy& s);

/// How rank 0 of `s`'s mesh over `world` ranks runs the model, for the search's traces
/// (trace::ModelRef::rewritten): the model transforms of the methods that change what a rank holds
/// and computes (tensor_parallel, sequence_parallel) applied over meta groups
/// (dist::ParallelContext::meta: nothing communicates), and the loss that rank's plan runs (the
/// vocabulary-parallel cross-entropy when `default_loss` and the vocabulary is split, Ulysses'
/// sequence chunk). Activation methods (amp, checkpoint) are left to the trace's options, and the
/// data-parallel ones to the search's effects. Empty when no method of `s` changes the layout.
/// Throws what mesh_for throws; the rewrite throws the transforms' own refusals (acc::ValueError:
/// "has 6 heads, not a multiple of tp 4") when it runs.
///
/// With pipeline_parallel in `s`, the rewrite traces one pp rank's stages (`pp_rank`, the rank of
/// the mesh at pp coordinate pp_rank and 0 elsewhere) on a copy of the model that holds exactly
/// that rank's blocks (a registry model at the depth of its stages in pipeline_layout's cut): the
/// embedding when the rank holds the first stage, the head and the loss when it holds the last,
/// one micro-batch through each of its stages in turn (the copy's blocks split evenly among them),
/// its input received from the previous stage's rank and its output sent to the next one's
/// (dist::recv_from / send_to on meta groups: the trace records both messages, forward and
/// backward). The in-flight micro-batches of the schedule are the search's to add (their count:
/// PipelineSchedule::max_in_flight).
trace::ModelRef::Rewrite layout_rewrite(const Strategy& s, int world, bool default_loss,
                                        int pp_rank = 0);

/// A strategy's pipeline as the search prices it: its validated schedule (checked_schedule's,
/// shared: a search asks for the same ones for many candidates) and its cut.
struct PipelineLayout {
  std::shared_ptr<const PipelineSchedule> schedule;
  std::vector<StageBlocks> stages;  // ranks x virtual stages, in order
};

/// The pipeline of `s` for a model of `num_blocks` blocks whose head (final norm, projection and
/// loss) costs `head_cost` blocks (head_cost_in_blocks): pipeline_parallel's own cut (the user's
/// stages, else balanced as the method balances them). nullopt when `s` has no pipeline_parallel.
/// Throws what the method's config, schedule and cut throw (acc::ValueError naming the value).
std::optional<PipelineLayout> pipeline_layout(const Strategy& s, int64_t num_blocks,
                                              double head_cost);

/// `blocks` blocks of cost 1 each into `stages` contiguous non-empty stages, the first also paying
/// `first_extra` (the embedding) and the last `last_extra` (the head and the loss), so that the
/// largest stage's cost is least (ties: earlier stages take fewer blocks, which also holds the
/// first stage's in-flight activations least). Throws acc::ValueError naming the counts when there
/// are fewer blocks than stages, or an extra that is negative or not finite.
std::vector<StageBlocks> balance_stages(int64_t blocks, int stages, double first_extra,
                                        double last_extra);

/// `s` with its pipeline_parallel cut at `stages` (its config's "stages", [first, last] blocks per
/// stage). Throws acc::ValueError when `s` has no pipeline_parallel or the stages do not fit its
/// size x virtual stages (as the config itself is checked).
Strategy with_pipeline_stages(const Strategy& s, const std::vector<StageBlocks>& stages);

/// A language model's head against one of its blocks, in forward FLOPs per token:
/// V / (12 C + 2 T) (a block does 24 C^2 + 4 T C, the projection 2 C V).
double head_cost_in_blocks(int64_t hidden_size, int64_t vocab_size, int64_t seq_len);

/// Bytes held by each kind of training state on this rank, measured from the tensors themselves.
struct MemoryReport {
  int64_t parameters = 0;                // parameter bytes resident between steps
  int64_t gradients = 0;                 // gradient bytes resident after a step's backward
  int64_t optimizer_state = 0;           // optimizer state bytes
  int64_t peak_gathered_parameters = 0;  // fsdp: most parameter bytes gathered at once
};

class GradSync;  // the gradient synchronisation of a strategy (internal)

class Trainer {
 public:
  /// Any module: its parameters are what the strategy trains, options.loss what it minimises.
  Trainer(nn::ModulePtr model, optim::OptimizerFactory factory, Strategy strategy,
          ApplyOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// One optimizer step on this rank's slice of the batch: micro-batching, forward, backward,
  /// gradient synchronisation, clipping and the update. Returns the loss averaged over the
  /// micro-batches and the data-parallel ranks (the single-process loss of the global batch).
  /// Throws acc::ValueError when the batch does not split into the micro-batches (naming its size
  /// and the count), acc::ShapeError when its tensors disagree on the batch dimension (naming
  /// them), and what loss() throws.
  double train_step(const data::Batch& batch);

  /// The plain loop, which train_step runs (strategies without a pipeline schedule): per optimizer
  /// step, grad_accum_steps() times
  ///   Tensor l = trainer.loss(micro_batch);   // this rank's micro-batch
  ///   scale(l, 1.0 / grad_accum_steps()).backward();   // (l itself with one micro-batch)
  /// then trainer.step(). The first loss() of a step zeroes the gradients and begins the step
  /// (fsdp gathers its root unit); the last one's backward synchronises the gradients as it runs;
  /// step() waits for them, clips and updates (zero and fsdp: the shards). loss() is the model's
  /// forward as the strategy runs it (amp's autocast). Throws acc::ValueError naming the counts
  /// for a loss() beyond grad_accum_steps() in a step, or a step() after fewer. The loss returned
  /// is this rank's, not averaged over the ranks (train_step's is). Throws acc::ShapeError naming
  /// the shape when the loss function returns more than one element, acc::TypeError when it is not
  /// f32, and acc::ValueError when it is undefined or does not require grad (nothing to train).
  Tensor loss(const data::Batch& micro_batch);
  /// A language model's micro-batch: loss(data::Batch(idx, targets)).
  Tensor loss(const Tensor& idx, const Tensor& targets);
  void step();
  /// Runs `fn` once, at the start of the next step() (train_step's included), before anything of
  /// the parameters or optimizer state changes: a reader of the live state that runs beside
  /// training (ckpt::AsyncSaver's copy) makes the update wait until it is done.
  void before_next_update(std::function<void()> fn);

  nn::Module& model() { return *model_; }
  const nn::ModulePtr& model_ptr() const { return model_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
  const Strategy& strategy() const { return strategy_; }
  int grad_accum_steps() const { return micro_batches_; }
  /// The mesh and groups the strategy runs on (null: one process without acc::dist).
  const dist::ParallelContextPtr& context() const { return context_; }
  /// Groups a method made beyond the context's (pipeline_parallel's embedding group over the
  /// first and last stage, on the ranks that hold the tied embedding): what a hang detector
  /// watches besides the context's groups.
  std::vector<dist::ProcessGroupPtr> method_groups() const;
  /// Global gradient norm of the last step (before clipping).
  double last_grad_norm() const { return last_grad_norm_; }
  /// Measured from the placement table (gradients after the last backward).
  MemoryReport memory_report() const;
  /// The model's full parameters on every rank, by name, in the model's order, assembled from the
  /// placement table: this rank's own tensors when it holds them whole, otherwise copies summed
  /// over the group (a collective: every rank must call it).
  std::vector<std::pair<std::string, Tensor>> full_parameters();
  /// Every parameter, gradient and optimizer state tensor this rank holds (acc/dist/sharding.hpp).
  dist::PlacementTable placements() const;

 private:
  void check_ranks_agree();
  void sum_partial_gradients();
  double pipeline_step(const data::Batch& batch);
  void update();  // step() after its checks: synchronise, norm, clip, optimizer step
  struct Impl;
  nn::ModulePtr model_;
  Strategy strategy_;
  ApplyOptions options_;
  dist::ParallelContextPtr context_;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  int micro_batches_ = 1;
  int losses_in_step_ = 0;  // loss() calls since the last step()
  std::vector<std::function<void()>> before_update_;
  double last_grad_norm_ = 0.0;
};

/// Builds the Trainer. Throws what parse_strategy throws, and acc::ValueError when a method needs
/// what the run does not have.
std::unique_ptr<Trainer> apply(nn::ModulePtr model, optim::OptimizerFactory factory,
                               const Strategy& strategy, ApplyOptions options = {});

}  // namespace acc::strategies
