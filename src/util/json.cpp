#include "acc/util/json.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "acc/util/error.hpp"
#include "acc/util/json_strict.hpp"

namespace acc {
namespace {

// nlohmann's what() starts with "[json.exception.parse_error.101] "; the rest says where.
std::string without_exception_id(const std::string& what) {
  const size_t p = what.find("] ");
  return p != std::string::npos ? what.substr(p + 2) : what;
}

// parse_json's words for what the strict reader refuses.
struct Refusal final : detail::StrictJsonSink {
  explicit Refusal(const std::string& what) : what_(what) {}
  void syntax_error(const std::string& message) override {
    ACC_THROW(ValueError, what_, ": invalid JSON: ", without_exception_id(message));
  }
  void duplicate_key(const std::string& key, const std::string& pointer, size_t) override {
    ACC_THROW(ValueError, what_, ": duplicate key ", nlohmann::json(key).dump(),
              pointer.empty() ? "" : " in " + pointer, " (JSON objects must not repeat a key)");
  }
  void too_deep(const std::string& pointer, size_t limit) override {
    ACC_THROW(ValueError, what_, ": JSON nested deeper than ", limit, " levels at ",
              pointer + "/...");
  }
  const std::string& what_;
};

}  // namespace

nlohmann::json parse_json(const std::string& text, const std::string& what) {
  Refusal refusal(what);
  return detail::parse_strict_json<nlohmann::json>(text, kMaxJsonDepth, refusal);
}

nlohmann::json read_json_file(const std::string& path, const std::string& what, int64_t max_bytes) {
  namespace fs = std::filesystem;
  const std::string where = what + " '" + path + "'";
  ACC_CHECK_AS(IoError, !path.empty(), what, ": the path is empty");
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  ACC_CHECK_AS(IoError, st.type() != fs::file_type::not_found, where, ": no such file");
  ACC_CHECK_AS(IoError, !ec, where, ": ", ec.message());
  ACC_CHECK_AS(IoError, st.type() != fs::file_type::directory, where,
               ": is a directory, not a file");
  ACC_CHECK_AS(IoError, st.type() == fs::file_type::regular, where, ": is not a regular file");
  // POSIX reads: a read error then names the system error (std::ifstream's filebuf throws its own
  // "basic_filebuf::underflow error reading the file" without the path).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ACC_CHECK_AS(IoError, fd >= 0, where, ": cannot open (", std::strerror(errno), ")");
  // The size before anything is read or parsed (a parsed document takes about 4x its text), and
  // again while reading, for a file that grows meanwhile.
  struct stat sb {};
  const bool stat_ok = ::fstat(fd, &sb) == 0;
  const int stat_errno = errno;
  if (!stat_ok || sb.st_size > max_bytes) ::close(fd);
  ACC_CHECK_AS(IoError, stat_ok, where, ": cannot stat (", std::strerror(stat_errno), ")");
  ACC_CHECK_AS(IoError, sb.st_size <= max_bytes, where, ": ", sb.st_size,
               " bytes is over the limit of ", max_bytes, " bytes for ", what);
  std::string text;
  text.reserve(static_cast<size_t>(sb.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const int err = errno;
      ::close(fd);
      ACC_CHECK_AS(IoError, r == 0, where, ": cannot read (", std::strerror(err), ")");
      break;
    }
    text.append(buf, static_cast<size_t>(r));
    if (static_cast<int64_t>(text.size()) > max_bytes) {
      ::close(fd);
      ACC_THROW(IoError, where, ": grew past the limit of ", max_bytes, " bytes for ", what,
                " while being read");
    }
  }
  return parse_json(text, where);
}

}  // namespace acc
