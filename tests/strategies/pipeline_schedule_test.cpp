// Pipeline schedules as data (issue 33): the builders against golden tables kept in
// tests/strategies/data, every builder's schedules valid over a grid of sizes, and the validator
// refusing hand-broken schedules with a message naming the rank and the step.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "acc/strategies/pipeline_schedule.hpp"
#include "acc/util/error.hpp"

namespace acc::strategies {
namespace {

std::string read_golden(const std::string& name) {
  const std::string path = std::string(ACC_SCHEDULE_DATA_DIR) + "/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

struct Golden {
  ScheduleKind kind;
  int ranks, virtual_stages, micro_batches;
  const char* file;
};

class GoldenSchedule : public ::testing::TestWithParam<Golden> {};

TEST_P(GoldenSchedule, BuilderMatchesTheTableAndValidates) {
  const Golden g = GetParam();
  const PipelineSchedule s = make_schedule(g.kind, g.ranks, g.virtual_stages, g.micro_batches);
  EXPECT_EQ(s.to_string(), read_golden(g.file));
  EXPECT_NO_THROW(validate(s));
}

INSTANTIATE_TEST_SUITE_P(
    Tables, GoldenSchedule,
    ::testing::Values(Golden{ScheduleKind::kOneFOneB, 2, 1, 4, "schedule_1f1b_p2_m4.txt"},
                      Golden{ScheduleKind::kOneFOneB, 2, 1, 8, "schedule_1f1b_p2_m8.txt"},
                      Golden{ScheduleKind::kOneFOneB, 4, 1, 4, "schedule_1f1b_p4_m4.txt"},
                      Golden{ScheduleKind::kOneFOneB, 4, 1, 8, "schedule_1f1b_p4_m8.txt"},
                      Golden{ScheduleKind::kInterleaved, 2, 2, 4,
                             "schedule_interleaved_p2_v2_m4.txt"},
                      Golden{ScheduleKind::kGPipe, 2, 1, 4, "schedule_gpipe_p2_m4.txt"}));

TEST(PipelineSchedule, EveryBuilderIsValidOverAGridOfSizes) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      EXPECT_NO_THROW(validate(make_schedule(ScheduleKind::kGPipe, p, 1, m))) << p << " " << m;
      EXPECT_NO_THROW(validate(make_schedule(ScheduleKind::kOneFOneB, p, 1, m))) << p << " " << m;
      if (m % p != 0) continue;
      for (int v = 2; v <= 4; ++v) {
        EXPECT_NO_THROW(validate(make_schedule(ScheduleKind::kInterleaved, p, v, m)))
            << p << " " << v << " " << m;
      }
    }
  }
}

// The promises the file comment makes: 1F1B holds min(p - r, m) micro-batches on rank r, the
// interleaved one each rank's warm-up plus one, gpipe all of them.
TEST(PipelineSchedule, InFlightBoundsAreThePublishedOnes) {
  const PipelineSchedule one = make_schedule(ScheduleKind::kOneFOneB, 4, 1, 8);
  EXPECT_EQ(one.max_in_flight, (std::vector<int>{4, 3, 2, 1}));
  const PipelineSchedule inter = make_schedule(ScheduleKind::kInterleaved, 2, 2, 4);
  EXPECT_EQ(inter.max_in_flight, (std::vector<int>{5, 3}));
  EXPECT_EQ(make_schedule(ScheduleKind::kGPipe, 2, 1, 8).max_in_flight, (std::vector<int>{8, 8}));
}

void expect_refused(const PipelineSchedule& s, const std::string& what) {
  try {
    validate(s);
    ADD_FAILURE() << "accepted a schedule that should fail with: " << what << "\n" << s.to_string();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(PipelineSchedule, RefusesABackwardBeforeItsForward) {
  PipelineSchedule s = make_schedule(ScheduleKind::kOneFOneB, 2, 1, 4);
  std::swap(s.actions[1][0], s.actions[1][1]);  // rank 1: B0 F0 ...
  expect_refused(s, "rank 1 step 0 (B0@1) comes before its forward");
}

TEST(PipelineSchedule, RefusesUnmatchedMessages) {
  PipelineSchedule s = make_schedule(ScheduleKind::kOneFOneB, 2, 1, 4);
  std::swap(s.actions[0][0], s.actions[0][1]);  // rank 0 sends micro-batch 1 first
  expect_refused(s,
                 "unmatched message: rank 1 step 0 (F0@1) receives the activation of micro-batch "
                 "0 from stage 0 as message 0 from rank 0, but rank 0's message 0 to rank 1 is "
                 "the activation of micro-batch 1 from stage 0 (rank 0 step 0 (F1@0))");
}

TEST(PipelineSchedule, RefusesAMissingOrRepeatedAction) {
  PipelineSchedule missing = make_schedule(ScheduleKind::kGPipe, 2, 1, 2);
  missing.actions[0].pop_back();
  expect_refused(missing, "rank 0 never runs B1@0");
  PipelineSchedule twice = make_schedule(ScheduleKind::kGPipe, 2, 1, 2);
  twice.actions[1][1] = twice.actions[1][0];
  expect_refused(twice, "rank 1 step 1 (F0@1) is listed twice");
}

TEST(PipelineSchedule, RefusesAStageOfAnotherRankAndOutOfRangeActions) {
  PipelineSchedule s = make_schedule(ScheduleKind::kOneFOneB, 2, 1, 2);
  s.actions[0][0].stage = 1;
  expect_refused(s, "rank 0 step 0 (F0@1) runs stage 1, which rank 1 holds");
  PipelineSchedule far = make_schedule(ScheduleKind::kOneFOneB, 2, 1, 2);
  far.actions[1][0].micro_batch = 7;
  expect_refused(far, "rank 1 step 0 (F7@1) is outside 2 micro-batches and 2 stages");
}

TEST(PipelineSchedule, RefusesMoreInFlightThanPromised) {
  PipelineSchedule s = make_schedule(ScheduleKind::kGPipe, 2, 1, 4);
  s.max_in_flight = make_schedule(ScheduleKind::kOneFOneB, 2, 1, 4).max_in_flight;
  expect_refused(s,
                 "rank 0 step 2 (F2@0) holds 3 micro-batches in flight, the schedule promises "
                 "at most 2");
}

// Both ranks list their messages in the same order, but rank 1 wants micro-batch 1's activation
// before it gives back micro-batch 0's gradient, which rank 0 waits for before sending it.
TEST(PipelineSchedule, RefusesADeadlockNamingEveryStuckRank) {
  PipelineSchedule s = make_schedule(ScheduleKind::kOneFOneB, 2, 1, 2);
  s.actions[0] = {{PipeStep::kForward, 0, 0},
                  {PipeStep::kBackward, 0, 0},
                  {PipeStep::kForward, 1, 0},
                  {PipeStep::kBackward, 1, 0}};
  s.actions[1] = {{PipeStep::kForward, 0, 1},
                  {PipeStep::kForward, 1, 1},
                  {PipeStep::kBackward, 0, 1},
                  {PipeStep::kBackward, 1, 1}};
  s.max_in_flight = {2, 2};
  expect_refused(s,
                 "pipeline schedule deadlocks; rank 0 step 1 (B0@0) waits to receive the gradient "
                 "of micro-batch 0 from stage 1 from rank 1; rank 1 step 1 (F1@1) waits to "
                 "receive the activation of micro-batch 1 from stage 0 from rank 0");
}

TEST(PipelineSchedule, BuildersRefuseBadSizesNamingThem) {
  EXPECT_THROW(make_schedule(ScheduleKind::kOneFOneB, 0, 1, 4), ValueError);
  EXPECT_THROW(make_schedule(ScheduleKind::kGPipe, 2, 1, 0), ValueError);
  try {
    make_schedule(ScheduleKind::kInterleaved, 2, 2, 3);
    ADD_FAILURE() << "interleaved with 3 micro-batches over 2 ranks accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("micro_batches 3 must be a multiple of the pipeline's 2"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(make_schedule(ScheduleKind::kInterleaved, 2, 1, 4), ValueError);
  EXPECT_THROW(make_schedule(ScheduleKind::kOneFOneB, 2, 2, 4), ValueError);
  try {
    parse_schedule_kind("zb");
    ADD_FAILURE() << "schedule 'zb' accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'zb' is unknown"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace acc::strategies
