#pragma once
// Reading JSON files AutoAcc writes and reads back (calibrations, caches, checkpoint metadata):
// every field required unless asked for as optional, unknown fields refused, and every error
// naming the field by its path from the document's root:
//   "<what>: field 'gemm[2].gflops' must be a positive finite number, got -1"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <set>
#include <string>

namespace acc::json {

class Fields {
 public:
  /// The object at `path` ("" for the root) of a document described by `what`. Throws
  /// acc::ValueError unless `j` is an object.
  Fields(const nlohmann::json& j, std::string what, std::string path = "");

  /// The field's value; throws acc::ValueError naming it when it is missing.
  const nlohmann::json& at(const std::string& name);
  /// The field's value, or nullptr when it is missing.
  const nlohmann::json* optional(const std::string& name);

  std::string string(const std::string& name);
  bool boolean(const std::string& name);
  /// An integer in [lo, hi].
  int64_t integer(const std::string& name, int64_t lo, int64_t hi);
  /// A finite number >= lo (> lo when `strict`).
  double number(const std::string& name, double lo, bool strict);

  /// Throws acc::ValueError naming the first field that none of the calls above asked for.
  void no_others() const;

  /// "<path>.<name>" (or "<name>" at the root).
  std::string path(const std::string& name) const;
  const std::string& what() const { return what_; }
  /// Throws acc::ValueError "<what>: field '<path>' <problem>".
  [[noreturn]] void fail(const std::string& field_path, const std::string& problem) const;

 private:
  const nlohmann::json& j_;
  std::string what_, path_;
  std::set<std::string> used_;
};

/// `v` as a short text for a message (long values cut).
std::string brief(const nlohmann::json& v);

}  // namespace acc::json
