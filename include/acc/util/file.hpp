#pragma once
// Output files: checked before the work that produces them starts, and every write checked, so a
// bad path fails at once with the path named instead of after a long run (or not at all).

#include <string>
#include <vector>

namespace acc {

/// Throws acc::IoError naming `what` (the flag, e.g. "--json") and `path` unless a file can be
/// created or replaced there: the path is not empty, not a directory, its directory exists and is
/// writable, and an existing file there is writable. Creates nothing.
void check_output_path(const std::string& path, const std::string& what);

/// Writes `text` to `path` (replacing it), checking the open, the write and the close; throws
/// acc::IoError naming `what` and `path` on any failure.
void write_text_file(const std::string& path, const std::string& text, const std::string& what);

/// Flushes the file or directory at `path` to the disk (fsync). Throws acc::IoError naming `what`
/// and the path.
void fsync_path(const std::string& path, const std::string& what);

/// Writes `text` to `path` so that a reader sees the old file or the new one, never a part, also
/// after a power loss: into temp_file_for(path) first (removing stale temporaries of killed
/// writers), fsynced, renamed into place, and the directory fsynced. The directory must exist.
/// Throws acc::IoError naming `what` and the path on failure (the temporary removed). A crash
/// between the write and the rename leaves only the temporary, which the next save removes.
void write_text_file_atomically(const std::string& path, const std::string& text,
                                const std::string& what);

/// The name an atomic save of `path` writes first and renames into place:
/// "<path>.tmp.<host>.<pid>.<n>", unique per host, process and call.
std::string temp_file_for(const std::string& path);

/// Removes the temporary files of earlier saves of `path` whose process is gone (a save killed
/// with SIGKILL leaves one): those named by temp_file_for() on this host whose pid no longer
/// runs. A save in progress in a live process, or on another host, is never touched. Returns the
/// paths removed. Never throws (a file it cannot remove is left).
std::vector<std::string> remove_stale_temp_files(const std::string& path);

}  // namespace acc
