#pragma once
// One writing job per checkpoint root. Two jobs saving into one root used to clobber each other:
// each save began by removing every leftover temporary directory (the other job's save in
// progress among them), a step of the same number replaced the other job's, and a later
// --resume auto could continue the other run. ROOT/.lock now names the one job that writes there;
// leftovers are removed only by its holder, when every earlier writer is known to be gone.
//
// The lock is an open file description lock (fcntl F_OFD_SETLK, a write lock on the whole file):
//  - the kernel drops it when its holder dies in any way (SIGKILL included): a crashed job never
//    blocks the next, and there is no stale lock to clean up;
//  - unlike a classic POSIX lock (F_SETLK) it is not dropped when the process closes another
//    descriptor of the same file, and unlike flock(2) it reaches the NFS lock manager;
//  - it belongs to the open file description, so a second open of the file conflicts with it in
//    this process as in any other. A process therefore takes a root's lock once; save() and
//    AsyncSaver ask held_here() and take it only for their own write when nobody in the process
//    holds it (lock_for_write).
// The file is opened close-on-exec: a program the holder runs does not inherit the lock (a child
// forked without exec shares it, and the root stays locked until that child exits too).
// ROOT/.lock is never removed: a second job could otherwise lock a new file of the same name.
//
// Filesystems: the lock works where fcntl locks do: local filesystems (tested on ext4 and tmpfs),
// and NFS through its lock manager (NLM for v3, part of the protocol in v4), which is not tested
// here. Where the filesystem has no locks (ENOLCK) taking one fails, naming the root.

#include <cstdint>
#include <optional>
#include <string>

namespace acc::ckpt {

/// Who holds (or last held) a root's lock, as written into ROOT/.lock (one JSON object).
struct LockOwner {
  std::string host;
  int64_t pid = 0;
  std::string started;  // when it took the lock, ISO 8601 UTC: "2025-01-31T12:00:00Z"
  std::string command;  // its command line, cut to 300 characters ("" when unknown)
  /// "pid 4242 on host node1, since 2025-01-31T12:00:00Z (train_gpt --ckpt-dir ck ...)".
  std::string describe() const;
};

class RootLock {
 public:
  /// Takes `root`'s lock for this process without waiting (the root and ROOT/.lock are created
  /// when missing) and writes this process into the file as its owner. Throws acc::IoError naming
  /// the root and its owner (host, pid, start time, command) when another job holds it, naming the
  /// root when this process already holds it, and with the system's error when the lock file
  /// cannot be created, locked (a filesystem without locks: ENOLCK) or written.
  static RootLock acquire(const std::string& root);
  /// Whether a RootLock of this process holds `root`'s lock now.
  static bool held_here(const std::string& root);
  /// What ROOT/.lock says about its owner, or its last one (which may be gone); std::nullopt when
  /// there is no readable owner.
  static std::optional<LockOwner> last_owner(const std::string& root);

  RootLock(RootLock&& other) noexcept;
  RootLock& operator=(RootLock&& other) noexcept;
  RootLock(const RootLock&) = delete;
  RootLock& operator=(const RootLock&) = delete;
  /// Releases the lock (the owner's entry is cleared first).
  ~RootLock();

  const std::string& root() const { return root_; }
  const LockOwner& owner() const { return owner_; }

 private:
  RootLock() = default;
  void release() noexcept;
  std::string root_;
  int fd_ = -1;
  uint64_t dev_ = 0, ino_ = 0;  // the lock file's identity, for held_here()
  LockOwner owner_;
};

/// What a writer of `root` needs for one write: std::nullopt when this process already holds the
/// lock (RootLock::held_here), else the lock, taken (RootLock::acquire). Throws what acquire
/// throws.
std::optional<RootLock> lock_for_write(const std::string& root);

}  // namespace acc::ckpt
