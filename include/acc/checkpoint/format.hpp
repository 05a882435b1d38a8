#pragma once
// The on-disk format of a sharded checkpoint (documented for users in checkpoint/README.md).
//
// A checkpoint is a step directory: one shard file per rank that wrote anything
// ("shard-00000.bin", ...) and metadata.json. A shard file is a sequence of chunks; a chunk is a
// run of consecutive elements of one global tensor's row-major flattening, compressed with zstd on
// its own and checksummed with xxh64 (of the stored, compressed bytes), so a reader reads and
// verifies only the chunks it needs. metadata.json maps every tensor to its chunks:
//
//   {"format": "autoacc-checkpoint", "version": 1, "step": 42, "world": 2,
//    "model_trace_hash": "9f...", "strategy": [...], "extra": {...},
//    "files": ["shard-00000.bin", "shard-00001.bin"],
//    "tensors": [{"name": "transformer.wte.weight", "kind": "parameter",
//                 "param": "transformer.wte.weight", "field": "", "shape": [256, 128],
//                 "dtype": "f32",
//                 "chunks": [{"file": 0, "offset": 0, "length": 32768, "byte_offset": 0,
//                             "byte_length": 91234, "xxh64": "0f1e2d3c4b5a6978"}]}, ...]}
//
// parse_metadata trusts nothing in the file: file names must be "shard-NNNNN.bin" (no path can
// leave the directory), one per rank of `world` in rank order, shapes and ranges must fit in 64
// bits and inside their tensor, names must be unique, dtypes known, byte ranges must not
// overflow; every error names the field by its path.
// Byte ranges past the end of a shard file are caught when the file is opened (its size is known
// then), before anything is read.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc::ckpt {

inline constexpr const char* kFormatName = "autoacc-checkpoint";
inline constexpr int kFormatVersion = 1;
/// A chunk's uncompressed size is at most this (writers split tensors finer; readers refuse more,
/// so no metadata makes a reader allocate more than this per chunk).
inline constexpr int64_t kMaxChunkBytes = int64_t{256} << 20;
/// metadata.json larger than this is refused before it is read. It grows with the chunks: ~110
/// bytes each, 4 MiB of state per chunk by default, so a 2 TB checkpoint (GPT-3 175B with AdamW
/// state) needs ~55 MB; parsing takes ~40 ns and ~11 bytes of memory per byte
/// (benchmarks/bench_json).
inline constexpr int64_t kMaxMetadataBytes = int64_t{256} << 20;

struct ChunkInfo {
  int file = 0;             // index into Metadata::files
  int64_t offset = 0;       // first element in the tensor's row-major flattening
  int64_t length = 0;       // elements
  int64_t byte_offset = 0;  // where the compressed bytes start in the file
  int64_t byte_length = 0;  // compressed bytes
  uint64_t xxh64 = 0;       // of the compressed bytes, seed 0
};

struct TensorInfo {
  std::string name;   // "transformer.h.0.attn.c_attn.weight", "state.<param>.exp_avg"
  std::string kind;   // "parameter" | "optimizer_state"
  std::string param;  // the parameter it belongs to
  std::string field;  // optimizer state field ("exp_avg"); "" for a parameter
  Shape shape;
  DType dtype = DType::kFloat32;
  std::vector<ChunkInfo> chunks;  // sorted by offset; together they cover the tensor once
  int64_t numel() const;
};

struct Metadata {
  int version = kFormatVersion;
  int64_t step = 0;
  int world = 1;
  std::string model_trace_hash;
  nlohmann::json strategy = nlohmann::json::array();
  nlohmann::json extra = nlohmann::json::object();  // LR schedule, RNG, data position, ...
  std::vector<std::string> files;
  std::vector<TensorInfo> tensors;

  nlohmann::json to_json() const;
  /// The tensor named `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const;
};

/// "shard-00003.bin".
std::string shard_file_name(int rank);

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

/// Parses and validates metadata.json's text (see above). Throws acc::ValueError "checkpoint
/// metadata '<where>': field '<path>' ..." naming the field; a version newer than this build reads
/// is refused by name. Allocates nothing in proportion to what the file claims.
Metadata parse_metadata(const std::string& text, const std::string& where);

}  // namespace acc::ckpt
