// Strict parsing of numbers and sizes from users (acc/util/parse.hpp).
#include "acc/util/parse.hpp"

#include <gtest/gtest.h>

#include <cmath>
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

// Durations: every timeout and threshold in seconds from the environment, a file or a flag.
TEST(Parse, DurationsFiniteAndAtMostSevenDays) {
  EXPECT_DOUBLE_EQ(parse_duration_seconds("300", "x"), 300.0);
  EXPECT_DOUBLE_EQ(parse_duration_seconds("2.5", "x"), 2.5);
  EXPECT_DOUBLE_EQ(parse_duration_seconds("1e3", "x"), 1000.0);
  EXPECT_DOUBLE_EQ(parse_duration_seconds("604800", "x"), kMaxDurationSeconds);
  EXPECT_DOUBLE_EQ(parse_duration_seconds("0", "x", ZeroSeconds::kAllowed), 0.0);
  // "A huge timeout" is refused by name and value: these overflowed the clocks (1e10, 9.3e9:
  // the first collective failed at once; 1e300: "within -9223372036854775808 ms").
  for (const char* huge : {"1e10", "9.3e9", "1e300", "604800.5"}) {
    EXPECT_EQ(error_of([&] { parse_duration_seconds(huge, "ACC_COMM_TIMEOUT_SEC"); }),
              std::string("ACC_COMM_TIMEOUT_SEC must be at most 604800 seconds (7 days: every "
                          "timeout is finite), got '") +
                  huge + "'");
  }
  EXPECT_EQ(error_of([] { parse_duration_seconds("0", "ACC_HANG_TIMEOUT_SEC"); }),
            "ACC_HANG_TIMEOUT_SEC must be > 0, got '0'");
  EXPECT_EQ(error_of([] { parse_duration_seconds("-1", "x", ZeroSeconds::kAllowed); }),
            "x must be >= 0, got '-1'");
  EXPECT_EQ(error_of([] { parse_duration_seconds("inf", "x"); }),
            "x must be a finite number of seconds, got 'inf'");
  EXPECT_EQ(error_of([] { parse_duration_seconds("1e999", "x"); }),
            "x must be a finite number of seconds, got '1e999'");
  EXPECT_EQ(error_of([] { parse_duration_seconds("5s", "x"); }),
            "x must be a number of seconds, got '5s'");
  for (const char* bad : {"", " 1", "nan", "-inf", "1,5", "1 s"}) {
    EXPECT_NE(error_of([&] { parse_duration_seconds(bad, "x"); }), "(no error)") << bad;
  }
}

TEST(Parse, DurationsGivenInCodeAreCheckedTheSameWay) {
  EXPECT_DOUBLE_EQ(check_duration_seconds(4.5, "x"), 4.5);
  EXPECT_EQ(error_of([] { check_duration_seconds(1e300, "elastic: the hang timeout"); }),
            "elastic: the hang timeout must be at most 604800 seconds (7 days: every timeout is "
            "finite), got 1e+300");
  EXPECT_EQ(error_of([] { check_duration_seconds(0, "t"); }), "t must be > 0, got 0");
  EXPECT_EQ(error_of([] { check_duration_seconds(-0.5, "t", ZeroSeconds::kAllowed); }),
            "t must be >= 0, got -0.5");
  EXPECT_EQ(error_of([] { check_duration_seconds(std::nan(""), "t"); }),
            "t must be a finite number of seconds, got nan");
}

TEST(Parse, DurationsInMillisecondsNeverRoundAPositiveOneToZero) {
  EXPECT_EQ(duration_ms(300).count(), 300000);
  EXPECT_EQ(duration_ms(0.0001).count(), 1);
  EXPECT_EQ(duration_ms(0).count(), 0);
  EXPECT_EQ(duration_ms(kMaxDurationSeconds).count(), 604800000);
  EXPECT_THROW(duration_ms(1e10), InternalError);
}

}  // namespace
}  // namespace acc
