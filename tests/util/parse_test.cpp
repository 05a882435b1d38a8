// Strict parsing of numbers and sizes from users (acc/util/parse.hpp).
#include "acc/util/parse.hpp"

#include <gtest/gtest.h>

#include <utility>

#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

template <class F>
std::string error_of(F&& f) {
  return test::error_of<ValueError>(std::forward<F>(f));
}

TEST(Parse, IntegersWholeAndInRange) {
  EXPECT_EQ(parse_int64("42", "x"), 42);
  EXPECT_EQ(parse_int64("-9223372036854775808", "x"), INT64_MIN);
  EXPECT_EQ(error_of([] { parse_int64("3abc", "--steps"); }),
            "--steps must be an integer, got '3abc'");
  EXPECT_EQ(error_of([] { parse_int64("99999999999999999999", "--steps"); }),
            "--steps '99999999999999999999' does not fit in a signed 64-bit integer");
  for (const char* bad : {"", " 1", "1.5", "0x10", "1e3"}) {
    EXPECT_NE(error_of([&] { parse_int64(bad, "x"); }), "(no error)") << bad;
  }
}

TEST(Parse, DoublesFinite) {
  EXPECT_DOUBLE_EQ(parse_double("3e-4", "--lr"), 3e-4);
  for (const char* bad : {"inf", "-inf", "nan", "1e999", "1.0x", ""}) {
    EXPECT_NE(error_of([&] { parse_double(bad, "--lr"); }), "(no error)") << bad;
  }
}

TEST(Parse, SizesWithUnits) {
  EXPECT_EQ(parse_bytes("4096", "x"), 4096);
  EXPECT_EQ(parse_bytes("512MiB", "x"), 512ll << 20);
  EXPECT_EQ(parse_bytes("2GiB", "x"), 2ll << 30);
  EXPECT_EQ(parse_bytes("1.5GB", "x"), 1500000000);
  EXPECT_EQ(parse_bytes("3KB", "x"), 3000);
  EXPECT_EQ(parse_bytes("7B", "x"), 7);
  EXPECT_EQ(error_of([] { parse_bytes("-1GiB", "--mem-per-rank"); }),
            "--mem-per-rank must be a size such as 4096, 512MiB or 2GiB, got '-1GiB'");
  for (const char* bad : {"", "GiB", "2 GiB", "2gib", "2GiBs", "1..5MB", "inf"}) {
    EXPECT_NE(error_of([&] { parse_bytes(bad, "x"); }), "(no error)") << bad;
  }
  EXPECT_NE(error_of([] { parse_bytes("9000000TiB", "x"); }).find("does not fit"),
            std::string::npos);
}

}  // namespace
}  // namespace acc
