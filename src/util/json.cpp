#include "acc/util/json.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <vector>

#include "acc/util/error.hpp"

namespace acc {
namespace {

// One open object or array while parsing: what the parser callback needs to refuse a repeated
// key and to say where it is.
struct Frame {
  bool is_array = false;
  size_t index = 0;            // arrays: the element being parsed
  std::set<std::string> keys;  // objects: the keys seen so far
  std::string key;             // objects: the member being parsed
};

// The JSON pointer (RFC 6901) of the innermost open container, e.g. /0/config.
std::string pointer_of(const std::vector<Frame>& frames) {
  std::string out;
  for (size_t i = 0; i + 1 < frames.size(); ++i) {
    out += '/';
    if (frames[i].is_array) {
      out += std::to_string(frames[i].index);
      continue;
    }
    for (char c : frames[i].key) {
      if (c == '~') {
        out += "~0";
      } else if (c == '/') {
        out += "~1";
      } else {
        out += c;
      }
    }
  }
  return out;
}

// nlohmann's what() starts with "[json.exception.parse_error.101] "; the rest says where.
std::string without_exception_id(const char* what) {
  const char* p = std::strstr(what, "] ");
  return p != nullptr ? std::string(p + 2) : std::string(what);
}

}  // namespace

nlohmann::json parse_json(const std::string& text, const std::string& what) {
  std::vector<Frame> frames;
  auto element_done = [&] {
    if (!frames.empty() && frames.back().is_array) ++frames.back().index;
  };
  auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        ACC_CHECK(frames.size() < static_cast<size_t>(kMaxJsonDepth), what,
                  ": JSON nested deeper than ", kMaxJsonDepth, " levels at ",
                  pointer_of(frames) + "/...");
        frames.emplace_back().is_array = event == Event::array_start;
        break;
      case Event::key: {
        Frame& f = frames.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second) {
          const std::string where = pointer_of(frames);
          ACC_THROW(ValueError, what, ": duplicate key ", nlohmann::json(f.key).dump(),
                    where.empty() ? "" : " in " + where, " (JSON objects must not repeat a key)");
        }
        break;
      }
      case Event::object_end:
      case Event::array_end:
        frames.pop_back();
        element_done();
        break;
      case Event::value:
        element_done();
        break;
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text, callback);
  } catch (const nlohmann::json::exception& e) {
    ACC_THROW(ValueError, what, ": invalid JSON: ", without_exception_id(e.what()));
  }
}

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
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
  std::string text;
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
  }
  return parse_json(text, where);
}

}  // namespace acc
