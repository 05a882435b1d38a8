#include "acc/util/logging.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <mutex>

#include "acc/util/env.hpp"
#include "acc/util/error.hpp"

namespace acc::logging {
namespace {

spdlog::level::level_enum parse_level(const std::string& level) {
  if (level == "trace") return spdlog::level::trace;
  if (level == "debug") return spdlog::level::debug;
  if (level == "info") return spdlog::level::info;
  if (level == "warn" || level == "warning") return spdlog::level::warn;
  if (level == "error") return spdlog::level::err;
  if (level == "off") return spdlog::level::off;
  ACC_THROW(ValueError, "unknown log level '", level,
            "' (expected trace, debug, info, warn, error or off)");
}

std::shared_ptr<spdlog::logger> make_logger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto lg = std::make_shared<spdlog::logger>("acc", sink);
  lg->set_pattern("[%H:%M:%S.%e] [acc] [%l] %v");
  lg->set_level(parse_level(env::get_string("ACC_LOG_LEVEL", "info")));
  lg->flush_on(spdlog::level::warn);
  return lg;
}

}  // namespace

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> lg = make_logger();
  return *lg;
}

void set_rank(int rank, int world) {
  logger().set_pattern("[%H:%M:%S.%e] [r" + std::to_string(rank) + "/" + std::to_string(world) +
                       "] [%l] %v");
}

void set_level(const std::string& level) {
  logger().set_level(parse_level(level));
}

}  // namespace acc::logging
