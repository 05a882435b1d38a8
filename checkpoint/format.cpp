#include "acc/checkpoint/format.hpp"

#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <memory>
#include <set>

#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json.hpp"
#include "acc/util/json_fields.hpp"

namespace acc::ckpt {
namespace {

using json::brief;
using json::Fields;

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

// Every file a checkpoint names: "shard-" five or more digits ".bin", nothing else (no separator,
// no "..": a name can never leave the step directory).
bool valid_file_name(const std::string& s) {
  const std::string pre = "shard-", post = ".bin";
  if (s.size() < pre.size() + 5 + post.size() || s.size() > 32) return false;
  if (s.compare(0, pre.size(), pre) != 0 || s.compare(s.size() - post.size(), post.size(), post)) {
    return false;
  }
  for (size_t i = pre.size(); i < s.size() - post.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
  }
  return true;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n = checked_mul(n, d, "checkpoint tensor '", name, "' elements");
  return n;
}

std::string shard_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "shard-%05d.bin", rank);
  return buf;
}

const TensorInfo* Metadata::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

nlohmann::json Metadata::to_json() const {
  nlohmann::json ts = nlohmann::json::array();
  for (const TensorInfo& t : tensors) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const ChunkInfo& c : t.chunks) {
      chunks.push_back({{"file", c.file},
                        {"offset", c.offset},
                        {"length", c.length},
                        {"byte_offset", c.byte_offset},
                        {"byte_length", c.byte_length},
                        {"xxh64", hex64(c.xxh64)}});
    }
    ts.push_back({{"name", t.name},
                  {"kind", t.kind},
                  {"param", t.param},
                  {"field", t.field},
                  {"shape", t.shape},
                  {"dtype", dtype_name(t.dtype)},
                  {"chunks", chunks}});
  }
  return {{"format", kFormatName},
          {"version", version},
          {"step", step},
          {"world", world},
          {"model_trace_hash", model_trace_hash},
          {"strategy", strategy},
          {"extra", extra},
          {"files", files},
          {"tensors", ts}};
}

int64_t chunk_bytes(const ChunkInfo& c, DType dtype, const std::string& where) {
  const int64_t want =
      checked_mul(c.length, static_cast<int64_t>(element_size(dtype)), where, ": chunk bytes");
  ACC_CHECK_AS(IoError, want <= kMaxChunkBytes, where, ": a chunk of ", want,
               " bytes is over the limit of ", kMaxChunkBytes);
  return want;
}

void decode_chunk_into(const char* stored, size_t size, const ChunkInfo& c, DType dtype,
                       const std::string& where, char* dst) {
  ACC_CHECK_AS(IoError, XXH64(stored, size, 0) == c.xxh64, where, ": checksum mismatch (elements ",
               c.offset, "..", c.offset + c.length, "): the shard is corrupt");
  const int64_t want = chunk_bytes(c, dtype, where);
  const unsigned long long declared = ZSTD_getFrameContentSize(stored, size);
  ACC_CHECK_AS(IoError, declared == static_cast<unsigned long long>(want), where,
               ": the chunk's zstd frame does not declare its ", want, " bytes");
  // One context per thread, kept: making one per chunk costs its allocation every time.
  static thread_local std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> dctx{ZSTD_createDCtx(),
                                                                              ZSTD_freeDCtx};
  ACC_CHECK_AS(IoError, dctx != nullptr, where, ": zstd could not make a context");
  const size_t got = ZSTD_decompressDCtx(dctx.get(), dst, static_cast<size_t>(want), stored, size);
  ACC_CHECK_AS(IoError, !ZSTD_isError(got) && got == static_cast<size_t>(want), where,
               ": the chunk does not decompress to its ", want, " bytes");
}

void decode_chunk(const char* stored, size_t size, const ChunkInfo& c, DType dtype,
                  const std::string& where, std::vector<char>& out) {
  out.resize(static_cast<size_t>(chunk_bytes(c, dtype, where)));
  decode_chunk_into(stored, size, c, dtype, where, out.data());
}

Metadata parse_metadata(const std::string& text, const std::string& where) {
  const std::string what = "checkpoint metadata '" + where + "'";
  const nlohmann::json j = parse_json(text, what);
  Fields f(j, what);
  if (f.string("format") != kFormatName) {
    f.fail("format", "must be \"" + std::string(kFormatName) + "\", got " + brief(j.at("format")));
  }
  Metadata m;
  m.version = static_cast<int>(f.integer("version", 1, std::numeric_limits<int>::max()));
  if (m.version > kFormatVersion) {
    f.fail("version", "is " + std::to_string(m.version) + ", newer than this build reads (" +
                          std::to_string(kFormatVersion) + "): use a newer AutoAcc");
  }
  m.step = f.integer("step", 0, std::numeric_limits<int64_t>::max());
  m.world = static_cast<int>(f.integer("world", 1, 1 << 24));
  m.model_trace_hash = f.string("model_trace_hash");
  m.strategy = f.at("strategy");
  if (!m.strategy.is_array()) f.fail("strategy", "must be a list, got " + brief(m.strategy));
  m.extra = f.at("extra");
  if (!m.extra.is_object()) f.fail("extra", "must be an object, got " + brief(m.extra));

  const nlohmann::json& files = f.at("files");
  if (!files.is_array()) f.fail("files", "must be a list, got " + brief(files));
  std::set<std::string> seen_files;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string at = "files[" + std::to_string(i) + "]";
    if (!files[i].is_string() || !valid_file_name(files[i].get<std::string>())) {
      f.fail(at, "must be a shard file name \"shard-NNNNN.bin\", got " + brief(files[i]));
    }
    if (!seen_files.insert(files[i].get<std::string>()).second) f.fail(at, "is listed twice");
    m.files.push_back(files[i].get<std::string>());
  }
  // One shard file per rank of the saving world, file r being rank r's: a reader of another
  // world size must not take a file of rank r for another rank's.
  if (m.files.size() != static_cast<size_t>(m.world)) {
    f.fail("files", "lists " + std::to_string(m.files.size()) + " shard file(s), but 'world' is " +
                        std::to_string(m.world) + " (one file per rank)");
  }
  for (size_t i = 0; i < m.files.size(); ++i) {
    if (m.files[i] != shard_file_name(static_cast<int>(i))) {
      f.fail("files[" + std::to_string(i) + "]",
             "must be \"" + shard_file_name(static_cast<int>(i)) + "\" (rank " + std::to_string(i) +
                 "'s), got \"" + m.files[i] + "\"");
    }
  }

  const nlohmann::json& tensors = f.at("tensors");
  if (!tensors.is_array()) f.fail("tensors", "must be a list, got " + brief(tensors));
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string at = "tensors[" + std::to_string(i) + "]";
    Fields t(tensors[i], what, at);
    TensorInfo info;
    info.name = t.string("name");
    if (info.name.empty()) t.fail(t.path("name"), "is empty");
    if (!names.insert(info.name).second) {
      t.fail(t.path("name"), "repeats the tensor name '" + info.name + "'");
    }
    info.kind = t.string("kind");
    if (info.kind != "parameter" && info.kind != "optimizer_state") {
      t.fail(t.path("kind"),
             "must be \"parameter\" or \"optimizer_state\", got \"" + info.kind + "\"");
    }
    info.param = t.string("param");
    info.field = t.string("field");
    const nlohmann::json& shape = t.at("shape");
    if (!shape.is_array() || shape.size() > 8) {
      t.fail(t.path("shape"), "must be a list of at most 8 sizes, got " + brief(shape));
    }
    int64_t numel = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (!shape[d].is_number_integer() || shape[d].get<int64_t>() < 0) {
        t.fail(t.path("shape"), "must hold sizes >= 0, got " + brief(shape));
      }
      const int64_t s = shape[d].get<int64_t>();
      if (s > 0 && numel > std::numeric_limits<int64_t>::max() / s) {
        t.fail(t.path("shape"), "has " + brief(shape) + " elements, more than 64 bits count");
      }
      numel *= s;
      info.shape.push_back(s);
    }
    const std::string dtype = t.string("dtype");
    try {
      info.dtype = parse_dtype(dtype);
    } catch (const ValueError&) {
      t.fail(t.path("dtype"), "is not a known dtype: \"" + dtype + "\"");
    }
    if (numel >
        std::numeric_limits<int64_t>::max() / static_cast<int64_t>(element_size(info.dtype))) {
      t.fail(t.path("shape"), "is too large in bytes: " + brief(shape));
    }
    const nlohmann::json& chunks = t.at("chunks");
    if (!chunks.is_array()) t.fail(t.path("chunks"), "must be a list, got " + brief(chunks));
    int64_t covered = 0;  // the chunks, in order, tile [0, numel)
    for (size_t c = 0; c < chunks.size(); ++c) {
      const std::string cat = t.path("chunks") + "[" + std::to_string(c) + "]";
      Fields ch(chunks[c], what, cat);
      ChunkInfo ci;
      ci.file = static_cast<int>(ch.integer("file", 0, static_cast<int64_t>(m.files.size()) - 1));
      ci.offset = ch.integer("offset", 0, numel);
      ci.length =
          ch.integer("length", 1,
                     std::min(numel - ci.offset,
                              kMaxChunkBytes / static_cast<int64_t>(element_size(info.dtype))));
      if (ci.offset != covered) {
        ch.fail(ch.path("offset"),
                "is " + std::to_string(ci.offset) + ", but the chunks before it end at " +
                    std::to_string(covered) + " (chunks must tile the tensor in order)");
      }
      covered = ci.offset + ci.length;
      const int64_t max = std::numeric_limits<int64_t>::max();
      ci.byte_offset = ch.integer("byte_offset", 0, max);
      ci.byte_length = ch.integer("byte_length", 1, max - ci.byte_offset);
      const std::string hex = ch.string("xxh64");
      if (hex.size() != 16 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
        ch.fail(ch.path("xxh64"), "must be 16 lower-case hex digits, got \"" + hex + "\"");
      }
      ci.xxh64 = std::stoull(hex, nullptr, 16);
      ch.no_others();
      info.chunks.push_back(ci);
    }
    if (covered != numel) {
      t.fail(t.path("chunks"),
             "cover elements [0, " + std::to_string(covered) + ") of " + std::to_string(numel));
    }
    t.no_others();
    m.tensors.push_back(std::move(info));
  }
  f.no_others();
  return m;
}

}  // namespace acc::ckpt
