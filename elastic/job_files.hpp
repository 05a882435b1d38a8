#pragma once
// What the agent and acc-run share about the job directory's files (private to elastic/).

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>

#include "acc/util/error.hpp"
#include "acc/util/json.hpp"

namespace acc::elastic::detail {

/// Seconds since the epoch: the times in reports, fault markers, progress files and incidents,
/// which ranks, acc-run and tests compare across processes.
inline double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

/// The JSON in `path`, or std::nullopt while it is missing, being replaced or malformed (these
/// files are written by other processes as the reader polls them).
inline std::optional<nlohmann::json> try_read_json(const std::filesystem::path& path) {
  try {
    return read_json_file(path.string(), "job file");
  } catch (const Error&) {
    return std::nullopt;
  }
}

}  // namespace acc::elastic::detail
