#include "acc/checkpoint/root_lock.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "acc/util/error.hpp"

namespace acc::ckpt {
namespace fs = std::filesystem;
namespace {

constexpr const char* kLockFile = ".lock";
constexpr size_t kMaxCommand = 300;

// The lock files this process holds, by identity (device, inode): an OFD lock cannot tell this
// process's other descriptions from another job's, so the process keeps count itself.
std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}
std::set<std::pair<uint64_t, uint64_t>>& registry() {
  static std::set<std::pair<uint64_t, uint64_t>> held;
  return held;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!s.empty() && s.back() == '\0') s.pop_back();
  for (char& c : s) {
    if (c == '\0') c = ' ';
  }
  if (s.size() > kMaxCommand) s = s.substr(0, kMaxCommand - 3) + "...";
  return s;
}

std::optional<LockOwner> parse_owner(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("pid") || !j.at("pid").is_number_integer()) return std::nullopt;
  LockOwner o;
  o.pid = j.at("pid").get<int64_t>();
  auto text_of = [&](const char* key) {
    return j.contains(key) && j.at(key).is_string() ? j.at(key).get<std::string>() : "";
  };
  o.host = text_of("host");
  o.started = text_of("started");
  o.command = text_of("command");
  return o;
}

std::string read_fd(int fd) {
  std::string out;
  char buf[4096];
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(fd, buf, sizeof(buf), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    at += n;
    if (out.size() > 64 * 1024) break;  // an owner entry is a few hundred bytes
  }
  return out;
}

// The holder of a lock this process was refused. The holder writes its entry right after taking
// the lock, so for a moment the file may be empty or still name the previous (dead) holder: wait
// up to a second for an entry that is not obviously stale.
std::string holder_of(int fd) {
  std::optional<LockOwner> o;
  for (int i = 0; i < 50; ++i) {
    o = parse_owner(read_fd(fd));
    const bool stale = o && o->host == host_name() && o->pid > 0 &&
                       ::kill(static_cast<pid_t>(o->pid), 0) != 0 && errno == ESRCH;
    if (o && !stale) return o->describe();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return o ? o->describe() +
                 " (so its entry says, but that process is gone: the holder has not "
                 "written its own yet)"
           : "a job that has not written its name into the lock file yet";
}

bool write_all(int fd, const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n =
        ::pwrite(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

std::string LockOwner::describe() const {
  std::string s = "pid " + std::to_string(pid) + " on host " + (host.empty() ? "?" : host);
  if (!started.empty()) s += ", since " + started;
  if (!command.empty()) s += " (" + command + ")";
  return s;
}

RootLock RootLock::acquire(const std::string& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  ACC_CHECK_AS(IoError, !ec, "checkpoint: cannot create '", root, "': ", ec.message());
  const std::string path = (fs::path(root) / kLockFile).string();
  RootLock lock;  // declared first: on a failure it is closed once the registry is unlocked
  // Serialised in the process, so that two threads cannot both pass the registry and one of them
  // then take the other's lock for another job's.
  std::lock_guard<std::mutex> guard(registry_mutex());
  lock.root_ = root;
  // O_NOFOLLOW: a .lock planted as a symlink would have the owner's entry written over its target.
  lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  ACC_CHECK_AS(IoError, lock.fd_ >= 0, "checkpoint root '", root, "': cannot open its lock file '",
               path, "' (", std::strerror(errno), ")");
  struct stat st {};
  ACC_CHECK_AS(IoError, ::fstat(lock.fd_, &st) == 0, "checkpoint root '", root,
               "': cannot stat its lock file '", path, "' (", std::strerror(errno), ")");
  lock.dev_ = static_cast<uint64_t>(st.st_dev);
  lock.ino_ = static_cast<uint64_t>(st.st_ino);
  ACC_CHECK_AS(IoError, registry().count({lock.dev_, lock.ino_}) == 0, "checkpoint root '", root,
               "' is already locked by this process");
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 0;  // the whole file
  if (::fcntl(lock.fd_, F_OFD_SETLK, &fl) != 0) {
    const int err = errno;
    ACC_CHECK_AS(IoError, err != EAGAIN && err != EACCES, "checkpoint root '", root,
                 "' is in use by another job: ", holder_of(lock.fd_), " holds its lock ('", path,
                 "'); a checkpoint root has one writing job at a time: wait for that job to end "
                 "or write elsewhere");
    ACC_THROW(
        IoError, "checkpoint root '", root, "': cannot lock '", path, "' (", std::strerror(err),
        ")",
        err == ENOLCK ? ": this filesystem has no fcntl locks (see checkpoint/README.md)" : "");
  }
  registry().insert({lock.dev_, lock.ino_});
  lock.owner_ = {host_name(), static_cast<int64_t>(::getpid()), utc_now(), command_line()};
  const std::string entry = nlohmann::json{{"host", lock.owner_.host},
                                           {"pid", lock.owner_.pid},
                                           {"started", lock.owner_.started},
                                           {"command", lock.owner_.command}}
                                .dump() +
                            "\n";
  // fsync: an NFS client of another node reads what reached the server.
  const bool written =
      ::ftruncate(lock.fd_, 0) == 0 && write_all(lock.fd_, entry) && ::fsync(lock.fd_) == 0;
  ACC_CHECK_AS(IoError, written, "checkpoint root '", root, "': cannot write its lock file '", path,
               "' (", std::strerror(errno), ")");
  return lock;
}

bool RootLock::held_here(const std::string& root) {
  struct stat st {};
  if (::stat((fs::path(root) / kLockFile).c_str(), &st) != 0) return false;
  std::lock_guard<std::mutex> guard(registry_mutex());
  return registry().count({static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)}) > 0;
}

std::optional<LockOwner> RootLock::last_owner(const std::string& root) {
  const int fd = ::open((fs::path(root) / kLockFile).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  const std::string text = read_fd(fd);
  ::close(fd);
  return parse_owner(text);
}

RootLock::RootLock(RootLock&& other) noexcept
    : root_(std::move(other.root_)),
      fd_(std::exchange(other.fd_, -1)),
      dev_(other.dev_),
      ino_(other.ino_),
      owner_(std::move(other.owner_)) {}

RootLock& RootLock::operator=(RootLock&& other) noexcept {
  if (this != &other) {
    release();
    root_ = std::move(other.root_);
    fd_ = std::exchange(other.fd_, -1);
    dev_ = other.dev_;
    ino_ = other.ino_;
    owner_ = std::move(other.owner_);
  }
  return *this;
}

RootLock::~RootLock() {
  release();
}

void RootLock::release() noexcept {
  if (fd_ < 0) return;
  std::lock_guard<std::mutex> guard(registry_mutex());
  // Only a holder's entry is cleared: a refused acquire never gets here with the descriptor.
  if (registry().erase({dev_, ino_}) > 0) (void)::ftruncate(fd_, 0);
  ::close(fd_);  // drops the lock
  fd_ = -1;
}

std::optional<RootLock> lock_for_write(const std::string& root) {
  if (RootLock::held_here(root)) return std::nullopt;
  return RootLock::acquire(root);
}

}  // namespace acc::ckpt
