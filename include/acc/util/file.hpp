#pragma once
// Output files: checked before the work that produces them starts, and every write checked, so a
// bad path fails at once with the path named instead of after a long run (or not at all).

#include <string>

namespace acc {

/// Throws acc::IoError naming `what` (the flag, e.g. "--json") and `path` unless a file can be
/// created or replaced there: the path is not empty, not a directory, its directory exists and is
/// writable, and an existing file there is writable. Creates nothing.
void check_output_path(const std::string& path, const std::string& what);

/// Writes `text` to `path` (replacing it), checking the open, the write and the close; throws
/// acc::IoError naming `what` and `path` on any failure.
void write_text_file(const std::string& path, const std::string& text, const std::string& what);

}  // namespace acc
