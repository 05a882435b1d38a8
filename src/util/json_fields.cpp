#include "acc/util/json_fields.hpp"

#include <cmath>
#include <utility>

#include "acc/util/error.hpp"

namespace acc::json {

std::string brief(const nlohmann::json& v) {
  std::string s = v.dump();
  constexpr size_t kMax = 60;
  if (s.size() > kMax) s = s.substr(0, kMax) + "...";
  return s;
}

Fields::Fields(const nlohmann::json& j, std::string what, std::string path)
    : j_(j), what_(std::move(what)), path_(std::move(path)) {
  if (!j_.is_object()) {
    if (path_.empty()) ACC_THROW(ValueError, what_, ": expected a JSON object, got ", brief(j_));
    fail(path_, "must be an object, got " + brief(j_));
  }
}

std::string Fields::path(const std::string& name) const {
  return path_.empty() ? name : path_ + "." + name;
}

void Fields::fail(const std::string& field_path, const std::string& problem) const {
  ACC_THROW(ValueError, what_, ": field '", field_path, "' ", problem);
}

const nlohmann::json* Fields::optional(const std::string& name) {
  used_.insert(name);
  auto it = j_.find(name);
  return it == j_.end() ? nullptr : &*it;
}

const nlohmann::json& Fields::at(const std::string& name) {
  const nlohmann::json* v = optional(name);
  if (v == nullptr) fail(path(name), "is missing");
  return *v;
}

std::string Fields::string(const std::string& name) {
  const nlohmann::json& v = at(name);
  if (!v.is_string()) fail(path(name), "must be a string, got " + brief(v));
  return v.get<std::string>();
}

bool Fields::boolean(const std::string& name) {
  const nlohmann::json& v = at(name);
  if (!v.is_boolean()) fail(path(name), "must be true or false, got " + brief(v));
  return v.get<bool>();
}

int64_t Fields::integer(const std::string& name, int64_t lo, int64_t hi) {
  const nlohmann::json& v = at(name);
  const auto range = [&] { return ::acc::detail::str_cat("an integer in [", lo, ", ", hi, "]"); };
  if (!v.is_number_integer()) fail(path(name), "must be " + range() + ", got " + brief(v));
  // Unsigned values above int64's range are out of any range asked for here.
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) {
    fail(path(name), "must be " + range() + ", got " + brief(v));
  }
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) fail(path(name), "must be " + range() + ", got " + brief(v));
  return x;
}

double Fields::number(const std::string& name, double lo, bool strict) {
  const nlohmann::json& v = at(name);
  const double x = v.is_number() ? v.get<double>() : std::nan("");
  if (!std::isfinite(x) || x < lo || (strict && x == lo)) {
    fail(path(name), ::acc::detail::str_cat("must be a finite number ", strict ? "> " : ">= ", lo,
                                            ", got ", brief(v)));
  }
  return x;
}

void Fields::no_others() const {
  for (auto it = j_.begin(); it != j_.end(); ++it) {
    if (!used_.count(it.key())) {
      std::string known;
      for (const std::string& k : used_) known += (known.empty() ? "" : ", ") + k;
      fail(path(it.key()), "is not known (expected " + known + ")");
    }
  }
}

}  // namespace acc::json
