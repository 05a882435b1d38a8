// libFuzzer target: strategies as train_gpt --strategy reads them: acc::parse_json, then
// acc::strategies::parse_strategy (the registry, each method's config check and apply on a
// scratch plan). Refusals must be acc::Error; anything else escaping, a crash or a sanitizer
// report is a finding. An accepted strategy must parse again from its to_json.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "acc/strategies/strategy.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  acc::strategies::Strategy s;
  try {
    s = acc::strategies::parse_strategy(
        acc::parse_json(std::string(reinterpret_cast<const char*>(data), size), "fuzz"));
  } catch (const acc::Error&) {
    return 0;
  }
  const nlohmann::json out = acc::strategies::to_json(s);
  if (acc::strategies::to_json(acc::strategies::parse_strategy(out)) != out) {
    std::fprintf(stderr, "strategy_fuzz: strategy changes on a to_json round trip\n");
    std::abort();
  }
  return 0;
}
