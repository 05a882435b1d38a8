#pragma once
// Strict number parsing for text from users (flags, environment variables, metadata): the whole
// text must be the number ("3abc" is refused, not read as 3), it must fit (no clamping to the
// int64 limits), and a floating value must be finite. Errors are acc::ValueError naming `what`
// and the text.

#include <cstdint>
#include <optional>
#include <string>

namespace acc {

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

/// The same checks without throwing: the reason, or nothing when `text` is fine.
std::optional<std::string> int64_error(const std::string& text);
std::optional<std::string> finite_double_error(const std::string& text);

}  // namespace acc
