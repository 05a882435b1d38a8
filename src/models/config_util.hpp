#pragma once
// Typed, checked reads of JSON config fields: a wrong type is an acc::ValueError naming the field.

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "acc/util/error.hpp"

namespace acc::models::detail {

template <class T>
void read_field(const nlohmann::json& j, const char* owner, const char* name, T& out) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return;
  try {
    if constexpr (std::is_same_v<T, bool>) {
      ACC_CHECK(it->is_boolean(), owner, " config: field '", name, "' must be a boolean, got ",
                it->dump());
    } else if constexpr (std::is_integral_v<T>) {
      // Whole numbers within T's range only; the range is checked before any conversion (a
      // float such as 1e300 cast to an integer is undefined behaviour, found by fuzz_config).
      using Lim = std::numeric_limits<T>;
      bool ok = false;
      if (it->is_number_unsigned()) {
        ok = it->template get<uint64_t>() <= static_cast<uint64_t>(Lim::max());
      } else if (it->is_number_integer()) {
        const int64_t v = it->template get<int64_t>();
        ok = v >= static_cast<int64_t>(Lim::min()) && v <= static_cast<int64_t>(Lim::max());
      } else if (it->is_number_float()) {
        const double d = it->template get<double>();
        ok = std::isfinite(d) && std::trunc(d) == d && d >= static_cast<double>(Lim::min()) &&
             d < static_cast<double>(Lim::max()) + 1.0;
      }
      ACC_CHECK(ok, owner, " config: field '", name, "' must be an integer that fits in ",
                sizeof(T) * 8, " bits, got ", it->dump());
    } else if constexpr (std::is_floating_point_v<T>) {
      ACC_CHECK(it->is_number(), owner, " config: field '", name, "' must be a number, got ",
                it->dump());
    } else {
      ACC_CHECK(it->is_string(), owner, " config: field '", name, "' must be a string, got ",
                it->dump());
    }
    out = it->get<T>();
  } catch (const nlohmann::json::exception& e) {
    ACC_THROW(ValueError, owner, " config: field '", name, "': ", e.what());
  }
}

inline void require_object(const nlohmann::json& j, const char* owner) {
  ACC_CHECK(j.is_object(), owner, " config must be a JSON object, got ", j.dump());
}

/// The fields without which a config describes no particular model: missing ones are an
/// acc::ValueError naming them and the fields the config does have (a config for another model
/// would otherwise build the defaults without a word: a GPT config given to llama built the 6.48B
/// default Llama).
inline void require_fields(const nlohmann::json& j, const char* owner,
                           std::initializer_list<const char*> names) {
  std::string missing;
  for (const char* n : names) {
    if (!j.contains(n) || j[n].is_null()) missing += std::string(missing.empty() ? "" : ", ") + n;
  }
  if (missing.empty()) return;
  std::string present;
  for (auto it = j.begin(); it != j.end(); ++it) {
    present += std::string(present.empty() ? "" : ", ") + it.key();
  }
  ACC_THROW(ValueError, owner, " config is missing required field(s) ", missing, "; it has ",
            present.empty() ? std::string("no fields") : present,
            " (is it a config for another model?)");
}

}  // namespace acc::models::detail
