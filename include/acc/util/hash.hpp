#pragma once
// A 64-bit FNV-1a hash of bytes: the same on every rank, build and run (std::hash promises none of
// that), for keys that cross processes: the ranks' agreement check, the hardware fingerprint.
// Not for adversarial input or checksums of data (issue 18's checkpoints use xxhash).

#include <cstdint>
#include <string_view>

namespace acc {

inline uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace acc
