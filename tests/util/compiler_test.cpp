// The compiler as this build drives it (the project's flags): code it has got wrong before.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// torch.chunk's piece lengths, as a loop of push_backs that GCC inlines.
std::vector<int64_t> chunk_lengths(int64_t size, int parts) {
  std::vector<int64_t> out;
  for (int i = 0; i < parts; ++i) {
    const int64_t chunk = (size + parts - 1) / parts;
    const int64_t begin = std::min(size, chunk * i);
    out.push_back(std::min(size, begin + chunk) - begin);
  }
  return out;
}

// GCC 12.2 with AVX-512 and its SLP vectoriser built the second vector as {1, 1, 1, 1} (a
// broadcast of its first element): CMakeLists.txt turns SLP off for that compiler.
TEST(Compiler, AVectorLiteralAfterAnInlinedLoopKeepsItsValues) {
  const std::vector<int64_t> got = chunk_lengths(2, 4);
  const std::vector<int64_t> want{1, 1, 0, 0};
  EXPECT_EQ(got, want);
  EXPECT_EQ(want[2], 0);
  EXPECT_EQ(want[3], 0);
}

}  // namespace
