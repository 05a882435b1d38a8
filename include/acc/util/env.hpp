#pragma once
// Typed reads of environment variables. A set-but-malformed variable is an error that names the
// variable and its value, never a silent fallback to the default.

#include <cstdint>
#include <optional>
#include <string>

namespace acc::env {

/// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string> get(const char* name);

/// Throws acc::ValueError when the variable is set but is not an integer.
int64_t get_int(const char* name, int64_t fallback);

/// Throws acc::ValueError when the variable is set but is not a number.
double get_double(const char* name, double fallback);

std::string get_string(const char* name, const std::string& fallback);

}  // namespace acc::env
