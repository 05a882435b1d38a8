// libFuzzer target: a checkpoint's readers on hostile bytes. The input is metadata.json's text, a
// NUL, then a shard file's bytes. acc::ckpt::parse_metadata must refuse bad metadata with an
// acc::Error (accepted metadata must survive a to_json round trip, and its chunks must hold every
// element of their tensor once: counted for every tensor, element by element for small ones, so
// a box or flat range that tiling_error lets through wrongly is a finding); then every chunk whose
// byte range lies in the shard goes through acc::ckpt::decode_chunk, as a loader reads it, once
// with the chunk's own checksum and once with the checksum of the bytes it points at (so the zstd
// frame checks and the decompression are reached, not only the checksum). Seeds: format version 1
// (metadata_only.json, small.bin) and 2 (boxes_v2.*, made by make_checkpoint_corpus.py).
#include <xxhash.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "acc/checkpoint/format.hpp"
#include "acc/util/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string all(reinterpret_cast<const char*>(data), size);
  const size_t nul = all.find('\0');
  const std::string text = all.substr(0, nul);
  const std::string shard = nul == std::string::npos ? std::string() : all.substr(nul + 1);
  acc::ckpt::Metadata m;
  try {
    m = acc::ckpt::parse_metadata(text, "fuzz");
  } catch (const acc::Error&) {
    return 0;
  }
  if (acc::ckpt::parse_metadata(m.to_json().dump(), "fuzz").to_json() != m.to_json()) {
    std::fprintf(stderr, "checkpoint_fuzz: metadata changes on a to_json round trip\n");
    std::abort();
  }
  for (const auto& t : m.tensors) {
    int64_t held = 0;
    for (const auto& c : t.chunks) held += c.numel();
    if (held != t.numel()) {
      std::fprintf(stderr, "checkpoint_fuzz: '%s' has %lld elements, its chunks hold %lld\n",
                   t.name.c_str(), static_cast<long long>(t.numel()), static_cast<long long>(held));
      std::abort();
    }
    if (t.numel() > 4096) continue;
    std::vector<int> times(static_cast<size_t>(t.numel()), 0);
    for (const auto& c : t.chunks) {
      acc::dist::PlacementEntry e;
      e.global_shape = t.shape;
      e.box = c.box;
      e.flat = c.flat;
      for (const auto& [run, at] : e.global_runs()) {
        for (int64_t i = run.offset; i < run.end(); ++i) ++times[static_cast<size_t>(i)];
      }
    }
    for (size_t i = 0; i < times.size(); ++i) {
      if (times[i] != 1) {
        std::fprintf(stderr, "checkpoint_fuzz: element %zu of '%s' is in %d chunks\n", i,
                     t.name.c_str(), times[i]);
        std::abort();
      }
    }
  }
  std::vector<char> out;
  for (const auto& t : m.tensors) {
    for (acc::ckpt::ChunkInfo c : t.chunks) {
      if (c.byte_offset > static_cast<int64_t>(shard.size()) ||
          c.byte_length > static_cast<int64_t>(shard.size()) - c.byte_offset) {
        continue;  // past the file: the loader refuses it before reading (file size known)
      }
      const char* p = shard.data() + c.byte_offset;
      const auto n = static_cast<size_t>(c.byte_length);
      for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) c.xxh64 = XXH64(p, n, 0);
        try {
          acc::ckpt::decode_chunk(p, n, c, t.dtype, "fuzz", out);
        } catch (const acc::Error&) {
        }
      }
    }
  }
  return 0;
}
