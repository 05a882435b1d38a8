#pragma once
// The strategy cache: what acc-search writes (--out) and auto_accelerate writes
// (AccelerateOptions::save_strategy_to), and what auto_accelerate (load_strategy) and
// train_gpt --strategy FILE read back to skip the search. One JSON object:
//
//   {"format": "autoacc-strategy", "version": 1,
//    "strategy": [{"name": "zero2", "config": {"bucket_mb": 25}},
//                 {"name": "grad_accum", "config": {"steps": 2}}],
//    "name": "zero2 + grad_accum{steps:2}",
//    "micro_batch": 4,
//    "key": {"model_type": "gpt", "trace_hash": "9a0c...", "world": 2, "global_batch": 8,
//            "seq_len": 64, "autoacc_version": "0.3.0", "hardware": {<HardwareFingerprint>}},
//    "predicted": {"memory": {...}, "time": {...}},      // as the search's report rows
//    "measured": {"status": "ok", "step_seconds": ..., "peak_bytes": ...}}
//
// The key is what the choice depends on. A cache is used as it is only when every field of its
// key equals this run's; when only the world size differs the data-parallel layout is re-planned
// for the new world (same methods, the micro-batch kept where the new per-rank batch allows, the
// memory checked again); any other difference is named ("key.global_batch: 8 in the cache, 16 in
// this run") and the search runs again, or the load is refused (AccelerateOptions::on_stale).
// The hardware is keyed by the whole fingerprint (accelerate/calibration.hpp) with the machine's
// cores (acc::machine_cores(), not the rank's share that mpirun's binding gives it), so a cache
// made on another CPU, core count or BLAS build is stale: the time figures behind it do not hold
// there.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "acc/search/calibration.hpp"
#include "acc/strategies/strategy.hpp"

#include "acc/trace/model_ref.hpp"

namespace acc::search {

inline constexpr const char* kStrategyCacheFormat = "autoacc-strategy";
inline constexpr int kStrategyCacheVersion = 1;

struct StrategyKey {
  std::string model_type;  // "gpt" | "llama" | a module's type name
  std::string trace_hash;  // trace::ModelRef::hash (model_trace_hash of a registry model's config)
  int world = 1;
  int64_t global_batch = 0;
  int64_t seq_len = 0;  // 0: a module without a sequence length (its sample fixes the shapes)
  std::string autoacc_version;
  HardwareFingerprint hardware;

  /// "key.world: 2 in the cache, 4 in this run" for the first field where this (the cache's)
  /// differs from `run`; "" when equal. Fields in the order above, the hardware last
  /// ("key.hardware: cores: 2 vs 4").
  std::string difference(const StrategyKey& run) const;
  /// Equal but for the world size.
  bool differs_only_in_world(const StrategyKey& run) const;

  nlohmann::json to_json() const;
  /// Every field required, no others; acc::ValueError naming the field ("<what>: field
  /// 'key.world' ...").
  static StrategyKey from_json(const nlohmann::json& j, const std::string& what);
};

/// This run's key (the model traced on the meta device: milliseconds at any depth).
StrategyKey strategy_key(const std::string& model_type, const nlohmann::json& config, int world,
                         int64_t global_batch, int64_t seq_len);
/// Any model (a user's module: its class and ModelRef::hash()).
StrategyKey strategy_key(const trace::ModelRef& model, int world, int64_t global_batch,
                         int64_t seq_len);

struct StrategyCache {
  StrategyKey key;
  strategies::Strategy strategy;
  std::string name;          // strategies::describe(strategy), for logs (derived on read)
  int64_t micro_batch = 0;   // samples per forward/backward on a rank
  nlohmann::json predicted;  // the search's figures for it (objects; may be empty)
  nlohmann::json measured;

  nlohmann::json to_json() const;
  /// Throws acc::ValueError naming the field (and `what`, e.g. the file) for a missing, mistyped
  /// or unknown field, another format, a newer version, or a strategy parse_strategy refuses.
  static StrategyCache from_json(const nlohmann::json& j, const std::string& what);
};

/// Whether `j` claims to be a strategy cache (an object with "format": "autoacc-strategy"), as
/// opposed to a plain strategy list; from_json then says what is wrong with it.
bool is_strategy_cache(const nlohmann::json& j);

/// Writes `cache` to `path` atomically (a temporary renamed into place); acc::IoError naming
/// the path when it cannot.
void save_strategy_cache(const StrategyCache& cache, const std::string& path);

}  // namespace acc::search
