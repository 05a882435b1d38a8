#include "acc/util/parse.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "acc/util/error.hpp"

namespace acc {
namespace {

bool blank_at_start(const std::string& s) {
  return !s.empty() && std::isspace(static_cast<unsigned char>(s[0]));
}

}  // namespace

std::optional<std::string> int64_error(const std::string& text) {
  if (text.empty() || blank_at_start(text)) return "must be an integer, got '" + text + "'";
  char* end = nullptr;
  errno = 0;
  (void)std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0') return "must be an integer, got '" + text + "'";
  if (errno == ERANGE) return "'" + text + "' does not fit in a signed 64-bit integer";
  return std::nullopt;
}

std::optional<std::string> finite_double_error(const std::string& text) {
  if (text.empty() || blank_at_start(text)) return "must be a number, got '" + text + "'";
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0') return "must be a number, got '" + text + "'";
  if (!std::isfinite(x) || errno == ERANGE) return "must be a finite number, got '" + text + "'";
  return std::nullopt;
}

int64_t parse_int64(const std::string& text, const std::string& what) {
  if (auto e = int64_error(text)) ACC_THROW(ValueError, what, " ", *e);
  return std::strtoll(text.c_str(), nullptr, 10);
}

double parse_double(const std::string& text, const std::string& what) {
  if (auto e = finite_double_error(text)) ACC_THROW(ValueError, what, " ", *e);
  return std::strtod(text.c_str(), nullptr);
}

}  // namespace acc
