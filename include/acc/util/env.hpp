#pragma once
// Typed reads of environment variables. A set-but-malformed variable is an error that names the
// variable and its value, never a silent fallback to the default.

#include <cstdint>
#include <optional>
#include <string>

#include "acc/util/parse.hpp"

namespace acc::env {

/// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string> get(const char* name);

/// Throws acc::ValueError when the variable is set but is not an integer.
int64_t get_int(const char* name, int64_t fallback);

/// Throws acc::ValueError when the variable is set but is not a number.
double get_double(const char* name, double fallback);

/// A duration in seconds (acc::parse_duration_seconds: a finite number, > 0 unless `zero` allows
/// 0, at most kMaxDurationSeconds), or nullopt when the variable is unset or empty. Every variable
/// that holds a duration (ACC_COMM_TIMEOUT_SEC, ACC_HANG_TIMEOUT_SEC, ...) is read through this.
/// Throws acc::ValueError naming the variable and its value.
std::optional<double> get_seconds(const char* name, ZeroSeconds zero = ZeroSeconds::kRefused);

std::string get_string(const char* name, const std::string& fallback);

}  // namespace acc::env
