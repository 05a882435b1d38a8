// Pipeline schedules as data (issue 33): the builders against golden tables kept in
// tests/strategies/data, every builder's schedules valid over a grid of sizes, and the validator
// refusing hand-broken schedules with a message naming the rank and the step.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>
#include <tuple>
#include <vector>

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

// The schedule run action by action (simulated_schedule_time, which the search prices pipelines
// with on time-sliced cores). Ranks with a core each and equal stages take the closed form of
// schedule_time: (v m + p - 1) actions' time for 1F1B and the interleaved schedule.
TEST(SimulatedSchedule, RanksWithACoreEachTakeTheClosedForm) {
  const auto one = [](int) { return 1.0; };
  for (const auto& [kind, p, v, m] : std::vector<std::tuple<ScheduleKind, int, int, int>>{
           {ScheduleKind::kOneFOneB, 4, 1, 8},
           {ScheduleKind::kOneFOneB, 2, 1, 1},
           {ScheduleKind::kOneFOneB, 3, 1, 5},
           {ScheduleKind::kInterleaved, 2, 2, 4},
           {ScheduleKind::kInterleaved, 4, 2, 8}}) {
    const PipelineSchedule s = make_schedule(kind, p, v, m);
    // f and b per action (one stage); a micro-batch through a rank's v stages takes v (f + b).
    const std::vector<ActionCosts> costs(static_cast<size_t>(p), ActionCosts{0.5, 1.0, 0, 0});
    const std::vector<double> per_rank(static_cast<size_t>(p), v * 1.5);
    EXPECT_NEAR(simulated_schedule_time(s, costs, one), schedule_time(per_rank, m, v), 1e-9)
        << schedule_kind_name(kind) << " p " << p << " v " << v << " m " << m;
  }
}

// One core shared by every rank (a rank computing alone takes 1x, n at once n x): the core is
// never idle while a rank computes, and without messages some rank always can, so the step is
// all the ranks' compute, whatever the schedule's fill and drain.
TEST(SimulatedSchedule, OneSharedCoreTakesAllTheRanksCompute) {
  const PipelineSchedule s = make_schedule(ScheduleKind::kOneFOneB, 4, 1, 6);
  const std::vector<ActionCosts> costs{{1, 2, 0, 0}, {0.5, 1, 0, 0}, {1, 3, 0, 0}, {2, 2, 0, 0}};
  double work = 0;
  for (const auto& c : costs) work += 6 * (c.forward_s + c.backward_s);
  EXPECT_NEAR(simulated_schedule_time(s, costs, [](int n) { return static_cast<double>(n); }), work,
              1e-9);
  // Two cores: at least half the work, and more (the fill and drain leave a core idle).
  const double two = simulated_schedule_time(
      s, costs, [](int n) { return std::max(1.0, static_cast<double>(n) / 2); });
  EXPECT_GT(two, work / 2 + 1e-6);
  EXPECT_LT(two, work);
}

// Each action communicates before it computes; the next stage's action waits for it.
TEST(SimulatedSchedule, MessagesComeBeforeEachActionsCompute) {
  const PipelineSchedule s = make_schedule(ScheduleKind::kOneFOneB, 2, 1, 1);
  const std::vector<ActionCosts> costs(2, ActionCosts{1.0, 2.0, 0.5, 0.25});
  // F0 on rank 0: 0.5 + 1; on rank 1: 0.5 + 1; B0 on rank 1: 0.25 + 2; on rank 0: 0.25 + 2.
  EXPECT_NEAR(simulated_schedule_time(s, costs, [](int) { return 1.0; }), 7.5, 1e-12);
}

TEST(SimulatedSchedule, RefusesCostsAndSlowdownsItCannotUseNamingThem) {
  const PipelineSchedule s = make_schedule(ScheduleKind::kOneFOneB, 2, 1, 2);
  const auto one = [](int) { return 1.0; };
  auto message = [&](const std::vector<ActionCosts>& costs, const std::function<double(int)>& f) {
    try {
      simulated_schedule_time(s, costs, f);
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message({ActionCosts{}}, one).find("the schedule has 2 ranks, got the costs of 1"),
            std::string::npos);
  EXPECT_NE(message({ActionCosts{}, ActionCosts{1, -1, 0, 0}}, one).find("got -1 for rank 1"),
            std::string::npos);
  EXPECT_NE(message({ActionCosts{1, 1, 0, std::nan("")}, ActionCosts{}}, one).find("for rank 0"),
            std::string::npos);
  EXPECT_NE(message({ActionCosts{1, 1, 0, 0}, ActionCosts{1, 1, 0, 0}}, [](int) { return 0.5; })
                .find("ranks computing at once must be finite and >= 1, got 0.5"),
            std::string::npos);
}

}  // namespace
}  // namespace acc::strategies
