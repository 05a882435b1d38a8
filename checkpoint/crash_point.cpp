#include "crash_point.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <string>

#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/parse.hpp"

namespace acc::ckpt::detail {
namespace {

struct CrashSpec {
  std::string point;
  int rank = 0;
  int64_t step = -1;
};

std::optional<CrashSpec> crash_spec() {
  const auto text = env::get("ACC_CKPT_CRASH");
  if (!text || text->empty()) return std::nullopt;
  CrashSpec c;
  size_t start = 0;
  for (size_t i = 0; start <= text->size(); ++i) {
    const size_t end = std::min(text->find(':', start), text->size());
    const std::string part = text->substr(start, end - start);
    if (i == 0) {
      c.point = part;
    } else if (part.rfind("rank=", 0) == 0) {
      c.rank = static_cast<int>(parse_int64(part.substr(5), "ACC_CKPT_CRASH rank"));
    } else if (part.rfind("step=", 0) == 0) {
      c.step = parse_int64(part.substr(5), "ACC_CKPT_CRASH step");
    } else {
      ACC_THROW(ValueError, "ACC_CKPT_CRASH='", *text, "': unknown part '", part,
                "' (expected POINT:rank=R[:step=S])");
    }
    start = end + 1;
  }
  ACC_CHECK(c.point == "mid_write" || c.point == "before_rename" || c.point == "after_rename",
            "ACC_CKPT_CRASH='", *text,
            "': the point must be mid_write, before_rename or "
            "after_rename, got '",
            c.point, "'");
  return c;
}

}  // namespace

void crash_point(const char* point, int rank, int64_t step) {
  static const std::optional<CrashSpec> spec = crash_spec();
  if (spec && spec->point == point && spec->rank == rank &&
      (spec->step < 0 || spec->step == step)) {
    logging::warn("ACC_CKPT_CRASH: killing rank {} at {} of step {}", rank, point, step);
    ::kill(::getpid(), SIGKILL);
  }
}

}  // namespace acc::ckpt::detail
