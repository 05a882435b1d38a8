// libFuzzer target: model configs as train_gpt --config and acc-trace read them: acc::parse_json,
// then GPTConfig::from_json and LlamaConfig::from_json. Refusals must be acc::Error; anything
// else escaping, a crash or a sanitizer report is a finding. A config that is accepted must
// survive to_json -> from_json unchanged.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "acc/models/gpt.hpp"
#include "acc/models/llama.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json.hpp"

namespace {

void require(bool cond, const char* what) {
  if (!cond) {
    std::fprintf(stderr, "config_fuzz: %s\n", what);
    std::abort();
  }
}

template <class Config>
void try_config(const nlohmann::json& j) {
  Config c;
  try {
    c = Config::from_json(j);
  } catch (const acc::Error&) {
    return;
  }
  const nlohmann::json out = c.to_json();
  require(Config::from_json(out).to_json() == out, "config changes on a to_json round trip");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j;
  try {
    j = acc::parse_json(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const acc::Error&) {
    return 0;
  }
  try_config<acc::models::GPTConfig>(j);
  try_config<acc::models::LlamaConfig>(j);
  return 0;
}
