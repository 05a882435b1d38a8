#pragma once
// Damage for the checkpoint tests: one bit of a file flipped in place.

#include <filesystem>
#include <fstream>

namespace acc::test {

inline void flip_bit(const std::filesystem::path& file, std::streamoff at, char mask) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ mask);
  f.seekp(at);
  f.write(&c, 1);
}

}  // namespace acc::test
