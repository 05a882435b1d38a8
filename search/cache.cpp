#include "acc/search/cache.hpp"

#include <limits>

#include "acc/trace/estimate.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/json_fields.hpp"
#include "acc/util/system.hpp"

#ifndef ACC_VERSION
#error "ACC_VERSION (the project's version) must be defined by the build"
#endif

namespace acc::search {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

template <typename T>
std::string differs(const std::string& field, const T& cached, const T& run) {
  if (cached == run) return "";
  std::ostringstream out;
  out << "key." << field << ": " << cached << " in the cache, " << run << " in this run";
  return out.str();
}

}  // namespace

std::string StrategyKey::difference(const StrategyKey& run) const {
  for (std::string d :
       {differs("model_type", model_type, run.model_type),
        differs("trace_hash", trace_hash, run.trace_hash), differs("world", world, run.world),
        differs("global_batch", global_batch, run.global_batch),
        differs("seq_len", seq_len, run.seq_len),
        differs("autoacc_version", autoacc_version, run.autoacc_version)}) {
    if (!d.empty()) return d;
  }
  const std::string h = hardware.difference(run.hardware);
  return h.empty() ? "" : "key.hardware: " + h + " (the cache's, then this machine's)";
}

bool StrategyKey::differs_only_in_world(const StrategyKey& run) const {
  StrategyKey same_world = *this;
  same_world.world = run.world;
  return world != run.world && same_world.difference(run).empty();
}

nlohmann::json StrategyKey::to_json() const {
  return {{"model_type", model_type},
          {"trace_hash", trace_hash},
          {"world", world},
          {"global_batch", global_batch},
          {"seq_len", seq_len},
          {"autoacc_version", autoacc_version},
          {"hardware", hardware.to_json()}};
}

StrategyKey StrategyKey::from_json(const nlohmann::json& j, const std::string& what) {
  json::Fields f(j, what, "key");
  StrategyKey k;
  k.model_type = f.string("model_type");
  k.trace_hash = f.string("trace_hash");
  k.world = static_cast<int>(f.integer("world", 1, std::numeric_limits<int>::max()));
  k.global_batch = f.integer("global_batch", 1, kMaxInt);
  k.seq_len = f.integer("seq_len", 0, kMaxInt);  // 0: a module without sequence length
  k.autoacc_version = f.string("autoacc_version");
  try {
    k.hardware = HardwareFingerprint::from_json(f.at("hardware"));
  } catch (const ValueError& e) {
    f.fail(f.path("hardware"), std::string("is not a hardware fingerprint: ") + e.what());
  }
  f.no_others();
  return k;
}

StrategyKey strategy_key(const std::string& model_type, const nlohmann::json& config, int world,
                         int64_t global_batch, int64_t seq_len) {
  return strategy_key(trace::ModelRef::registry(model_type, config), world, global_batch, seq_len);
}

StrategyKey strategy_key(const trace::ModelRef& model, int world, int64_t global_batch,
                         int64_t seq_len) {
  StrategyKey k;
  k.model_type = model.type();
  k.trace_hash = model.hash();
  k.world = world;
  k.global_batch = global_batch;
  k.seq_len = seq_len;
  k.autoacc_version = ACC_VERSION;
  k.hardware = hardware_fingerprint();
  // The machine's cores, not this rank's: mpirun binds each rank to its share, which changes with
  // the world size, and a world change alone is re-planned, not stale.
  k.hardware.cores = machine_cores();
  return k;
}

nlohmann::json StrategyCache::to_json() const {
  nlohmann::json j = {{"format", kStrategyCacheFormat},
                      {"version", kStrategyCacheVersion},
                      {"strategy", strategies::to_json(strategy)},
                      {"name", name},
                      {"micro_batch", micro_batch},
                      {"key", key.to_json()}};
  j["predicted"] = predicted.is_object() ? predicted : nlohmann::json::object();
  j["measured"] = measured.is_object() ? measured : nlohmann::json::object();
  return j;
}

bool is_strategy_cache(const nlohmann::json& j) {
  return j.is_object() && j.contains("format") && j["format"] == kStrategyCacheFormat;
}

StrategyCache StrategyCache::from_json(const nlohmann::json& j, const std::string& what) {
  json::Fields f(j, what);
  const std::string format = f.string("format");
  if (format != kStrategyCacheFormat) {
    f.fail("format",
           "must be \"" + std::string(kStrategyCacheFormat) + "\", got \"" + format + "\"");
  }
  const int64_t version = f.integer("version", 1, kMaxInt);
  if (version > kStrategyCacheVersion) {
    f.fail("version", "is " + std::to_string(version) + ", newer than this build reads (" +
                          std::to_string(kStrategyCacheVersion) + "): run acc-search again");
  }
  StrategyCache c;
  try {
    c.strategy = strategies::parse_strategy(f.at("strategy"));
  } catch (const ValueError& e) {
    f.fail("strategy", e.what());
  }
  // The name is what the strategy says, whatever the file's "name" claims: it goes into logs and
  // stale-cache messages, where a hand-edited name would misreport what runs.
  f.string("name");
  c.name = strategies::describe(c.strategy);
  c.micro_batch = f.integer("micro_batch", 1, kMaxInt);
  c.key = StrategyKey::from_json(f.at("key"), what);
  for (const char* figures : {"predicted", "measured"}) {
    const nlohmann::json& v = f.at(figures);
    if (!v.is_object()) f.fail(figures, "must be an object, got " + json::brief(v));
    (figures == std::string("predicted") ? c.predicted : c.measured) = v;
  }
  f.no_others();
  // The per-rank batch is the global batch over the strategy's data-parallel ranks (its tp and cp
  // ranks read the same samples).
  const int dp = strategies::mesh_for(c.strategy, c.key.world).dp;
  ACC_CHECK(c.key.global_batch % dp == 0 && (c.key.global_batch / dp) % c.micro_batch == 0, what,
            ": field 'micro_batch' ", c.micro_batch,
            " does not divide the per-rank batch of global batch ", c.key.global_batch, " over ",
            dp, " data-parallel rank(s)");
  return c;
}

void save_strategy_cache(const StrategyCache& cache, const std::string& path) {
  write_text_file_atomically(path, cache.to_json().dump(2) + "\n", "strategy cache");
}

}  // namespace acc::search
