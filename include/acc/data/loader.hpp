#pragma once
// What training reads batches from, and which samples a rank reads.
//
// A Loader hands out this rank's batches in order and can save and restore its position exactly
// (state() / load_state()), which is all a TrainingSession needs to put the position in a
// checkpoint and resume mid-epoch. data::BatchLoader (token windows) is one; a user's loader is
// another; data::PrefetchLoader wraps any of them with a background thread.
//
// A Shard is the data-parallel contract as numbers: global sample g of step s is
// s * global_batch + g', and rank r of `ranks` reads g' in [r * per_rank, (r + 1) * per_rank),
// per_rank = global_batch / ranks. The ranks of a shard are the data-parallel coordinates of the
// mesh (dp x cp), not world ranks: ranks of one tensor- or pipeline-parallel group read the same
// samples. auto_accelerate hands one back (AccelerateResult::data), so a loader never computes
// ranks by hand.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

#include "acc/data/batch.hpp"

namespace acc::data {

class Loader {
 public:
  virtual ~Loader() = default;
  /// This rank's next batch; advances the position by one. Throws what building the batch throws.
  virtual Batch next() = 0;
  /// Everything needed to continue exactly where this loader is (JSON, saved in checkpoints).
  virtual nlohmann::json state() const = 0;
  /// Restores a state() of a loader of the same stream. Throws acc::ValueError naming the field
  /// and both values when the state describes another stream; nothing changes on error.
  virtual void load_state(const nlohmann::json& state) = 0;
};

struct Shard {
  // Ranks of one tp, cp or pp group read the same samples (a cp rank cuts its tokens out of them):
  // the data is split along dp only (dist::ParallelContext::data_rank / data_world).
  int rank = 0;              // this rank's data-parallel coordinate
  int ranks = 1;             // data-parallel ranks (dp of the mesh)
  int64_t global_batch = 1;  // samples per optimizer step over all of them

  /// global_batch / ranks. Throws acc::ValueError naming the values when it does not divide, or
  /// when rank is outside [0, ranks) or global_batch < 1.
  int64_t per_rank() const;
  /// The global sample indices this rank reads at `step`, in order. Throws as per_rank(), and
  /// acc::ValueError for a negative step.
  std::vector<int64_t> sample_indices(int64_t step) const;
  nlohmann::json to_json() const;
};

}  // namespace acc::data
