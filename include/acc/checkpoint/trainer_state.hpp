#pragma once
// A Trainer's whole state in a checkpoint: parameters, optimizer state and step counts, the
// model's trace hash and strategy; saved, loaded into any layout, and resumed from the newest step
// that loads.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "acc/checkpoint/format.hpp"
#include "acc/checkpoint/save.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc::ckpt {

/// A Trainer's parameters, optimizer state and optimizer step counts (every rank's, gathered into
/// metadata.extra["optimizer_steps"]), with the model's trace hash and the trainer's strategy in
/// the header and `extra` beside them. A collective over the trainer's group; as save().
std::string save_trainer(const std::string& root, int64_t step, strategies::Trainer& trainer,
                         const std::string& model_trace_hash, nlohmann::json extra = {},
                         const SaveOptions& options = {});

/// Loads a checkpoint written by save_trainer from any layout into `trainer` (any world size and
/// data-parallel method): parameters, optimizer state and step counts. Throws acc::ValueError
/// naming both hashes when the checkpoint is of another model (`model_trace_hash` differs), and
/// what load() throws. Returns the checkpoint's metadata (step, extra) for the caller's own state.
/// Not collective.
Metadata load_trainer(const std::string& step_dir, strategies::Trainer& trainer,
                      const std::string& model_trace_hash);

struct Resumed {
  std::string dir;  // the step directory loaded
  Metadata metadata;
  std::vector<std::string> skipped;  // newer committed steps that failed to load, with why
};

/// Resumes `trainer` from the newest loadable checkpoint under `root` (or from `root` itself when
/// it is a step directory): the newest committed step first (resolve), then, when `fall_back`, each
/// older committed step in turn while loading fails on any rank (a corrupt or missing shard, a
/// checksum mismatch), logging which it skipped and why. Collective over the trainer's group: rank
/// 0 lists the steps, and every rank loads the same one (a failure on one rank fails that step on
/// all). Returns std::nullopt when there is no committed step at all. Throws acc::IoError naming
/// every step tried and the ranks' errors when none loads (or the first fails and fall_back is
/// off), and acc::ValueError at once for a checkpoint of another model (falling back would not
/// help).
std::optional<Resumed> resume(const std::string& root, strategies::Trainer& trainer,
                              const std::string& model_trace_hash, bool fall_back = true);

}  // namespace acc::ckpt
