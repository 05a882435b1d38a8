#pragma once
// Running a candidate for real: a copy of the user's model (models::clone_model, for a language
// model of the registry) takes the candidate's strategy and trains a few steps on this rank's
// batch, under the memory budget; the user's model, its RNG and data are untouched. Any other
// module cannot be copied (its constructor is the user's), so the candidate trains the module
// itself: its parameters, buffers, training mode and the default generator are snapshotted before
// and put back after, whatever happened (a failed fsdp candidate leaves its parameters released:
// each is given storage of its own again, holding the snapshot). The snapshot is taken inside the
// measured region, so the peak counts a copy of the model either way. Collective: every rank of the
// group runs the same candidate.
//
// A candidate that fails on one rank (out of memory, an error) fails on every rank within
// seconds: the candidate runs on a communicator of its own (ProcessGroup::split) whose
// collectives time out after DryRunOptions::collective_timeout, so the others give up on the
// collective the failed rank never joins; then every rank learns the failed ranks' messages. What
// the failure left in flight stays on that communicator (its buffers are never freed: see
// process_group.hpp) and never matches a later candidate's collectives.

#include <chrono>
#include <string>
#include <vector>

#include "acc/data/token_data.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/models/language_model.hpp"
#include "acc/optim/optimizer.hpp"
#include "acc/search/space.hpp"
#include "acc/search/status.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc::search {

struct DryRunOptions {
  int warmup_steps = 1;
  int measured_steps = 3;
  /// Tracked tensor bytes the candidate may use on a rank above what is held before it starts
  /// (0: no budget). An allocation past it throws acc::OutOfMemoryError: Status::kOom.
  int64_t memory_budget = 0;
  double grad_clip = 0.0;  // as strategies::ApplyOptions
  /// The limit on each collective of the candidate (the time a rank waits for the slowest to join
  /// it); must be > 0. auto_accelerate passes 10 s or 10 predicted steps, whichever is longer.
  std::chrono::milliseconds collective_timeout = std::chrono::seconds(10);
  /// The loss (strategies::ApplyOptions::loss; empty: a language model's next-token loss).
  strategies::LossFn loss = nullptr;
};

struct DryRunResult {
  Status status = Status::kOk;  // kOk | kOom | kError
  /// The failure's message when not ok, on every rank: "rank 1: out of memory: ..." for each rank
  /// that failed first-hand (the others' timeouts are not repeated).
  std::string error;
  /// Median of the measured steps' wall time, the slowest rank's (seconds).
  double step_seconds = 0;
  /// Each rank's median over the measured steps of its time blocked in Work::wait
  /// (dist::wait_seconds: communication the step left exposed, and waiting for a slower rank),
  /// the least and the most of the ranks (seconds; 0 on one rank). What the time model's
  /// exposed communication is compared with (bench_search).
  double wait_seconds_min = 0, wait_seconds_max = 0;
  /// Highest tracked tensor bytes during the run above what was held before it (the setup, the
  /// steps and the Trainer's teardown), the largest rank's.
  int64_t peak_bytes = 0;
  /// Each rank's own peak over the measured steps alone (after the warm-up: building the model,
  /// cutting it and a first step can peak higher, which peak_bytes includes), by its rank in the
  /// group (one entry on one rank): what the memory model predicts, a pipeline's stages apart.
  /// Read before the Trainer is torn down (a pipeline's undo makes every rank hold the whole
  /// model again).
  std::vector<int64_t> rank_step_peak_bytes;
  std::vector<double> losses;  // every step's loss, warm-up included
  nlohmann::json to_json() const;
};

DryRunResult dry_run(nn::Module& model, const optim::OptimizerFactory& factory,
                     const Candidate& candidate, const data::Batch& batch,
                     const dist::ProcessGroupPtr& group, const DryRunOptions& options = {});

}  // namespace acc::search
