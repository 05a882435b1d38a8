// libFuzzer target: a checkpoint's readers on hostile bytes. The input is metadata.json's text, a
// NUL, then a shard file's bytes. acc::ckpt::parse_metadata must refuse bad metadata with an
// acc::Error (accepted metadata must survive a to_json round trip); then every chunk whose byte
// range lies in the shard goes through acc::ckpt::decode_chunk, as a loader reads it, once with
// the chunk's own checksum and once with the checksum of the bytes it points at (so the zstd
// frame checks and the decompression are reached, not only the checksum).
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
