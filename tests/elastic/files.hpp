#pragma once
// Files of the elastic tests: a fresh directory for a job, and the JSON lines of a file.

#include <unistd.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace acc::test {

/// An empty directory of its own for one test: <tmp>/acc_<name>_<pid>, emptied if it was there.
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("acc_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

/// The JSON lines of a file (train_gpt's --log-json, acc-run's incident log); none when it is
/// missing.
inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

}  // namespace acc::test
