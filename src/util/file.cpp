#include "acc/util/file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "acc/util/error.hpp"

namespace acc {

void check_output_path(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  ACC_CHECK_AS(IoError, !path.empty(), what, ": the output path is empty");
  std::error_code ec;
  const fs::path p(path);
  ACC_CHECK_AS(IoError, !fs::is_directory(p, ec), what, " '", path,
               "' is a directory, not a file name");
  fs::path dir = p.parent_path();
  if (dir.empty()) dir = ".";
  ACC_CHECK_AS(IoError, fs::is_directory(dir, ec), what, " '", path, "': directory '", dir.string(),
               "' does not exist");
  ACC_CHECK_AS(IoError, ::access(dir.c_str(), W_OK) == 0, what, " '", path, "': directory '",
               dir.string(), "' is not writable (", std::strerror(errno), ")");
  if (fs::exists(p, ec)) {
    ACC_CHECK_AS(IoError, ::access(p.c_str(), W_OK) == 0, what, " '", path,
                 "' exists and is not writable (", std::strerror(errno), ")");
  }
}

void write_text_file(const std::string& path, const std::string& text, const std::string& what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ACC_CHECK_AS(IoError, out.is_open(), what, ": cannot open '", path, "' for writing (",
               std::strerror(errno), ")");
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  ACC_CHECK_AS(IoError, !out.fail(), what, ": writing '", path, "' failed (", std::strerror(errno),
               ")");
}

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  std::string h(buf);
  for (char& c : h) {
    if (c == '.' || c == '/') c = '_';  // the name is split at dots below
  }
  return h;
}

}  // namespace

std::string temp_file_for(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp." + host_name() + "." + std::to_string(::getpid()) + "." +
         std::to_string(counter.fetch_add(1));
}

std::vector<std::string> remove_stale_temp_files(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  std::error_code ec;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string prefix = target.filename().string() + ".tmp." + host_name() + ".";
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    // <pid>.<n> after the prefix.
    const std::string rest = name.substr(prefix.size());
    const size_t dot = rest.find('.');
    if (dot == std::string::npos || dot == 0) continue;
    const std::string pid_text = rest.substr(0, dot);
    if (pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH)) continue;
    std::error_code rm;
    if (fs::remove(it->path(), rm) && !rm) removed.push_back(it->path().string());
  }
  return removed;
}

void write_text_file_atomically(const std::string& path, const std::string& text,
                                const std::string& what) {
  remove_stale_temp_files(path);
  const std::string tmp = temp_file_for(path);
  std::error_code ignored;
  try {
    write_text_file(tmp, text, what);
    fsync_path(tmp, what);
  } catch (const IoError&) {
    std::filesystem::remove(tmp, ignored);  // a half-written temporary is of no use to anyone
    throw;
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ignored);
    ACC_THROW(IoError, what, ": cannot rename '", tmp, "' to '", path, "': ", ec.message());
  }
  const auto dir = std::filesystem::path(path).parent_path();
  fsync_path(dir.empty() ? "." : dir.string(), what);
}

void fsync_path(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ACC_CHECK_AS(IoError, fd >= 0, what, ": cannot open '", path, "' to flush it (",
               std::strerror(errno), ")");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  ACC_CHECK_AS(IoError, rc == 0, what, ": flushing '", path, "' to disk failed (",
               std::strerror(err), ")");
}

}  // namespace acc
