#pragma once
// Logging through spdlog. One line per event, with the rank in every line ("[r3/8]") once
// acc::logging::set_rank has been called (acc::dist::init does it). The level comes from
// ACC_LOG_LEVEL (trace, debug, info, warn, error, off; default info).

#include <spdlog/spdlog.h>

#include <string>

namespace acc::logging {

/// The process-wide AutoAcc logger (created on first use, writes to stderr).
spdlog::logger& logger();

/// Puts "[r<rank>/<world>]" into every following line.
void set_rank(int rank, int world);

/// Throws acc::ValueError for an unknown level name.
void set_level(const std::string& level);

template <class... Args>
void trace(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  logger().trace(fmt, std::forward<Args>(args)...);
}
template <class... Args>
void debug(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  logger().debug(fmt, std::forward<Args>(args)...);
}
template <class... Args>
void info(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  logger().info(fmt, std::forward<Args>(args)...);
}
template <class... Args>
void warn(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  logger().warn(fmt, std::forward<Args>(args)...);
}
template <class... Args>
void error(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  logger().error(fmt, std::forward<Args>(args)...);
}

}  // namespace acc::logging
