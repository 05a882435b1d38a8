// The JSON step log: one line per step, flushed as it is written, so that a job killed at any
// point leaves every step it finished in the file.

#include "acc/util/error.hpp"
#include "session_state.hpp"

namespace acc::session_detail {

StepLog::StepLog(const std::string& path, bool append, const std::string& what)
    : path_(path), what_(what) {
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  ACC_CHECK_AS(IoError, out_.good(), "cannot write ", what, " file '", path, "'");
}

void StepLog::write(const nlohmann::json& line) {
  out_ << line.dump() << "\n";
  out_.flush();
  ACC_CHECK_AS(IoError, out_.good(), what_, ": writing '", path_, "' failed");
}

}  // namespace acc::session_detail
