#pragma once
// The exit code a test binary returns when every test it ran was skipped, so that CTest reports
// it as Skipped (SKIP_RETURN_CODE in acc_add_test) instead of Passed: a netns_test that could not
// make a namespace, or an MPI test whose every case needs more ranks, must not read as a pass.
// A binary in which some tests ran and others skipped passes as usual; scripts/test counts the
// skipped GoogleTest cases from the log at the end.
#include <gtest/gtest.h>

namespace acc::test {

inline constexpr int kAllSkippedExitCode = 77;  // automake's convention, also CTest's in examples

/// RUN_ALL_TESTS()'s result, or kAllSkippedExitCode when it passed with nothing but skips.
inline int exit_code_of(int run_all_tests_result) {
  const testing::UnitTest& u = *testing::UnitTest::GetInstance();
  if (run_all_tests_result == 0 && u.successful_test_count() == 0 && u.skipped_test_count() > 0) {
    return kAllSkippedExitCode;
  }
  return run_all_tests_result;
}

}  // namespace acc::test
