#pragma once
// Where a checkpoint's pieces live on disk, and what a reader or writer may take as one:
//
//   ROOT/.lock               the writing job's lock (root_lock.hpp)
//   ROOT/latest              "step-00000042\n"
//   ROOT/step-00000042/      a committed step: metadata.json and shard-NNNNN.bin files
//   ROOT/.tmp-step-...       a save in progress (or the leftover of one that died)
//
// A reader finds committed steps by their directory names (step- and up to 18 digits) and trusts
// nothing else about them: a step directory or file reached through a symlink that leads out of
// the checkpoint root is refused (a checkpoint cannot make a reader open /dev/zero or another
// job's files), and a directory's name must agree with its metadata's step.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace acc::ckpt {

/// The largest step a checkpoint holds: 18 digits, the widest step-N name the readers take.
/// save() refuses a larger one (it would be written where no reader finds it).
inline constexpr int64_t kMaxStep = 999'999'999'999'999'999;

/// "step-00000042" (8 digits at least, more for steps past 99999999).
std::string step_dir_name(int64_t step);
/// The step a directory name says ("step-" and 1 to 18 digits), or std::nullopt for another name.
std::optional<int64_t> step_of_dir_name(const std::string& name);

/// The committed step directories under `root`, oldest first (those with a metadata.json).
std::vector<std::string> committed_steps(const std::string& root);

/// The newest committed step directory under `root` (what ROOT/latest names, or a newer one whose
/// save died after its rename and before the pointer moved); std::nullopt when there is none. A
/// path that is itself a step directory (has a metadata.json) is returned as it is.
std::optional<std::string> resolve(const std::string& root_or_step);

/// Throws acc::IoError unless `step_dir` really lies in the directory that holds it (its checkpoint
/// root): a step directory that is a symlink leading elsewhere is refused, naming both paths.
void check_step_dir(const std::string& step_dir);

/// A file of a step directory (metadata.json, a shard) opened for reading, closed with its owner.
class StepFile {
 public:
  /// Opens step_dir/name after checking that it does not lead out of the checkpoint root (the
  /// step directory's parent) through a symlink and that it is a regular file. Throws
  /// acc::IoError naming the path: "is missing" only when nothing is there; otherwise what is
  /// wrong (not a regular file, outside the root) or the system's error (permission denied, ...).
  static StepFile open(const std::string& step_dir, const std::string& name);
  StepFile(StepFile&& other) noexcept;
  StepFile& operator=(StepFile&& other) noexcept;
  StepFile(const StepFile&) = delete;
  StepFile& operator=(const StepFile&) = delete;
  ~StepFile();

  int fd() const { return fd_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  /// The whole file. Throws acc::IoError naming the path and the system error.
  std::string read_all() const;
  /// `n` bytes at `offset`, all of them. Throws acc::IoError naming the path.
  void read_at(int64_t offset, char* into, int64_t n) const;

 private:
  StepFile() = default;
  int fd_ = -1;
  int64_t size_ = 0;
  std::string path_;
};

/// Whether `path` is `dir` or lies inside it, after following symlinks (either may not exist yet:
/// the existing part of each is resolved).
bool path_within(const std::string& path, const std::string& dir);

/// The checkpoint root or step directory that holds `path` (the nearest enclosing directory with a
/// metadata.json, a `latest`, a `.lock` or a committed step), or std::nullopt.
std::optional<std::string> enclosing_checkpoint(const std::string& path);

/// Throws acc::IoError naming `what`, the path and the checkpoint when `path` lies inside a
/// checkpoint root or step directory: a tool's output written there could replace a shard, the
/// metadata or a step (export-safetensors into its own input destroyed the checkpoint).
void check_outside_checkpoints(const std::string& path, const std::string& what);

/// Deletes every committed step of `root` and its `latest` pointer (a job starting over, an
/// import with --force); returns the names of the steps deleted, oldest first. This process must
/// hold the root's lock (RootLock): throws acc::ValueError otherwise, and acc::IoError naming a
/// step that could not be deleted (those before it are gone).
std::vector<std::string> remove_committed_steps(const std::string& root);

}  // namespace acc::ckpt
