#include "acc/util/parse.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

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

namespace {

// Why a number of seconds (`shown` as the message shows it) is out of range, or nothing.
std::optional<std::string> duration_range_error(double s, ZeroSeconds zero,
                                                const std::string& shown) {
  if (zero == ZeroSeconds::kRefused && !(s > 0)) return "must be > 0, got " + shown;
  if (zero == ZeroSeconds::kAllowed && !(s >= 0)) return "must be >= 0, got " + shown;
  if (s > kMaxDurationSeconds) {
    return detail::str_cat("must be at most ", static_cast<int64_t>(kMaxDurationSeconds),
                           " seconds (7 days: every timeout is finite), got ", shown);
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> duration_seconds_error(const std::string& text, ZeroSeconds zero) {
  if (auto e = finite_double_error(text)) {
    return e->rfind("must be a finite", 0) == 0
               ? "must be a finite number of seconds, got '" + text + "'"
               : "must be a number of seconds, got '" + text + "'";
  }
  return duration_range_error(std::strtod(text.c_str(), nullptr), zero, "'" + text + "'");
}

double parse_duration_seconds(const std::string& text, const std::string& what, ZeroSeconds zero) {
  if (auto e = duration_seconds_error(text, zero)) ACC_THROW(ValueError, what, " ", *e);
  return std::strtod(text.c_str(), nullptr);
}

double check_duration_seconds(double seconds, const std::string& what, ZeroSeconds zero) {
  std::ostringstream shown;
  shown << seconds;
  if (!std::isfinite(seconds)) {
    ACC_THROW(ValueError, what, " must be a finite number of seconds, got ", shown.str());
  }
  if (auto e = duration_range_error(seconds, zero, shown.str())) {
    ACC_THROW(ValueError, what, " ", *e);
  }
  return seconds;
}

std::chrono::milliseconds duration_ms(double seconds) {
  ACC_CHECK_INTERNAL(seconds >= 0 && seconds <= kMaxDurationSeconds,
                     "duration_ms: an unchecked duration of ", seconds, " s");
  const int64_t ms = std::llround(seconds * 1000.0);
  return std::chrono::milliseconds(ms == 0 && seconds > 0 ? 1 : ms);
}

namespace {

// The number and the multiplier of a size, or the reason it is not one.
struct Bytes {
  double value = 0;
  std::string error;
};

Bytes read_bytes(const std::string& text) {
  static const std::pair<const char*, double> units[] = {
      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3},     {"MB", 1e6},        {"GB", 1e9},           {"TB", 1e12},
      {"B", 1.0}};
  const std::string bad = "must be a size such as 4096, 512MiB or 2GiB, got '" + text + "'";
  size_t digits = text.find_first_not_of("0123456789.");
  if (digits == std::string::npos) digits = text.size();
  const std::string number = text.substr(0, digits), unit = text.substr(digits);
  double scale = 1.0;
  if (!unit.empty()) {
    bool known = false;
    for (const auto& [name, s] : units) {
      if (unit == name) {
        scale = s;
        known = true;
      }
    }
    if (!known) return {0, bad};
  }
  if (number.empty() || finite_double_error(number)) return {0, bad};
  const double v = std::strtod(number.c_str(), nullptr) * scale;
  if (!(v < 9.2e18)) return {0, "'" + text + "' does not fit in a signed 64-bit byte count"};
  return {v, ""};
}

}  // namespace

int64_t parse_bytes(const std::string& text, const std::string& what) {
  const Bytes b = read_bytes(text);
  if (!b.error.empty()) ACC_THROW(ValueError, what, " ", b.error);
  return static_cast<int64_t>(b.value);
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
