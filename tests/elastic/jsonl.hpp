#pragma once
// The JSON lines of a file (train_gpt's --log-json, acc-run's incident log); none when it is
// missing.

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace acc::test {

inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

}  // namespace acc::test
