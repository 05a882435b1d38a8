// Collective calibration under mpirun at 1, 2 and 4 ranks: every rank gets the same fits, the fits
// are non-negative and grow with the size. No timing assertion beyond that (the machine is shared).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

#include "acc/dist/agreement.hpp"
#include "acc/dist/dist.hpp"
#include "acc/dist/node.hpp"
#include "acc/search/calibration.hpp"
#include "acc/util/error.hpp"
#include "acc/util/system.hpp"
#include "error_of.hpp"

namespace acc::search {
namespace {

const std::vector<int64_t> kSizes = {4 << 10, 256 << 10, 4 << 20};
constexpr double kFast = 0.005;
const char* const kOps[] = {"allreduce", "reduce_scatter", "allgather", "broadcast"};

TEST(CalibrateCollectives, EveryRankGetsTheSameNonNegativeFitsThatGrowWithSize) {
  auto world = dist::ProcessGroup::world();
  const CommCalibration c = calibrate_collectives(*world, kSizes, kFast);
  EXPECT_EQ(c.world, world->size());
  // Equal on every rank (throws naming the first difference otherwise).
  EXPECT_NO_THROW(dist::check_agreement(*world, c.to_json(), "ranks disagree on the fits"));
  ASSERT_EQ(c.ops.size(), 4u);
  for (const char* op : kOps) {
    SCOPED_TRACE(op);
    const AlphaBeta& ab = c.ops.at(op);
    EXPECT_TRUE(std::isfinite(ab.alpha_s) && std::isfinite(ab.beta_s_per_byte));
    EXPECT_GE(ab.alpha_s, 0);
    EXPECT_GE(ab.beta_s_per_byte, 0);
    if (c.world == 1) {
      EXPECT_EQ(c.seconds(op, 1 << 20), 0.0);
      EXPECT_TRUE(c.points.empty());
      continue;
    }
    EXPECT_GT(ab.beta_s_per_byte, 0);
    EXPECT_LT(c.seconds(op, 4 << 10), c.seconds(op, 4 << 20));
    EXPECT_LT(c.seconds(op, 4 << 20), c.seconds(op, 64 << 20));
    ASSERT_EQ(c.points.at(op).size(), kSizes.size());
    for (size_t i = 0; i < kSizes.size(); ++i) {
      const CommPoint& p = c.points.at(op)[i];
      EXPECT_GE(p.bytes, kSizes[i]);
      EXPECT_EQ(p.bytes % (4 * c.world), 0);
      EXPECT_GT(p.seconds, 0);
      EXPECT_TRUE(std::isfinite(p.seconds));
    }
  }
  // Through JSON and back, as a report or a cache would keep it.
  const CommCalibration back =
      CommCalibration::from_json(nlohmann::json::parse(c.to_json().dump()));
  EXPECT_EQ(back.to_json(), c.to_json());
}

TEST(CalibrateCollectives, RefusesBadArgumentsOnEveryRankBeforeAnyCollective) {
  auto world = dist::ProcessGroup::world();
  const uint64_t seq = world->sequence_number();
  EXPECT_THROW(calibrate_collectives(*world, {}, kFast), ValueError);
  EXPECT_THROW(calibrate_collectives(*world, {4096, 0}, kFast), ValueError);
  EXPECT_THROW(calibrate_collectives(*world, kSizes, 0.0), ValueError);
  EXPECT_THROW(calibrate_collectives(*world, kSizes, NAN), ValueError);
  EXPECT_EQ(world->sequence_number(), seq);
}

TEST(FitAlphaBeta, RecoversALineAndClampsToNonNegative) {
  // Exactly on a line: recovered whatever the weights.
  std::vector<CommPoint> line;
  for (int64_t b : {4096, 65536, 1 << 20, 16 << 20}) line.push_back({b, 2e-5 + 1e-10 * b});
  AlphaBeta ab = fit_alpha_beta(line);
  EXPECT_NEAR(ab.alpha_s, 2e-5, 1e-12);
  EXPECT_NEAR(ab.beta_s_per_byte, 1e-10, 1e-17);
  // Times that fall with the size: no bandwidth term, alpha the 1/t-weighted mean (n / sum 1/t).
  ab = fit_alpha_beta({{1000, 4e-3}, {2000, 2e-3}, {4000, 1e-3}});
  EXPECT_EQ(ab.beta_s_per_byte, 0);
  EXPECT_NEAR(ab.alpha_s, 3 / (250.0 + 500 + 1000), 1e-15);
  // A line through a negative intercept: alpha 0, beta through the origin.
  ab = fit_alpha_beta({{1000, 1e-6}, {2000, 3e-6}, {3000, 5e-6}});
  EXPECT_EQ(ab.alpha_s, 0);
  EXPECT_GT(ab.beta_s_per_byte, 0);
  // One size: all bandwidth.
  ab = fit_alpha_beta({{1 << 20, 1e-3}});
  EXPECT_EQ(ab.alpha_s, 0);
  EXPECT_DOUBLE_EQ(ab.beta_s_per_byte, 1e-3 / (1 << 20));
  ab = fit_alpha_beta({});
  EXPECT_EQ(ab.alpha_s, 0);
  EXPECT_EQ(ab.beta_s_per_byte, 0);
}

TEST(CommCalibration, SecondsAndJsonRefuseWhatTheyCannotRead) {
  CommCalibration c;
  c.world = 2;
  for (const char* op : kOps) c.ops[op] = {1e-5, 1e-10};
  EXPECT_DOUBLE_EQ(c.seconds("allreduce", 1000), 1e-5 + 1e-7);
  try {
    c.seconds("alltoall", 10);
    ADD_FAILURE() << "unknown op accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown collective 'alltoall'"), std::string::npos);
  }
  EXPECT_THROW(c.seconds("allreduce", -1), ValueError);

  EXPECT_FALSE(c.to_json().contains("wait_s"));  // 0: not written
  c.wait_s = 2e-4;
  EXPECT_DOUBLE_EQ(CommCalibration::from_json(c.to_json()).wait_s, 2e-4);
  // No bulk size measured: every size waits wait_s; the bulk figure is then not written.
  EXPECT_FALSE(c.to_json().contains("wait_bulk"));
  EXPECT_DOUBLE_EQ(c.wait_seconds(16 << 20), 2e-4);
  // Measured at 260 KiB: 4 KiB and below wait wait_s, 260 KiB and above the bulk figure, linear
  // in the bytes between (132 KiB: half way).
  c.wait_bulk_s = 6e-4;
  c.wait_bulk_bytes = 260 << 10;
  EXPECT_DOUBLE_EQ(c.wait_seconds(100), 2e-4);
  EXPECT_DOUBLE_EQ(c.wait_seconds(4 << 10), 2e-4);
  EXPECT_DOUBLE_EQ(c.wait_seconds(132 << 10), 4e-4);
  EXPECT_DOUBLE_EQ(c.wait_seconds(260 << 10), 6e-4);
  EXPECT_DOUBLE_EQ(c.wait_seconds(64 << 20), 6e-4);
  // A longer compute between collectives measured too (0.2 ms: 5e-4 where 0.01 ms waited
  // wait_s): the small collective's wait grows with the gap, linear between the two, and any
  // collective waits the larger of its gap's and its size's figure.
  EXPECT_FALSE(c.to_json().contains("wait_long"));
  c.wait_gap_s = 1e-5;
  c.wait_long_gap_s = 2.1e-4;
  c.wait_long_s = 5e-4;
  EXPECT_DOUBLE_EQ(c.wait_seconds(4 << 10, 0), 2e-4);
  EXPECT_DOUBLE_EQ(c.wait_seconds(4 << 10, 1e-5), 2e-4);
  EXPECT_DOUBLE_EQ(c.wait_seconds(4 << 10, 1.1e-4), 3.5e-4);
  EXPECT_DOUBLE_EQ(c.wait_seconds(4 << 10, 1.0), 5e-4);
  EXPECT_DOUBLE_EQ(c.wait_seconds(260 << 10, 1.0), 6e-4);  // the size's, larger
  EXPECT_DOUBLE_EQ(c.wait_seconds(132 << 10, 1.0), 5e-4);  // the gap's, larger than 4e-4
  const CommCalibration back = CommCalibration::from_json(c.to_json());
  EXPECT_EQ(back.wait_bulk_bytes, 260 << 10);
  EXPECT_DOUBLE_EQ(back.wait_bulk_s, 6e-4);
  EXPECT_DOUBLE_EQ(back.wait_gap_s, 1e-5);
  EXPECT_DOUBLE_EQ(back.wait_long_gap_s, 2.1e-4);
  EXPECT_DOUBLE_EQ(back.wait_long_s, 5e-4);
  const nlohmann::json good = c.to_json();
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string words;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) { j.erase("ops"); }, "field 'ops' is missing"},
      {[](nlohmann::json& j) { j["ops"].erase("broadcast"); }, "field 'ops.broadcast' is missing"},
      {[](nlohmann::json& j) { j["ops"]["allgather"]["beta_s_per_byte"] = -1; },
       "field 'ops.allgather.beta_s_per_byte' must be a finite number >= 0"},
      {[](nlohmann::json& j) { j["world"] = 0; }, "field 'world' must be an integer in [1,"},
      {[](nlohmann::json& j) { j["wait_s"] = -1e-4; },
       "field 'wait_s' must be a finite number >= 0"},
      {[](nlohmann::json& j) {
         j["wait_bulk"] = {4096, 1e-4};
       },
       "field 'wait_bulk' must be [bytes > 4096, seconds >= 0], got [4096,0.0001]"},
      {[](nlohmann::json& j) {
         j["wait_bulk"] = {1 << 20, -1e-4};
       },
       "field 'wait_bulk' must be [bytes > 4096, seconds >= 0]"},
      {[](nlohmann::json& j) { j["wait_bulk"] = 1e-4; },
       "field 'wait_bulk' must be [bytes > 4096, seconds >= 0], got 0.0001"},
      {[](nlohmann::json& j) {
         j["wait_long"] = {1e-5, 1e-4};
       },
       "field 'wait_long' must be [gap_s > wait_gap_s, seconds >= 0], got [1e-05,0.0001]"},
      {[](nlohmann::json& j) {
         j["wait_long"] = {1e-3, -1};
       },
       "field 'wait_long' must be [gap_s > wait_gap_s, seconds >= 0]"},
      {[](nlohmann::json& j) { j["wait_gap_s"] = -1; },
       "field 'wait_gap_s' must be a finite number >= 0"},
      {[](nlohmann::json& j) { j["points"]["alltoall"] = nlohmann::json::array(); },
       "field 'points.alltoall' is not a collective"},
      {[](nlohmann::json& j) {
         j["points"]["allreduce"] = {{4096, "slow"}};
       },
       "field 'points.allreduce[0]' must be [bytes >= 1, seconds >= 0]"},
  };
  for (const Case& k : cases) {
    nlohmann::json j = good;
    k.edit(j);
    try {
      CommCalibration::from_json(j);
      ADD_FAILURE() << "accepted: " << j.dump();
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("comm calibration: " + k.words), std::string::npos)
          << e.what();
    }
  }
}

TEST(BroadcastCalibration, EveryRankGetsRootsCalibration) {
  auto world = dist::ProcessGroup::world();
  MachineCalibration mine;
  if (world->rank() == 0) {
    mine.hardware = hardware_fingerprint();
    mine.gemm_threading = "openblas";
    mine.memory_gbps = 7.25;
    mine.gemm_gflops[{2048, 2304, 768, false, true}] = 33.5;
    mine.source.gemm_measured = 1;
    mine.source.note = "measured on rank 0";
  }
  const MachineCalibration got = broadcast_calibration(*world, mine, 0);
  EXPECT_EQ(got.memory_gbps, 7.25);
  EXPECT_EQ(got.gemm_gflops.size(), 1u);
  EXPECT_EQ(got.hardware, hardware_fingerprint());
  EXPECT_EQ(got.source.note, "measured on rank 0");
  EXPECT_EQ(got.source.gemm_measured, 1);
  EXPECT_THROW(broadcast_calibration(*world, mine, world->size()), ValueError);
}

// The contention factor is measured once per local world and taken from the machine's cache file
// after that, on every rank alike.
TEST(ContentionForJob, MeasuredOnceThenTakenFromTheCacheOnEveryRank) {
  auto world = dist::ProcessGroup::world();
  // One directory for the job, named by rank 0.
  std::string dir = world->rank() == 0
                        ? testing::TempDir() + "contention-" + std::to_string(std::time(nullptr)) +
                              "-" + std::to_string(::getpid())
                        : std::string();
  dir = dist::broadcast_text(*world, dir, 0);
  CalibrationOptions co;
  co.cache_dir = dir;
  const std::vector<GemmShape> shapes = {{64, 64, 64, false, false}};
  MachineCalibration m;
  if (world->rank() == 0) m = load_or_calibrate_machine(shapes, co);
  m = broadcast_calibration(*world, m);
  ASSERT_TRUE(m.contention.empty());
  bool cached = true;
  const double first = contention_for_job(*world, m, shapes, co, &cached);
  EXPECT_GE(first, 1.0);
  EXPECT_FALSE(cached);
  if (world->size() == 1) {
    EXPECT_EQ(first, 1.0);
    return;
  }
  ASSERT_EQ(m.contention.count(dist::local_world_size()), 1u);
  // A later search reads the file (rank 0) and gets the same factor without measuring.
  MachineCalibration later;
  if (world->rank() == 0) later = load_or_calibrate_machine(shapes, co);
  later = broadcast_calibration(*world, later);
  const double again = contention_for_job(*world, later, shapes, co, &cached);
  EXPECT_TRUE(cached);
  EXPECT_EQ(again, first);
  // Ranks that time-slice the cores compute at most their share, whatever was measured: a cached
  // factor under it (1, as a quiet moment may measure) is raised to it.
  // The node's ranks over the union of their cores (bound to one core each, not over one).
  const dist::NodeCores node = dist::node_cores(*world);
  const double sliced =
      static_cast<double>(node.ranks) * co.threads / static_cast<double>(node.cores);
  EXPECT_GE(first, sliced);
  later.contention[dist::local_world_size()] = 1.0;
  JobCores cores{-1, -1.0};
  EXPECT_EQ(contention_for_job(*world, later, shapes, co, &cached, &cores), std::max(1.0, sliced));
  // The cores it agreed on, as job_cores gives them.
  const JobCores agreed = job_cores(*world, co.threads);
  EXPECT_EQ(cores.local_ranks, agreed.local_ranks);
  EXPECT_EQ(cores.local_ranks, dist::local_world_size());
  EXPECT_DOUBLE_EQ(cores.share, agreed.share);
}

}  // namespace
// A node's ranks time-slice the union of their cores: bound to a core each (mpirun --bind-to
// core, the search_mpi_test_bound_np4 entry: 4 ranks over 2 cores), each sees one core, and the
// share is the node's ranks over the node's cores, not over that one. ACC_TEST_EXPECT_BOUND=1 (that
// entry) also requires the binding to have taken, so that it cannot pass unbound.
TEST(JobCores, CountsANodesRanksOverTheUnionOfTheirCores) {
  auto world = dist::ProcessGroup::world();
  const int threads = 1;
  const JobCores cores = job_cores(*world, threads);
  const dist::NodeCores node = dist::node_cores(*world);
  // mpirun on this machine: every rank is on one node.
  EXPECT_EQ(node.ranks, world->size());
  EXPECT_EQ(cores.local_ranks, node.ranks);
  EXPECT_GE(node.cores, usable_cores());
  EXPECT_LE(node.cores, machine_cores());
  const double share = static_cast<double>(node.ranks) * threads / node.cores;
  EXPECT_NEAR(cores.share, share, 1e-6);
  const char* bound = std::getenv("ACC_TEST_EXPECT_BOUND");
  if (bound != nullptr && std::string(bound) == "1") {
    if (machine_cores() < 2 || world->size() < 2) GTEST_SKIP() << "needs 2 cores and 2 ranks";
    ASSERT_LT(usable_cores(), node.cores) << "the ranks are not bound to a core each";
    // What this rank's own view made of it (4 ranks x 1 thread over 1 core: 4, not 2).
    EXPECT_LT(cores.share, static_cast<double>(node.ranks) * threads / usable_cores());
  }
}

// The wait a small collective adds between GEMMs: the same figure on every rank, finite and not
// negative, for groups of 2 and of the whole world; bad arguments refused on every rank before any
// collective. (Its size is the machine's: 0.2-0.6 ms with 4 ranks on 2 cores; near 0 with a core
// a rank, where the search does not measure it.)
TEST(CollectiveWait, EveryRankGetsTheSameNonNegativeFigure) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size();
  EXPECT_THROW(measure_collective_wait(*world, W + 1, {64, 64, 64, false, false}, 4, {}),
               ValueError);
  EXPECT_THROW(measure_collective_wait(*world, 1, {64, 64, 64, false, false}, 0, {}), ValueError);
  EXPECT_EQ(measure_collective_wait(*world, 1, {64, 64, 64, false, false}, 4, {}), 0.0);
  EXPECT_THROW(measure_collective_wait(*world, 1, {64, 64, 64, false, false}, 4, {}, 2),
               ValueError);  // under one f32
  for (const int g : {2, W}) {
    if (g < 2 || W % g != 0) continue;
    const CommCalibration fit = calibrate_collectives(*world, {4 << 10, 256 << 10}, 0.003);
    // The small collective (4 KiB) and the bulk one the search also measures (256 KiB).
    for (const int64_t bytes : {int64_t{4} << 10, int64_t{256} << 10}) {
      const double w =
          measure_collective_wait(*world, g, {128, 128, 128, false, true}, 8, fit, bytes);
      EXPECT_TRUE(std::isfinite(w) && w >= 0) << w;
      char mine[32];
      std::snprintf(mine, sizeof mine, "%.17g", w);
      EXPECT_EQ(dist::broadcast_text(*world, mine), std::string(mine))
          << "group " << g << ", " << bytes << " bytes";
    }
  }
  // Groups of ranks `stride` apart (a mesh's outer dimension): the same on every rank; a stride
  // whose groups do not tile the ranks refused, naming it.
  if (W >= 4 && W % 4 == 0) {
    const CommCalibration fit = calibrate_collectives(*world, {4 << 10, 256 << 10}, 0.003);
    const double w = measure_collective_wait(*world, 2, {128, 128, 128, false, true}, 8, fit,
                                             4 << 10, /*stride=*/W / 2);
    EXPECT_TRUE(std::isfinite(w) && w >= 0) << w;
    char mine[32];
    std::snprintf(mine, sizeof mine, "%.17g", w);
    EXPECT_EQ(dist::broadcast_text(*world, mine), std::string(mine));
  }
  if (W >= 2) {
    const std::string e = test::error_of<ValueError>([&] {
      (void)measure_collective_wait(*world, 2, {64, 64, 64, false, false}, 4, {}, 4 << 10, W);
    });
    EXPECT_NE(e.find("groups of 2 ranks " + std::to_string(W) + " apart"), std::string::npos) << e;
  }
}

// The fits of contiguous groups: rank 0's group's on every rank, of the group's size; a size that
// does not divide the world refused on every rank before any collective.
TEST(CalibrateContiguousGroups, EveryRankKeepsTheFirstGroupsFits) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size();
  EXPECT_THROW(calibrate_contiguous_groups(*world, W + 1), ValueError);
  EXPECT_THROW(calibrate_contiguous_groups(*world, 0), ValueError);
  for (const int size : {1, 2}) {
    if (W % size != 0) continue;
    const CommCalibration c = calibrate_contiguous_groups(*world, size);
    EXPECT_EQ(c.world, size);
    EXPECT_NO_THROW(dist::check_agreement(*world, c.to_json(), "ranks disagree on the fits"));
  }
}

// The collective wait's GEMM: the median shape by FLOPs, calls for about 20 ms a pass, 16 to 256.
TEST(CollectiveWaitProbe, TakesTheMedianShapeAndAboutTwentyMillisecondsOfCalls) {
  MachineCalibration m;
  const GemmShape small{16, 16, 16, false, false}, mid{64, 64, 64, false, false},
      large{512, 512, 512, false, false};
  m.gemm_gflops[small] = 1;
  m.gemm_gflops[mid] = 1;  // 2 x 64^3 FLOP at 1 GFLOP/s: 0.52 ms a call
  m.gemm_gflops[large] = 1;
  const WaitProbe p = collective_wait_probe({large, small, mid}, m);
  EXPECT_EQ(p.shape, mid);
  EXPECT_EQ(p.calls, static_cast<int64_t>(0.02 / m.gemm_seconds(mid)));
  m.gemm_gflops[mid] = 1e6;  // a call of nothing: at most 256
  EXPECT_EQ(collective_wait_probe({mid}, m).calls, 256);
  m.gemm_gflops[mid] = 1e-3;  // a call of 0.5 s: at least 16
  EXPECT_EQ(collective_wait_probe({mid}, m).calls, 16);
  EXPECT_THROW(collective_wait_probe({}, m), ValueError);
  // The bulk probe: 256 KiB all-reduces, as many as the small one's calls but at most 24.
  EXPECT_EQ(p.bulk_bytes, 256 << 10);
  EXPECT_EQ(p.bulk_calls, std::min<int64_t>(p.calls, 24));
  EXPECT_EQ(collective_wait_probe({mid}, m).bulk_calls, 16);
  // The long probe: the largest shape, about 20 ms of it a pass (8 to 256 calls).
  EXPECT_EQ(p.long_shape, large);
  EXPECT_EQ(p.long_calls, 8);  // 268 MFLOP at 1 GFLOP/s: 0.27 s a call
  EXPECT_EQ(collective_wait_probe({mid}, m).long_shape, mid);
}

}  // namespace acc::search
