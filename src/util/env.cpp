#include "acc/util/env.hpp"

#include <cerrno>
#include <cstdlib>

#include "acc/util/error.hpp"

namespace acc::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t get_int(const char* name, int64_t fallback) {
  auto v = get(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v->c_str(), &end, 10);
  ACC_CHECK(errno == 0 && end != v->c_str() && *end == '\0', "environment variable ", name, "='",
            *v, "' is not an integer");
  return x;
}

double get_double(const char* name, double fallback) {
  auto v = get(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(v->c_str(), &end);
  ACC_CHECK(errno == 0 && end != v->c_str() && *end == '\0', "environment variable ", name, "='",
            *v, "' is not a number");
  return x;
}

std::string get_string(const char* name, const std::string& fallback) {
  auto v = get(name);
  return v ? *v : fallback;
}

}  // namespace acc::env
