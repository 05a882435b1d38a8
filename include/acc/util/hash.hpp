#pragma once
// A 64-bit FNV-1a hash of bytes: the same on every rank, build and run (std::hash promises none of
// that), for keys that cross processes: the ranks' agreement check, the hardware fingerprint.
// Not for adversarial input or checksums of data (issue 18's checkpoints use xxhash).

#include <cstdint>
#include <cstdio>
#include <string>
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

/// fnv1a64(bytes) as 16 lower-case hex digits: the keys that name a model or a machine.
inline std::string fnv1a64_hex(std::string_view bytes) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(fnv1a64(bytes)));
  return hex;
}

}  // namespace acc
