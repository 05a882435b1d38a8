#pragma once
// Small statistics and the named model configs shared by the benchmark programs.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "acc/models/language_model.hpp"

namespace acc::bench {

/// The median of v (the mean of the two middle values for an even count); 0 for an empty v.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

/// The config of a named model of `configs_dir` (examples/configs/): gpt17m, gpt90m, llama17m;
/// any other name is a config file's path.
inline nlohmann::json named_config(const std::string& name, const std::string& configs_dir) {
  if (name == "gpt17m") return models::read_json_file(configs_dir + "gpt_17m.json");
  if (name == "gpt90m") return models::read_json_file(configs_dir + "gpt_90m.json");
  if (name == "llama17m") return models::read_json_file(configs_dir + "llama_d512.json");
  return models::read_json_file(name);
}

}  // namespace acc::bench
