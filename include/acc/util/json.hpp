#pragma once
// JSON from users (configs, strategies): stricter than nlohmann::json::parse, because a config
// that says something twice or nests without end is a mistake or an attack, never an intent.
//   - an object that repeats a key is refused at any depth (nlohmann keeps the last value and
//     drops the first without a word);
//   - nesting deeper than kMaxJsonDepth is refused (nlohmann parses any depth, but dump() and
//     comparison recurse, so a few megabytes of '[' would overflow the stack later, e.g. in an
//     error message that prints the value);
//   - errors name what was read (the flag, the file) and nlohmann's line and column.
// Parsing is linear in the text (nlohmann's own callback parser is quadratic on arrays of objects:
// acc/util/json_strict.hpp). Numbers are kept as nlohmann reads them: integers exact as
// int64/uint64, others as double. Trailing text after the value is refused.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace acc {

/// Objects and arrays nested deeper than this are refused. Configs and strategies nest 3 deep.
inline constexpr int kMaxJsonDepth = 128;

/// read_json_file's default limit, for the files people write or tools write for them: model
/// configs, strategies and strategy caches, machine calibration, job files. The largest real one
/// is a strategy cache of a few kilobytes; a Hugging Face config.json is under 10 KB. A
/// checkpoint's metadata.json, which grows with the model, has its own (acc/checkpoint/format.hpp).
inline constexpr int64_t kMaxJsonFileBytes = int64_t{16} << 20;

/// Parses `text` as one JSON value. `what` names the text in messages (e.g. "--strategy", or a
/// flag and its file). Throws acc::ValueError naming `what` for a syntax error (with line and
/// column), trailing text, a repeated object key (naming the key and where it is) or nesting
/// deeper than kMaxJsonDepth.
nlohmann::json parse_json(const std::string& text, const std::string& what);

/// Reads the file at `path` and parses it as parse_json() does; messages start with
/// "<what> '<path>'". Throws acc::IoError naming `what` and `path` when the path is missing, is a
/// directory or otherwise not a regular file, is larger than `max_bytes` (refused before it is
/// read, naming both sizes), or cannot be read (with the system error), and acc::ValueError for
/// what parse_json() refuses. Time and memory are linear in the file's size.
nlohmann::json read_json_file(const std::string& path, const std::string& what,
                              int64_t max_bytes = kMaxJsonFileBytes);

}  // namespace acc
