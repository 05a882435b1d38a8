#include "acc/util/env.hpp"

#include <cerrno>
#include <cstdlib>

#include "acc/util/error.hpp"
#include "acc/util/parse.hpp"

namespace acc::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t get_int(const char* name, int64_t fallback) {
  auto v = get(name);
  if (!v) return fallback;
  return parse_int64(*v, std::string("environment variable ") + name);
}

double get_double(const char* name, double fallback) {
  auto v = get(name);
  if (!v) return fallback;
  return parse_double(*v, std::string("environment variable ") + name);
}

std::optional<double> get_seconds(const char* name, ZeroSeconds zero) {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_duration_seconds(*v, std::string("environment variable ") + name, zero);
}

std::string get_string(const char* name, const std::string& fallback) {
  auto v = get(name);
  return v ? *v : fallback;
}

}  // namespace acc::env
