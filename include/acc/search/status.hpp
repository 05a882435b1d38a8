#pragma once
// What became of a search candidate, and where a run's strategy came from: enums with one name()
// each, written into reports and read back by name.

#include <string>

namespace acc::search {

/// A candidate's state: excluded before pricing (its layout cannot run the model: a head count
/// tensor_parallel's size does not divide), priced and rejected by the memory model, left unpriced
/// beside a strategy from a cache (fits), ranked by the time model, or its dry-run's outcome (ok,
/// oom, error).
enum class Status { kExcluded, kRejected, kFits, kRanked, kOk, kOom, kError };
/// "excluded", "rejected", "fits", "ranked", "ok", "oom", "error" (the words of reports).
const char* status_name(Status s);
/// The Status named `text`. Throws acc::ValueError naming `what` and the text otherwise.
Status parse_status(const std::string& text, const std::string& what);
/// Excluded or rejected: never priced for time, never run.
inline bool is_refused(Status s) {
  return s == Status::kExcluded || s == Status::kRejected;
}
/// After a dry-run (ok, oom, error).
inline bool is_measured(Status s) {
  return s == Status::kOk || s == Status::kOom || s == Status::kError;
}

/// Where a run's strategy came from: the search, a plan without dry-runs (acc-search --plan-only),
/// a strategy cache as it is, a cache re-planned for another world size, or a strategy given.
enum class Source { kSearch, kPlan, kCache, kReplanned, kGiven };
/// "search", "plan", "cache", "replanned", "given".
const char* source_name(Source s);
/// The Source named `text`. Throws acc::ValueError naming `what` and the text otherwise.
Source parse_source(const std::string& text, const std::string& what);

}  // namespace acc::search
