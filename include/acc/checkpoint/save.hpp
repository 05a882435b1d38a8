#pragma once
// save(): a placement table saved as one checkpoint step, committed over a group (the commit
// protocol of checkpoint.hpp).

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "acc/dist/process_group.hpp"
#include "acc/dist/sharding.hpp"

namespace acc::ckpt {

struct SaveOptions {
  int64_t chunk_bytes = int64_t{4} << 20;  // uncompressed bytes per chunk, at most
  /// zstd's level: -1 (a fast level) by default. fp32 weights and optimizer state barely compress
  /// (level 1: 1.08x on a trained GPT, level -1: 1.003x) and level 1 halves the load speed
  /// (benchmarks/bench_checkpoint: 0.93 against 1.81 GB/s); a higher level buys smaller files.
  int zstd_level = -1;
  int keep_last = 0;  // committed steps kept after this one (0: all)
};

/// What the checkpoint says about its run, besides the tensors.
struct Header {
  std::string model_trace_hash;
  nlohmann::json strategy = nlohmann::json::array();
  nlohmann::json extra = nlohmann::json::object();  // schedule position, RNG, data position, ...
};

/// Saves the parameters and optimizer state of `table` as step `step` under `root` (created when
/// missing); returns the committed step directory. A collective over `group`: every rank calls it
/// with its own table. Rank 0 writes under the root's lock: its own for the save when no
/// RootLock of this process holds it (root_lock.hpp). Throws acc::IoError on every rank when any
/// rank fails (nothing committed, the previous steps untouched), another job holds the root's
/// lock (naming it), or, once the step is committed, `latest` cannot be moved (saying so);
/// acc::ValueError for a step outside [0, kMaxStep] or bad options.
std::string save(const std::string& root, int64_t step, const dist::PlacementTable& table,
                 const Header& header, dist::ProcessGroup& group, const SaveOptions& options = {});

}  // namespace acc::ckpt
