#pragma once
// The on-disk format of a sharded checkpoint (documented for users in checkpoint/README.md).
//
// A checkpoint is a step directory: one shard file per rank that wrote anything
// ("shard-00000.bin", ...) and metadata.json. A shard file is a sequence of chunks; a chunk holds a
// region of one global tensor, compressed with zstd on its own and checksummed with xxh64 (of the
// stored, compressed bytes), so a reader reads and verifies only the chunks it needs. The region
// is a box (per-dimension offsets and sizes, as PyTorch DCP's chunk metadata), with a flat range
// of the box's row-major flattening where the box is itself split (ZeRO or fsdp over a box, or a
// box larger than one chunk); the chunk's elements are the region's, in row-major order.
// metadata.json (format version 2) maps every tensor to its chunks:
//
//   {"format": "autoacc-checkpoint", "version": 2, "step": 42, "world": 2,
//    "model_trace_hash": "9f...", "strategy": [...], "extra": {...},
//    "files": ["shard-00000.bin", "shard-00001.bin"],
//    "tensors": [{"name": "transformer.wte.weight", "kind": "parameter",
//                 "param": "transformer.wte.weight", "field": "", "shape": [256, 128],
//                 "dtype": "f32",
//                 "chunks": [{"file": 0, "offsets": [0, 0], "sizes": [256, 64], "byte_offset": 0,
//                             "byte_length": 65571, "xxh64": "0f1e2d3c4b5a6978"},
//                            {"file": 1, "offsets": [0, 64], "sizes": [256, 64],
//                             "flat": {"offset": 0, "length": 8192}, ...}, ...]}, ...]}
//
// Version 1 (still read): a chunk is {"file", "offset", "length", ...}, a range of the tensor's
// row-major flattening; it reads as the whole tensor's box with that flat range.
//
// parse_metadata trusts nothing in the file: file names must be "shard-NNNNN.bin" (no path can
// leave the directory), one per rank of `world` in rank order, shapes must fit in 64 bits, names
// must be unique, kinds and dtypes known, byte ranges must not overflow, and every tensor's chunks
// must tile it exactly once (tiling_error); every error names the field by its path. Byte ranges
// past the end of a shard file are caught when the file is opened (its size is known then), before
// anything is read.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "acc/dist/sharding.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::ckpt {

inline constexpr const char* kFormatName = "autoacc-checkpoint";
/// The version this build writes; it reads this one and every older one (from 1).
inline constexpr int kFormatVersion = 2;
/// A chunk's uncompressed size is at most this (writers split tensors finer; readers refuse more,
/// so no metadata makes a reader allocate more than this per chunk).
inline constexpr int64_t kMaxChunkBytes = int64_t{256} << 20;
/// metadata.json larger than this is refused before it is read. It grows with the chunks: ~150
/// bytes each in version 2 (a 2-D box with a flat range; ~110 in version 1), 4 MiB of state per
/// chunk by default, so a 2 TB checkpoint (GPT-3 175B with AdamW state) needs ~75 MB; parsing
/// takes ~40 ns and ~11 bytes of memory per byte (benchmarks/bench_json).
inline constexpr int64_t kMaxMetadataBytes = int64_t{256} << 20;

struct ChunkInfo {
  int file = 0;  // index into Metadata::files
  /// The region held: a box of the tensor and, where the box is split further, a flat range of
  /// the box's row-major flattening (none: the whole box).
  dist::Box box;
  std::optional<dist::FlatRange> flat;
  int64_t byte_offset = 0;  // where the compressed bytes start in the file
  int64_t byte_length = 0;  // compressed bytes
  uint64_t xxh64 = 0;       // of the compressed bytes, seed 0
  /// The elements held: the flat range's length, else the box's.
  int64_t numel() const { return flat ? flat->length : box.numel(); }
  /// "box [0:256, 64:128]", with " flat [0, 8192)" when it has one.
  std::string region() const;
};

struct TensorInfo {
  std::string name;  // "transformer.h.0.attn.c_attn.weight", "state.<param>.exp_avg"
  dist::TensorKind kind = dist::TensorKind::kParameter;  // parameter or optimizer state
  std::string param;                                     // the parameter it belongs to
  std::string field;  // optimizer state field ("exp_avg"); "" for a parameter
  Shape shape;
  DType dtype = DType::kFloat32;
  std::vector<ChunkInfo> chunks;  // together they tile the tensor exactly once
  int64_t numel() const;
};

struct Metadata {
  int version = kFormatVersion;  // as read (to_json writes kFormatVersion)
  int64_t step = 0;
  int world = 1;
  std::string model_trace_hash;
  nlohmann::json strategy = nlohmann::json::array();
  nlohmann::json extra = nlohmann::json::object();  // LR schedule, RNG, data position, ...
  std::vector<std::string> files;
  std::vector<TensorInfo> tensors;

  /// metadata.json in format version kFormatVersion (a version-1 checkpoint's comes out as
  /// version 2: its chunks as boxes).
  nlohmann::json to_json() const;
  /// The tensor named `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const;
};

/// "shard-00003.bin".
std::string shard_file_name(int rank);

/// Why the chunks of a tensor do not tile it exactly once: the message, and the chunk (its index)
/// and field ("offsets", "flat") it names, when it names one.
struct TilingError {
  std::string message;
  std::optional<size_t> chunk;
  std::string field;
};
/// std::nullopt when the chunks of `t` tile it exactly once. The rule: chunks with the same box
/// tile that box with their flat ranges (a chunk without one is the whole box), and the distinct
/// boxes lie on one grid (along each dimension their extents partition it) and take every cell of
/// it once, as every sharding of acc/dist/sharding.hpp lays boxes out (a mesh dimension's Shard(d)
/// cuts dimension d alike for every box; a fused q|k|v block adds cuts along its dimension only).
/// Assumes each chunk's region lies inside the tensor (parse_metadata checks that first). Takes
/// O(n log n) for n chunks, whatever the sizes they claim.
std::optional<TilingError> tiling_error(const TensorInfo& t);

/// Checks one chunk's stored bytes against its checksum and decompresses them into `out`
/// (resized to its length x the element size of `dtype`), reading the zstd frame's declared size
/// before allocating anything. Throws acc::IoError naming `where` on a checksum mismatch, a frame
/// that does not declare exactly the chunk's size, or one that does not decompress to it.
void decode_chunk(const char* stored, size_t size, const ChunkInfo& chunk, DType dtype,
                  const std::string& where, std::vector<char>& out);
/// decode_chunk into `dst`, which must hold the chunk's length x element size bytes (checked
/// against the frame before anything is written).
void decode_chunk_into(const char* stored, size_t size, const ChunkInfo& chunk, DType dtype,
                       const std::string& where, char* dst);

/// Parses and validates metadata.json's text (see above), of format version 1 or 2. Throws
/// acc::ValueError "checkpoint metadata '<where>': field '<path>' ..." naming the field: a box with
/// a negative, overflowing or out-of-tensor offset or size, or of another rank than its tensor; a
/// flat range outside its box; chunks that overlap or leave a gap; a version newer than this build
/// reads. Allocates nothing in proportion to what the file claims.
Metadata parse_metadata(const std::string& text, const std::string& where);

}  // namespace acc::ckpt
