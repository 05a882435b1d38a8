#include "acc/checkpoint/layout.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "acc/checkpoint/root_lock.hpp"
#include "acc/util/error.hpp"

namespace acc::ckpt {
namespace fs = std::filesystem;
namespace {

// `p` absolute, without "." or ".." parts and without a trailing separator.
fs::path normal(const fs::path& p) {
  fs::path n = fs::absolute(p).lexically_normal();
  if (n.filename().empty() && n.has_parent_path() && n != n.root_path()) n = n.parent_path();
  return n;
}

// Whether canonical `inner` is `outer` or below it (both already resolved).
bool below_or_at(const fs::path& inner, const fs::path& outer) {
  auto o = outer.begin(), i = inner.begin();
  for (; o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

// The existing part of `p` with its symlinks followed, the rest appended (as weakly_canonical).
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(normal(p), ec);
  return ec ? normal(p) : normal(r);
}

// A step directory (metadata.json beside a first shard, or under a step-N name) or a root (a
// committed step, a `latest` naming one, or a lock file with an owner's entry). Names alone are
// not enough: "metadata.json" and ".lock" are common in directories of other tools.
bool looks_like_checkpoint(const fs::path& dir) {
  std::error_code ec;
  if (fs::is_regular_file(dir / "metadata.json", ec) &&
      (fs::exists(dir / "shard-00000.bin", ec) || step_of_dir_name(dir.filename().string()))) {
    return true;
  }
  if (!committed_steps(dir.string()).empty() || RootLock::last_owner(dir.string())) return true;
  std::ifstream latest(dir / "latest");
  std::string name;
  return latest && std::getline(latest, name) && step_of_dir_name(name);
}

}  // namespace

std::string step_dir_name(int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> step_of_dir_name(const std::string& name) {
  if (name.size() <= 5 || name.size() > 5 + 18 || name.rfind("step-", 0) != 0 ||
      name.find_first_not_of("0123456789", 5) != std::string::npos) {
    return std::nullopt;
  }
  return std::stoll(name.substr(5));
}

std::vector<std::string> committed_steps(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const auto& d : fs::directory_iterator(root, ec)) {
    const std::optional<int64_t> step = step_of_dir_name(d.path().filename().string());
    if (!step || !fs::is_regular_file(d.path() / "metadata.json", ec)) continue;
    found.emplace_back(*step, d.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, path] : found) out.push_back(std::move(path));
  return out;
}

std::optional<std::string> resolve(const std::string& root_or_step) {
  std::error_code ec;
  if (fs::is_regular_file(fs::path(root_or_step) / "metadata.json", ec)) return root_or_step;
  // The newest committed step. `latest` says the same unless a save died between renaming its
  // directory and updating the pointer: that step is committed all the same (its metadata was
  // written before the rename), and losing it would lose committed work.
  std::vector<std::string> steps = committed_steps(root_or_step);
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

void check_step_dir(const std::string& step_dir) {
  const fs::path dir = normal(step_dir);
  std::error_code ec;
  const fs::path real = fs::canonical(dir, ec);
  if (ec) return;  // nothing there: reading its metadata names what is missing
  const fs::path root = resolved(dir.parent_path());
  ACC_CHECK_AS(IoError, below_or_at(real, root) && real != root, "checkpoint '", step_dir,
               "' leads out of its checkpoint root '", dir.parent_path().string(),
               "' through a symlink (to '", real.string(),
               "'): a checkpoint is read only from its own root");
}

StepFile StepFile::open(const std::string& step_dir, const std::string& name) {
  check_step_dir(step_dir);
  StepFile f;
  f.path_ = (fs::path(step_dir) / name).string();
  const std::string where = "checkpoint '" + step_dir + "': '" + name + "'";
  struct stat st {};
  if (::stat(f.path_.c_str(), &st) != 0) {
    const int err = errno;
    ACC_CHECK_AS(IoError, err != ENOENT, where, " is missing (", f.path_, ")");
    ACC_THROW(IoError, where, " cannot be read (", std::strerror(err), ")");
  }
  std::error_code ec;
  const fs::path real = fs::canonical(f.path_, ec);
  const fs::path root = resolved(normal(step_dir).parent_path());
  ACC_CHECK_AS(IoError, !ec && below_or_at(real, root), where,
               " leads out of the checkpoint root '", root.string(), "' through a symlink (to '",
               ec ? ec.message() : real.string(),
               "'): a checkpoint is read only from its own root");
  ACC_CHECK_AS(IoError, S_ISREG(st.st_mode), where, " cannot be read: it is ",
               S_ISDIR(st.st_mode) ? "a directory" : "not a regular file", ", not a file");
  f.fd_ = ::open(f.path_.c_str(), O_RDONLY | O_CLOEXEC);
  ACC_CHECK_AS(IoError, f.fd_ >= 0, where, " cannot be read (", std::strerror(errno), ")");
  struct stat opened {};
  ACC_CHECK_AS(IoError, ::fstat(f.fd_, &opened) == 0, where, " cannot be read (",
               std::strerror(errno), ")");
  f.size_ = static_cast<int64_t>(opened.st_size);
  return f;
}

StepFile::StepFile(StepFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(other.size_), path_(std::move(other.path_)) {}

StepFile& StepFile::operator=(StepFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
    path_ = std::move(other.path_);
  }
  return *this;
}

StepFile::~StepFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string StepFile::read_all() const {
  std::string out(static_cast<size_t>(size_), '\0');
  read_at(0, out.data(), size_);
  return out;
}

void StepFile::read_at(int64_t offset, char* into, int64_t n) const {
  for (int64_t got = 0; got < n;) {
    const ssize_t r = ::pread(fd_, into + got, static_cast<size_t>(n - got), offset + got);
    if (r < 0 && errno == EINTR) continue;
    ACC_CHECK_AS(IoError, r > 0, "checkpoint: reading '", path_, "' failed (",
                 r < 0 ? std::strerror(errno) : "end of file", ")");
    got += r;
  }
}

bool path_within(const std::string& path, const std::string& dir) {
  return below_or_at(resolved(path), resolved(dir));
}

std::optional<std::string> enclosing_checkpoint(const std::string& path) {
  for (fs::path d = resolved(path);; d = d.parent_path()) {
    std::error_code ec;
    if (fs::is_directory(d, ec) && looks_like_checkpoint(d)) return d.string();
    if (d == d.root_path() || !d.has_parent_path()) return std::nullopt;
  }
}

void check_outside_checkpoints(const std::string& path, const std::string& what) {
  const std::optional<std::string> ck = enclosing_checkpoint(path);
  ACC_CHECK_AS(IoError, !ck.has_value(), what, " '", path, "' lies inside the checkpoint '",
               ck.value_or(""),
               "': writing there could replace its files; write the output elsewhere");
}

std::vector<std::string> remove_committed_steps(const std::string& root) {
  ACC_CHECK(RootLock::held_here(root), "checkpoint root '", root,
            "': deleting its steps needs its lock (RootLock), which this process does not hold");
  std::vector<std::string> removed;
  std::error_code ec;
  // `latest` first: a deletion cut short leaves steps that readers find without it, never a
  // pointer to a step that is gone.
  fs::remove(fs::path(root) / "latest", ec);
  ACC_CHECK_AS(IoError, !ec, "checkpoint root '", root,
               "': cannot delete 'latest': ", ec.message());
  for (const std::string& step : committed_steps(root)) {
    fs::remove_all(step, ec);
    ACC_CHECK_AS(IoError, !ec, "checkpoint root '", root, "': cannot delete '", step,
                 "': ", ec.message());
    removed.push_back(fs::path(step).filename().string());
  }
  return removed;
}

}  // namespace acc::ckpt
