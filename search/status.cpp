#include "acc/search/status.hpp"

#include <array>
#include <utility>

#include "acc/util/error.hpp"

namespace acc::search {
namespace {

constexpr std::array<std::pair<Status, const char*>, 7> kStatusNames = {{
    {Status::kExcluded, "excluded"},
    {Status::kRejected, "rejected"},
    {Status::kFits, "fits"},
    {Status::kRanked, "ranked"},
    {Status::kOk, "ok"},
    {Status::kOom, "oom"},
    {Status::kError, "error"},
}};

constexpr std::array<std::pair<Source, const char*>, 5> kSourceNames = {{
    {Source::kSearch, "search"},
    {Source::kPlan, "plan"},
    {Source::kCache, "cache"},
    {Source::kReplanned, "replanned"},
    {Source::kGiven, "given"},
}};

template <class E, size_t N>
const char* name_in(const std::array<std::pair<E, const char*>, N>& names, E e) {
  for (const auto& [value, name] : names) {
    if (value == e) return name;
  }
  ACC_THROW(InternalError, "search: no name for enum value ", static_cast<int>(e));
}

template <class E, size_t N>
E parse_in(const std::array<std::pair<E, const char*>, N>& names, const std::string& text,
           const std::string& what, const char* kind) {
  std::string known;
  for (const auto& [value, name] : names) {
    if (text == name) return value;
    known += (known.empty() ? "" : ", ") + std::string(name);
  }
  ACC_THROW(ValueError, what, ": unknown ", kind, " '", text, "' (known: ", known, ")");
}

}  // namespace

const char* status_name(Status s) {
  return name_in(kStatusNames, s);
}
Status parse_status(const std::string& text, const std::string& what) {
  return parse_in(kStatusNames, text, what, "status");
}
const char* source_name(Source s) {
  return name_in(kSourceNames, s);
}
Source parse_source(const std::string& text, const std::string& what) {
  return parse_in(kSourceNames, text, what, "source");
}

}  // namespace acc::search
