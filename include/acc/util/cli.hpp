#pragma once
// CLI11 validators for AutoAcc's command-line tools, so that every tool refuses the same things
// with the same words: an integer flag takes exactly an integer that fits in 64 bits (CLI11 would
// clamp 99999999999999999999 to the int64 maximum) within a range, a floating flag a finite
// number (CLI11 accepts inf and nan) within a range. A refused value exits 2 through CLI11 with
// "--flag: <reason>" naming the value.
//
//   app.add_option("--steps", steps)->check(acc::cli::integer(1));
//   app.add_option("--lr", lr)->check(acc::cli::number(0, acc::cli::kOpen));

#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

#include "acc/util/parse.hpp"

namespace acc::cli {

/// Parses the command line: std::nullopt to go on, else the code to exit with: 0 after --help,
/// 2 for a bad command line (CLI11 has printed what is wrong; its own codes are 100 and up).
///   if (const auto code = acc::cli::parse(app, argc, argv)) return *code;
inline std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

/// Integers in [lo, hi].
inline CLI::Validator integer(int64_t lo = std::numeric_limits<int64_t>::min(),
                              int64_t hi = std::numeric_limits<int64_t>::max()) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        if (auto e = int64_error(s)) return *e;
        const int64_t v = std::strtoll(s.c_str(), nullptr, 10);
        if (v < lo) return "must be >= " + std::to_string(lo) + ", got " + s;
        if (v > hi) return "must be <= " + std::to_string(hi) + ", got " + s;
        return {};
      },
      "INT", "integer");
}

enum Bound { kClosed, kOpen };

namespace detail {
inline std::string bound_text(const char* op, double v) {
  std::ostringstream o;
  o << "must be " << op << " " << v;
  return o.str();
}
}  // namespace detail

/// Finite numbers from lo (inclusive unless kOpen) up to hi (inclusive unless hi_bound is kOpen).
inline CLI::Validator number(double lo = -std::numeric_limits<double>::max(),
                             Bound lo_bound = kClosed,
                             double hi = std::numeric_limits<double>::max(),
                             Bound hi_bound = kClosed) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        if (auto e = finite_double_error(s)) return *e;
        const double v = std::strtod(s.c_str(), nullptr);
        if (v < lo || (lo_bound == kOpen && v == lo)) {
          return detail::bound_text(lo_bound == kOpen ? ">" : ">=", lo) + ", got " + s;
        }
        if (v > hi || (hi_bound == kOpen && v == hi)) {
          return detail::bound_text(hi_bound == kOpen ? "<" : "<=", hi) + ", got " + s;
        }
        return {};
      },
      "FLOAT", "number");
}

/// A duration in seconds (acc::parse_duration_seconds: finite, at most kMaxDurationSeconds), from
/// lo (inclusive unless kOpen; 0 allowed only when lo is 0 and closed) up to hi:
///   app.add_option("--health-timeout", s)->check(acc::cli::seconds(0.1, kClosed, 3600));
inline CLI::Validator seconds(double lo = 0, Bound lo_bound = kOpen,
                              double hi = kMaxDurationSeconds) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        const auto zero =
            lo == 0 && lo_bound == kClosed ? ZeroSeconds::kAllowed : ZeroSeconds::kRefused;
        if (auto e = duration_seconds_error(s, zero)) return *e;
        const double v = std::strtod(s.c_str(), nullptr);
        if (v < lo || (lo_bound == kOpen && v == lo)) {
          return detail::bound_text(lo_bound == kOpen ? ">" : ">=", lo) + ", got " + s;
        }
        if (v > hi) return detail::bound_text("<=", hi) + ", got " + s;
        return {};
      },
      "SECONDS", "seconds");
}

/// A size with an optional unit (acc::parse_bytes: "512MiB", "2GiB", "1.5GB", "4096"), at least
/// `lo` bytes, rewritten to its byte count so that an int64_t option takes it:
///   app.add_option("--mem-per-rank", bytes)->transform(acc::cli::bytes(1));
inline CLI::Validator bytes(int64_t lo = 0) {
  return CLI::Validator(
      [lo](std::string& s) -> std::string {
        int64_t v = 0;
        try {
          v = parse_bytes(s, "size");
        } catch (const std::exception& e) {
          return e.what();
        }
        if (v < lo) return "must be at least " + std::to_string(lo) + " bytes, got " + s;
        s = std::to_string(v);
        return {};
      },
      "SIZE", "bytes");
}

}  // namespace acc::cli
