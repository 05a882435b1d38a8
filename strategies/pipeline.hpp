#pragma once
// The pipeline_parallel method's runtime. Private to the strategies library.
//
// A Pipeline is built when the method applies (its schedule validated then), cuts the model when
// its transform runs (this rank keeps the blocks of its stages, the embedding modules on the first
// stage's rank and the head's on the last stage's; every other module is swapped for an empty
// StageElsewhere, so the placement table has no entry for another stage's tensors), and runs its
// rank's list of the schedule in Trainer::train_step.

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "acc/data/batch.hpp"
#include "acc/dist/device_mesh.hpp"
#include "acc/dist/functional.hpp"
#include "acc/models/language_model.hpp"
#include "acc/strategies/pipeline_schedule.hpp"
#include "grad_sync.hpp"

namespace acc::strategies {

struct SequenceChunk;  // method.hpp
struct SequenceSplit;  // method.hpp

/// Stages a pipeline may have: each stage's messages carry its index as their tag.
inline constexpr int kMaxStages = dist::kMaxP2PTag;

/// head_cost_in_blocks (strategy.hpp) of `model`: what the default cut charges the last stage;
/// the embedding (a lookup) is charged nothing.
double head_cost_in_blocks(const models::LanguageModel& model, int64_t seq_len);

class Pipeline {
 public:
  /// The loss of the last stage's logits (TrainingPlan::logits_loss).
  using LogitsLoss =
      std::function<Tensor(models::LanguageModel&, const Tensor& logits, const Tensor& targets)>;
  /// `stages`: the user's cut (empty: balanced when the model is cut). `megatron_sp`: whether the
  /// tensor-parallel blocks run on sequence chunks (read when the schedule runs: then the
  /// activations between two blocks are (B, T / tp, C)). `split`: Ulysses' sequence split (read
  /// when the schedule runs: each stage then runs this cp rank's chunk of every micro-batch, at
  /// its position offset, and the stages pass each other (B, T / cp, C)).
  Pipeline(PipelineSchedule schedule, std::vector<StageBlocks> stages,
           dist::ParallelContextPtr context, LogitsLoss logits_loss,
           std::shared_ptr<bool> megatron_sp, std::shared_ptr<const SequenceSplit> split);

  /// The model transform: cuts `model` (a models::LanguageModel, acc::ValueError naming its type
  /// otherwise) to this rank's stages, makes the tied embedding's group and starts the tied copy
  /// equal to the first stage's. Undone by the returned Undo.
  nn::Undo cut(nn::Module& model);

  /// The search's cut (layout_rewrite): `model` is a meta copy holding exactly this rank's
  /// blocks, which it keeps, split evenly over its virtual stages; the embedding and head modules
  /// go as cut() sends them. Undone by the returned Undo.
  nn::Undo cut_for_trace(nn::Module& model);
  /// One micro-batch through each of this rank's stages of the copy cut_for_trace kept, in stage
  /// order: the sum of their outputs (the loss on the last stage, send_to's handles elsewhere),
  /// whose backward is the stages' backward. For a trace on meta groups.
  Tensor trace_step(const data::Batch& micro_batch);

  /// Runs this rank's list of the schedule over `batch` split into micro-batches; the gradients
  /// of this rank's parameters accumulate (each micro-batch's loss scaled by 1/m). Returns the sum
  /// of the micro-batches' losses on the last stage's rank, 0 elsewhere.
  double run(const data::Batch& batch);
  /// Sums the tied embedding's gradient over the first and last stage (before any data-parallel
  /// reduction reads it). Nothing when untied or on one rank.
  void reduce_tied_gradient(nn::Module& model) const;
  /// The tied embedding's entries count as one tensor held on two stages: replica r of the first
  /// stage's copies, R + r of the last's.
  void lift(PlacementTable& table) const;

  const PipelineSchedule& schedule() const { return schedule_; }
  int micro_batches() const { return schedule_.micro_batches; }
  /// The stages' blocks, once cut.
  const std::vector<StageBlocks>& stages() const { return stages_; }
  /// Every parameter of the whole model, by name and shape, in its order (recorded by cut()).
  const std::vector<std::pair<std::string, Shape>>& whole_parameters() const { return whole_; }
  /// The tied embedding's group over its first and last stage (null when none on this rank).
  const dist::ProcessGroupPtr& embedding_group() const { return embedding_group_; }

 private:
  // Forward of `a` on this rank's part of its micro-batch; `input`: its activation's receive
  // (stage > 0), posted by run().
  Tensor forward(const PipeAction& a, const SequenceChunk& micro_batch, dist::PostedRecv* input);
  // The first stage's input: the embedding of the micro-batch's tokens at their positions.
  Tensor embed(const SequenceChunk& micro_batch);
  // Blocks `b` of `stage` on its input `x`, then the loss (the last stage, weighed as the chunk
  // says) or the send of the output to the next stage's rank (send_to's handle): a stage's
  // forward, and the trace's. Runs at the chunk's position offset.
  Tensor through(int stage, const StageBlocks& b, Tensor x, const SequenceChunk& micro_batch);
  // What this rank runs of `micro_batch`: its sequence chunk under Ulysses, else all of it.
  SequenceChunk chunk_of(const data::Batch& micro_batch) const;
  // `model` as a LanguageModel (acc::ValueError naming its type otherwise); refuses dropout.
  models::LanguageModel& stages_of(nn::Module& model) const;
  // The embedding and head modules this rank does not run, with the rank that does.
  std::vector<std::pair<std::string, int>> ends_elsewhere(const models::LanguageModel& lm) const;
  // Swaps each module of `elsewhere` for a StageElsewhere; undone by the returned Undo.
  static nn::Undo swap_out(nn::Module& model,
                           const std::vector<std::pair<std::string, int>>& elsewhere);
  dist::PostedRecv post_input(const PipeAction& a, const data::Batch& micro_batch);
  // (B, T, C) of the activations between stages for what this rank runs of a micro-batch (its
  // chunk under Ulysses; T / tp under Megatron-SP).
  Shape activation_shape(const data::Batch& micro_batch) const;
  int rank_of_stage(int stage) const { return schedule_.rank_of_stage(stage); }

  PipelineSchedule schedule_;
  std::vector<StageBlocks> stages_;
  dist::ParallelContextPtr context_;
  LogitsLoss logits_loss_;
  std::shared_ptr<bool> megatron_sp_;
  std::shared_ptr<const SequenceSplit> split_;
  dist::ProcessGroupPtr pp_;
  int rank_ = 0;  // along pp
  models::LanguageModel* model_ = nullptr;
  std::vector<std::pair<std::string, Shape>> whole_;
  std::vector<StageBlocks> trace_chunks_;  // cut_for_trace: the copy's blocks per virtual stage
  std::string tied_;                       // the tied embedding's name when two stages hold it
  dist::ProcessGroupPtr embedding_group_;  // its first and last stage's ranks
};

}  // namespace acc::strategies
