#pragma once
// Strict number parsing for text from users (flags, environment variables, metadata): the whole
// text must be the number ("3abc" is refused, not read as 3), it must fit (no clamping to the
// int64 limits), and a floating value must be finite. Errors are acc::ValueError naming `what`
// and the text.
//
// Durations (timeouts, grace periods, thresholds in seconds) from the environment, a file or a
// flag all go through parse_duration_seconds: a finite number of seconds, at most
// kMaxDurationSeconds. "A huge timeout" is how users try to disable one, but every collective and
// every wait has a finite timeout (DESIGN.md), and a value past what the clocks hold wraps: a
// timeout of 9.3e9 s is a negative number of nanoseconds to std::chrono's steady clock (int64
// nanoseconds: 292 years), so a wait on it ended at once. So a duration above the maximum is
// refused, naming the variable and the value, never clamped or read as "no timeout".

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace acc {

/// The longest duration AutoAcc takes from a user: 7 days (604800 s). Longer than any collective,
/// step, save or node check should take, and far inside the clocks' range.
inline constexpr double kMaxDurationSeconds = 7 * 24 * 3600.0;

/// Whether 0 is a valid value of a duration: a timeout must be > 0; a threshold or a budget whose
/// 0 means "none" may be 0.
enum class ZeroSeconds { kRefused, kAllowed };

/// Throws acc::ValueError "<what> must be an integer, got '<text>'" (or "... does not fit in 64
/// bits") when `text` is not exactly a base-10 int64.
int64_t parse_int64(const std::string& text, const std::string& what);
/// Throws acc::ValueError when `text` is not exactly a finite number (inf and nan refused).
double parse_double(const std::string& text, const std::string& what);

/// A size in bytes: an integer or decimal number with an optional unit, B, KB/MB/GB/TB (powers of
/// 1000) or KiB/MiB/GiB/TiB (powers of 1024), case-sensitive, no space ("512MiB", "2GiB",
/// "1.5GB", "4096"). Throws acc::ValueError naming `what` and the text for anything else, a
/// negative size, or one past int64.
int64_t parse_bytes(const std::string& text, const std::string& what);

/// A duration in seconds ("300", "2.5", "1e3"): exactly a finite number, > 0 (>= 0 with
/// ZeroSeconds::kAllowed), at most kMaxDurationSeconds. Throws acc::ValueError naming `what` and
/// the text: "<what> must be a finite number of seconds, got 'inf'", "<what> must be > 0, got
/// '0'", "<what> must be at most 604800 seconds (7 days: every timeout is finite), got '1e10'".
double parse_duration_seconds(const std::string& text, const std::string& what,
                              ZeroSeconds zero = ZeroSeconds::kRefused);
/// The same checks on a number given in code (an option struct's field): returns `seconds`, or
/// throws acc::ValueError "<what> must be ..., got <seconds>".
double check_duration_seconds(double seconds, const std::string& what,
                              ZeroSeconds zero = ZeroSeconds::kRefused);
/// A checked duration (above) in whole milliseconds, to the nearest, and at least 1 ms when it is
/// positive (a positive timeout never becomes 0 ms). Throws acc::InternalError for an unchecked
/// one (negative, or above kMaxDurationSeconds).
std::chrono::milliseconds duration_ms(double seconds);

/// The same checks without throwing: the reason, or nothing when `text` is fine.
std::optional<std::string> int64_error(const std::string& text);
std::optional<std::string> finite_double_error(const std::string& text);
std::optional<std::string> duration_seconds_error(const std::string& text,
                                                  ZeroSeconds zero = ZeroSeconds::kRefused);

}  // namespace acc
