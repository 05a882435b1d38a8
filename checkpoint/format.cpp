#include "acc/checkpoint/format.hpp"

#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <tuple>

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

std::string ChunkInfo::region() const {
  std::string out = "box " + box.to_string();
  if (flat) {
    out += " flat [" + std::to_string(flat->offset) + ", " + std::to_string(flat->end()) + ")";
  }
  return out;
}

nlohmann::json Metadata::to_json() const {
  nlohmann::json ts = nlohmann::json::array();
  for (const TensorInfo& t : tensors) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const ChunkInfo& c : t.chunks) {
      nlohmann::json j = {{"file", c.file}, {"offsets", c.box.offsets}, {"sizes", c.box.sizes}};
      if (c.flat) j["flat"] = {{"offset", c.flat->offset}, {"length", c.flat->length}};
      j["byte_offset"] = c.byte_offset;
      j["byte_length"] = c.byte_length;
      j["xxh64"] = hex64(c.xxh64);
      chunks.push_back(std::move(j));
    }
    ts.push_back({{"name", t.name},
                  {"kind", dist::tensor_kind_name(t.kind)},
                  {"param", t.param},
                  {"field", t.field},
                  {"shape", t.shape},
                  {"dtype", dtype_name(t.dtype)},
                  {"chunks", chunks}});
  }
  return {{"format", kFormatName},
          {"version", kFormatVersion},
          {"step", step},
          {"world", world},
          {"model_trace_hash", model_trace_hash},
          {"strategy", strategy},
          {"extra", extra},
          {"files", files},
          {"tensors", ts}};
}

namespace {

bool boxes_overlap(const dist::Box& a, const dist::Box& b) {
  for (size_t k = 0; k < a.sizes.size(); ++k) {
    if (std::max(a.offsets[k], b.offsets[k]) >=
        std::min(a.offsets[k] + a.sizes[k], b.offsets[k] + b.sizes[k])) {
      return false;
    }
  }
  return true;
}

std::string range_text(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

}  // namespace

std::optional<TilingError> tiling_error(const TensorInfo& t) {
  const std::vector<ChunkInfo>& cs = t.chunks;
  const size_t rank = t.shape.size();
  // 1. Chunks of one box tile it with their flat ranges: in order of (box, flat offset), each
  // starts where the one before it ended.
  std::vector<size_t> order(cs.size());
  std::iota(order.begin(), order.end(), size_t{0});
  const auto flat_of = [&](size_t i) {
    return cs[i].flat.value_or(dist::FlatRange{0, cs[i].box.numel()});
  };
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int64_t fa = flat_of(a).offset, fb = flat_of(b).offset;
    return std::tie(cs[a].box.offsets, cs[a].box.sizes, fa) <
           std::tie(cs[b].box.offsets, cs[b].box.sizes, fb);
  });
  std::vector<size_t> boxes;  // the first chunk of each distinct box
  for (size_t i = 0; i < order.size();) {
    const dist::Box& box = cs[order[i]].box;
    boxes.push_back(order[i]);
    int64_t next = 0;
    size_t last = order[i];
    for (; i < order.size() && cs[order[i]].box == box; ++i) {
      const size_t c = order[i];
      const dist::FlatRange f = flat_of(c);
      const std::string field = cs[c].flat ? "flat" : "offsets";
      if (f.offset < next) {
        return TilingError{"holds elements " + range_text(f.offset, std::min(next, f.end())) +
                               " of box " + box.to_string() + ", which chunk " +
                               std::to_string(last) + " (" + cs[last].region() +
                               ") holds too (chunks overlap)",
                           c, field};
      }
      if (f.offset > next) {
        return TilingError{"starts at element " + std::to_string(f.offset) + " of box " +
                               box.to_string() + ": elements " + range_text(next, f.offset) +
                               " of the box are in no chunk",
                           c, field};
      }
      next = f.end();
      last = c;
    }
    if (next < box.numel()) {
      return TilingError{"ends at element " + std::to_string(next) + " of box " + box.to_string() +
                             ": elements " + range_text(next, box.numel()) +
                             " of the box are in no chunk",
                         last, cs[last].flat ? "flat" : "offsets"};
    }
  }
  // 2. The distinct boxes lie on one grid: along each dimension their extents partition it.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> extents(rank);  // (offset, size)
  for (size_t k = 0; k < rank; ++k) {
    std::vector<std::tuple<int64_t, int64_t, size_t>> ext;  // offset, size, chunk
    for (size_t b : boxes) ext.emplace_back(cs[b].box.offsets[k], cs[b].box.sizes[k], b);
    std::sort(ext.begin(), ext.end());
    int64_t next = 0;
    size_t reach = 0;  // the chunk whose extent reaches furthest so far
    for (size_t i = 0; i < ext.size(); ++i) {
      const auto [o, size, c] = ext[i];
      if (i > 0 && o == std::get<0>(ext[i - 1]) && size == std::get<1>(ext[i - 1])) continue;
      if (o < next) {
        const dist::Box& other = cs[reach].box;
        if (boxes_overlap(cs[c].box, other)) {
          return TilingError{"gives box " + cs[c].box.to_string() + ", which overlaps box " +
                                 other.to_string() + " of chunk " + std::to_string(reach),
                             c, "offsets"};
        }
        return TilingError{
            "gives box " + cs[c].box.to_string() +
                ", which is not on the grid of the others: along dimension " + std::to_string(k) +
                " it spans " + range_text(o, o + size) + ", box " + other.to_string() +
                " of chunk " + std::to_string(reach) + " spans " +
                range_text(other.offsets[k], other.offsets[k] + other.sizes[k]) +
                " (a tensor's boxes lie on one grid: along each dimension their spans are equal "
                "or disjoint)",
            c, "offsets"};
      }
      if (o > next) {
        return TilingError{"leave indices " + range_text(next, o) + " of dimension " +
                               std::to_string(k) + " (size " + std::to_string(t.shape[k]) +
                               ") in no chunk",
                           std::nullopt, ""};
      }
      extents[k].emplace_back(o, size);
      next = o + size;
      reach = c;
    }
    if (next < t.shape[k]) {
      return TilingError{"leave indices " + range_text(next, t.shape[k]) + " of dimension " +
                             std::to_string(k) + " (size " + std::to_string(t.shape[k]) +
                             ") in no chunk",
                         std::nullopt, ""};
    }
  }
  // 3. ... and take every cell of it: as many distinct boxes as cells (each box is a cell, and
  // distinct boxes distinct cells). The first cell missing is among the first boxes.size() + 1.
  size_t cells = 1;
  for (const auto& e : extents) {
    cells = e.empty() ? 0 : std::min(cells * e.size(), boxes.size() + 1);
  }
  if (boxes.size() < cells) {
    std::set<std::vector<int64_t>> held;
    for (size_t b : boxes) held.insert(cs[b].box.offsets);
    std::vector<size_t> at(rank, 0);  // a cell: an extent per dimension
    while (true) {
      dist::Box cell;
      for (size_t k = 0; k < rank; ++k) {
        cell.offsets.push_back(extents[k][at[k]].first);
        cell.sizes.push_back(extents[k][at[k]].second);
      }
      if (held.count(cell.offsets) == 0) {
        return TilingError{rank == 0
                               ? std::string("leave the tensor (a scalar) in no chunk")
                               : "leave box " + cell.to_string() + " of the tensor in no chunk",
                           std::nullopt, ""};
      }
      size_t k = rank;
      for (; k > 0; --k) {  // the next cell, the last dimension fastest
        if (++at[k - 1] < extents[k - 1].size()) break;
        at[k - 1] = 0;
      }
      if (k == 0) break;  // unreachable: fewer boxes than cells
    }
  }
  return std::nullopt;
}

int64_t chunk_bytes(const ChunkInfo& c, DType dtype, const std::string& where) {
  const int64_t want =
      checked_mul(c.numel(), static_cast<int64_t>(element_size(dtype)), where, ": chunk bytes");
  ACC_CHECK_AS(IoError, want <= kMaxChunkBytes, where, ": a chunk of ", want,
               " bytes is over the limit of ", kMaxChunkBytes);
  return want;
}

void decode_chunk_into(const char* stored, size_t size, const ChunkInfo& c, DType dtype,
                       const std::string& where, char* dst) {
  ACC_CHECK_AS(IoError, XXH64(stored, size, 0) == c.xxh64, where, ": checksum mismatch (",
               c.region(), "): the shard is corrupt");
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

namespace {

// A version-1 chunk's region: elements [offset, offset + length) of the tensor's flattening, the
// chunks in order, each starting where the one before it ended.
ChunkInfo v1_chunk(Fields& ch, const TensorInfo& t, int64_t numel, int64_t max_elements) {
  const int64_t covered = t.chunks.empty() ? 0 : t.chunks.back().flat->end();
  ChunkInfo ci;
  ci.box = dist::Box::whole(t.shape);
  const int64_t offset = ch.integer("offset", 0, numel);
  const int64_t length = ch.integer("length", 1, std::min(numel - offset, max_elements));
  if (offset != covered) {
    ch.fail(ch.path("offset"), "is " + std::to_string(offset) +
                                   ", but the chunks before it end at " + std::to_string(covered) +
                                   " (chunks must tile the tensor in order)");
  }
  ci.flat = dist::FlatRange{offset, length};
  return ci;
}

// A list of one integer per dimension of `t`, each in [lo(k), hi(k)]; named by `field`.
std::vector<int64_t> per_dimension(Fields& ch, const std::string& field, const TensorInfo& t,
                                   const std::function<int64_t(size_t)>& lo,
                                   const std::function<int64_t(size_t)>& hi) {
  const nlohmann::json& v = ch.at(field);
  const size_t rank = t.shape.size();
  if (!v.is_array() || v.size() != rank) {
    ch.fail(ch.path(field), "must be a list of " + std::to_string(rank) +
                                " integer(s), one per dimension of shape " + to_string(t.shape) +
                                ", got " + brief(v));
  }
  std::vector<int64_t> out;
  for (size_t k = 0; k < rank; ++k) {
    const nlohmann::json& x = v[k];
    const int64_t a = lo(k), b = hi(k);
    const bool ok = x.is_number_integer() &&
                    !(x.is_number_unsigned() && x.get<uint64_t>() > static_cast<uint64_t>(b)) &&
                    x.get<int64_t>() >= a && x.get<int64_t>() <= b;
    if (!ok) {
      ch.fail(ch.path(field) + "[" + std::to_string(k) + "]",
              "must be an integer in [" + std::to_string(a) + ", " + std::to_string(b) +
                  "] (dimension " + std::to_string(k) + " of shape " + to_string(t.shape) +
                  "), got " + brief(x));
    }
    out.push_back(x.get<int64_t>());
  }
  return out;
}

// A version-2 chunk's region: a box inside the tensor (offsets in [0, size - 1], sizes in
// [1, size - offset]: no sum can overflow), and an optional flat range inside the box.
ChunkInfo v2_chunk(Fields& ch, const TensorInfo& t, int64_t max_elements) {
  ChunkInfo ci;
  ci.box.offsets = per_dimension(
      ch, "offsets", t, [](size_t) { return int64_t{0}; },
      [&](size_t k) { return t.shape[k] - 1; });
  ci.box.sizes = per_dimension(
      ch, "sizes", t, [](size_t) { return int64_t{1}; },
      [&](size_t k) { return t.shape[k] - ci.box.offsets[k]; });
  const int64_t box_numel = ci.box.numel();  // at most the tensor's: no overflow
  if (const nlohmann::json* flat = ch.optional("flat")) {
    Fields f(*flat, ch.what(), ch.path("flat"));
    const int64_t offset = f.integer("offset", 0, box_numel - 1);
    const int64_t length = f.integer("length", 1, box_numel - offset);
    f.no_others();
    ci.flat = dist::FlatRange{offset, length};
  }
  if (ci.numel() > max_elements) {
    ch.fail(ch.path(ci.flat ? "flat" : "sizes"),
            "holds " + std::to_string(ci.numel()) + " elements, more than a chunk may (" +
                std::to_string(max_elements) + " of " + dtype_name(t.dtype) + ", " +
                std::to_string(kMaxChunkBytes) + " bytes)");
  }
  return ci;
}

}  // namespace

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
    const std::string kind = t.string("kind");
    if (kind == dist::tensor_kind_name(dist::TensorKind::kParameter)) {
      info.kind = dist::TensorKind::kParameter;
    } else if (kind == dist::tensor_kind_name(dist::TensorKind::kOptimizerState)) {
      info.kind = dist::TensorKind::kOptimizerState;
    } else {
      t.fail(t.path("kind"), "must be \"parameter\" or \"optimizer_state\", got \"" + kind + "\"");
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
    const int64_t max_elements = kMaxChunkBytes / static_cast<int64_t>(element_size(info.dtype));
    for (size_t c = 0; c < chunks.size(); ++c) {
      Fields ch(chunks[c], what, t.path("chunks") + "[" + std::to_string(c) + "]");
      info.chunks.push_back(m.version == 1 ? v1_chunk(ch, info, numel, max_elements)
                                           : v2_chunk(ch, info, max_elements));
      ChunkInfo& ci = info.chunks.back();
      ci.file = static_cast<int>(ch.integer("file", 0, static_cast<int64_t>(m.files.size()) - 1));
      const int64_t max = std::numeric_limits<int64_t>::max();
      ci.byte_offset = ch.integer("byte_offset", 0, max);
      ci.byte_length = ch.integer("byte_length", 1, max - ci.byte_offset);
      const std::string hex = ch.string("xxh64");
      if (hex.size() != 16 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
        ch.fail(ch.path("xxh64"), "must be 16 lower-case hex digits, got \"" + hex + "\"");
      }
      ci.xxh64 = std::stoull(hex, nullptr, 16);
      ch.no_others();
    }
    if (m.version == 1) {
      const int64_t covered = info.chunks.empty() ? 0 : info.chunks.back().flat->end();
      if (covered != numel) {
        t.fail(t.path("chunks"),
               "cover elements [0, " + std::to_string(covered) + ") of " + std::to_string(numel));
      }
      // Version 1's ranges are of the whole tensor: its box, with no flat range when one chunk
      // holds it all.
      for (ChunkInfo& ci : info.chunks) {
        if (ci.flat->length == numel) ci.flat.reset();
      }
    } else if (const std::optional<TilingError> e = tiling_error(info)) {
      t.fail(e->chunk ? t.path("chunks") + "[" + std::to_string(*e->chunk) + "]." + e->field
                      : t.path("chunks"),
             e->message);
    }
    t.no_others();
    m.tensors.push_back(std::move(info));
  }
  f.no_others();
  return m;
}

}  // namespace acc::ckpt
