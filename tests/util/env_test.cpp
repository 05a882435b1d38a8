// Typed reads of environment variables (acc/util/env.hpp): a set-but-bad value is an error that
// names the variable and its value.
#include "acc/util/env.hpp"

#include <gtest/gtest.h>

#include <cstdlib>

#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

TEST(Env, SecondsAreCheckedDurations) {
  ::unsetenv("ACC_TEST_SEC");
  EXPECT_FALSE(env::get_seconds("ACC_TEST_SEC").has_value());
  ::setenv("ACC_TEST_SEC", "", 1);
  EXPECT_FALSE(env::get_seconds("ACC_TEST_SEC").has_value());  // empty is unset
  ::setenv("ACC_TEST_SEC", "2.5", 1);
  EXPECT_DOUBLE_EQ(env::get_seconds("ACC_TEST_SEC").value(), 2.5);
  ::setenv("ACC_TEST_SEC", "0", 1);
  EXPECT_DOUBLE_EQ(env::get_seconds("ACC_TEST_SEC", ZeroSeconds::kAllowed).value(), 0.0);
  EXPECT_EQ(test::error_of<ValueError>([] { env::get_seconds("ACC_TEST_SEC"); }),
            "environment variable ACC_TEST_SEC must be > 0, got '0'");
  ::setenv("ACC_TEST_SEC", "1e10", 1);
  EXPECT_EQ(test::error_of<ValueError>([] { env::get_seconds("ACC_TEST_SEC"); }),
            "environment variable ACC_TEST_SEC must be at most 604800 seconds (7 days: every "
            "timeout is finite), got '1e10'");
  ::setenv("ACC_TEST_SEC", "soon", 1);
  EXPECT_EQ(test::error_of<ValueError>([] { env::get_seconds("ACC_TEST_SEC"); }),
            "environment variable ACC_TEST_SEC must be a number of seconds, got 'soon'");
  ::unsetenv("ACC_TEST_SEC");
}

}  // namespace
}  // namespace acc
