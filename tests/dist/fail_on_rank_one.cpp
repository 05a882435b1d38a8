// A test that fails on rank 1 only: run by every_rank_fails.sh to show that the MPI test main
// turns a failure on any rank into a failing exit code on every rank.
#include <gtest/gtest.h>

#include "acc/dist/dist.hpp"

TEST(FailOnRankOne, FailsOnlyThere) {
  EXPECT_NE(acc::dist::rank(), 1) << "deliberate failure";
}
