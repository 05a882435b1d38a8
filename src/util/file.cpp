#include "acc/util/file.hpp"

#include <unistd.h>

#include <cerrno>
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

}  // namespace acc
