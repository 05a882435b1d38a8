#pragma once
// Running a candidate for real: a copy of the user's model (models::clone_model) takes the
// candidate's strategy and trains a few steps on this rank's batch, under the memory budget; the
// user's model, its RNG and data are untouched. Collective: every rank of the group runs the same
// candidate.

#include <string>
#include <vector>

#include "acc/accelerate/space.hpp"
#include "acc/data/token_data.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/models/language_model.hpp"
#include "acc/optim/optimizer.hpp"

namespace acc::accelerate {

struct DryRunOptions {
  int warmup_steps = 1;
  int measured_steps = 3;
  /// Tracked tensor bytes the candidate may use on a rank above what is held before it starts
  /// (0: no budget). An allocation past it throws acc::OutOfMemoryError: status "oom".
  int64_t memory_budget = 0;
  double grad_clip = 0.0;  // as strategies::ApplyOptions
};

struct DryRunResult {
  std::string status = "ok";  // "ok" | "oom" | "error"
  std::string error;          // the exception's message when not ok
  /// Median of the measured steps' wall time, the slowest rank's (seconds).
  double step_seconds = 0;
  /// Highest tracked tensor bytes during the run above what was held before it, the largest rank's.
  int64_t peak_bytes = 0;
  std::vector<double> losses;  // every step's loss, warm-up included
  nlohmann::json to_json() const;
};

DryRunResult dry_run(const models::LanguageModel& model, const optim::OptimizerFactory& factory,
                     const Candidate& candidate, const data::Batch& batch,
                     const dist::ProcessGroupPtr& group, const DryRunOptions& options = {});

}  // namespace acc::accelerate
