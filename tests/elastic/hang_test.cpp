// The hang detector end to end: a train_gpt job under mpirun in which ACC_FAULT stalls one rank.
// Every rank reports, the analysis names the stalled rank, the group, the collective and its
// sequence number, within the timeout + 2 s of the stall, and the job ends with kHangExitCode; the
// same job started again (same job directory) does not stall again. A slowed rank is named in
// the straggler report and the job goes on. In a pipeline whose sending stage stalls, the
// receiving rank is named waiting in its recv, by the message's own sequence number and peer. In
// a dp x tp mesh, the stalled tp group is named by its dimension and place ("group 'tp' of dp=1").

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "acc/elastic/agent.hpp"
#include "command.hpp"
#include "files.hpp"

namespace fs = std::filesystem;

namespace {

constexpr double kTimeoutS = 3.0;
// mesh_stall's steps take milliseconds: a shorter timeout keeps its test to a few seconds.
constexpr double kMeshTimeoutS = 1.5;

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// The one entry of a directory (the run directory under JOB/hang, the fault marker under
// JOB/faults).
fs::path only_entry(const fs::path& dir) {
  std::vector<fs::path> entries;
  for (const auto& d : fs::directory_iterator(dir)) entries.push_back(d.path());
  EXPECT_EQ(entries.size(), 1u) << dir;
  return entries.empty() ? fs::path() : entries.front();
}

fs::path run_dir(const fs::path& job) {
  return only_entry(job / "hang");
}

std::string train_gpt_job(int ranks, const fs::path& job, const std::string& fault,
                          const std::string& env = "",
                          const std::string& strategy = R"({"name": "ddp"})") {
  const std::string data = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  return std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np " + std::to_string(ranks) +
         env + " -x ACC_JOB_DIR=" + job.string() +
         " -x ACC_HANG_TIMEOUT_SEC=" + std::to_string(kTimeoutS) + " -x ACC_FAULT=" + fault + " " +
         TRAIN_GPT_BIN + " --model gpt --data " + data +
         " --data-format u16 --seq-len 16 --batch-size 2 --steps 8 --threads 1 --strategy '[" +
         strategy + "]'";
}

TEST(HangDetector, NamesTheStalledRankAndItsCollective) {
  const fs::path job = acc::test::fresh_dir("hang_test_collective");
  const std::string cmd = train_gpt_job(4, job, "stall:rank=1:step=3:phase=collective");
  const auto r = acc::test::run_command(cmd);
  ASSERT_EQ(r.exit_code, acc::elastic::kHangExitCode) << r.output;
  EXPECT_NE(r.output.find("hang analysis: ranks 0,2,3 wait in allreduce"), std::string::npos)
      << r.output;
  const fs::path run = run_dir(job);
  const nlohmann::json a = read_json(run / "analysis.json");
  EXPECT_EQ(a["culprits"], nlohmann::json({1})) << a.dump(1);
  EXPECT_EQ(a["not_reporting"], nlohmann::json::array());
  ASSERT_EQ(a["groups"].size(), 1u) << a.dump(1);
  const nlohmann::json& g = a["groups"][0];
  EXPECT_EQ(g["group"], "world");
  EXPECT_EQ(g["op"].get<std::string>().rfind("allreduce", 0), 0u) << g.dump();
  EXPECT_EQ(g["waiting"], nlohmann::json({0, 2, 3}));
  ASSERT_EQ(g["lagging"].size(), 1u);
  EXPECT_EQ(g["lagging"][0]["rank"], 1);
  EXPECT_EQ(g["lagging"][0]["last_completed_seq"].get<uint64_t>() + 1, g["seq"].get<uint64_t>());
  EXPECT_EQ(g["lagging"][0]["step"], 3);
  // Found within the timeout + 2 s of the stall: every rank's report against the fault's time.
  const nlohmann::json fired = read_json(only_entry(job / "faults"));
  EXPECT_EQ(fired["fault"], "stall:rank=1:step=3:phase=collective") << fired.dump();
  for (int rank = 0; rank < 4; ++rank) {
    const nlohmann::json rep = read_json(run / ("rank-" + std::to_string(rank) + ".json"));
    const double after = rep["time"].get<double>() - fired["time"].get<double>();
    EXPECT_GE(after, kTimeoutS - 0.5) << "rank " << rank;
    EXPECT_LE(after, kTimeoutS + 2.0) << "rank " << rank;
  }
  // The job started again in the same job directory: the fault fired already, training ends.
  const auto again = acc::test::run_command(cmd);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("fired in an earlier run"), std::string::npos) << again.output;
  fs::remove_all(job);
}

TEST(HangDetector, NamesTheRankStalledInBackward) {
  const fs::path job = acc::test::fresh_dir("hang_test_backward");
  const auto r =
      acc::test::run_command(train_gpt_job(2, job, "stall:rank=0:step=2:phase=backward", "",
                                           R"({"name": "ddp", "config": {"bucket_mb": 0.05}})"));
  ASSERT_EQ(r.exit_code, acc::elastic::kHangExitCode) << r.output;
  const nlohmann::json a = read_json(run_dir(job) / "analysis.json");
  EXPECT_EQ(a["culprits"], nlohmann::json({0})) << a.dump(1);
  EXPECT_NE(a["summary"].get<std::string>().find("rank 1 waits in allreduce"), std::string::npos)
      << a.dump(1);
  EXPECT_NE(a["summary"].get<std::string>().find("rank 0 last completed seq"), std::string::npos)
      << a.dump(1);
  // It stopped in backward right before issuing its first gradient bucket's all-reduce (small
  // buckets: the first is full in the last block): the analysis says in which module's gradient.
  EXPECT_NE(a["summary"].get<std::string>().find("is in backward of transformer.h."),
            std::string::npos)
      << a.dump(1);
  EXPECT_NE(a["summary"].get<std::string>().find("at step 2, about to issue allreduce"),
            std::string::npos)
      << a.dump(1);
  fs::remove_all(job);
}

// Rank 0 of a two-stage pipeline stalls right before its send at step 3 (messages numbered apart
// from the collectives, per peer and direction: steps 0-2 sent seq 1-3): rank 1 waits in recv
// seq 4 from rank 0, and the analysis names that recv, its peer, and rank 0 as the culprit with
// its last send (seq 3), not a collective of the group.
TEST(HangDetector, NamesAStalledRecvByItsOwnSequenceNumberAndPeer) {
  const fs::path job = acc::test::fresh_dir("hang_test_p2p");
  const std::string cmd =
      std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np 2" +
      " -x ACC_JOB_DIR=" + job.string() + " -x ACC_HANG_TIMEOUT_SEC=" + std::to_string(kTimeoutS) +
      " -x ACC_FAULT=stall:rank=0:step=3:phase=collective " + PIPELINE_STALL_BIN;
  const auto r = acc::test::run_command(cmd);
  ASSERT_EQ(r.exit_code, acc::elastic::kHangExitCode) << r.output;
  const nlohmann::json a = read_json(run_dir(job) / "analysis.json");
  EXPECT_EQ(a["summary"],
            "rank 1 waits in recv seq 4 from rank 0 of group 'world'; rank 0 last issued send seq "
            "3 to rank 1 and is in forward at step 3, about to issue send seq 4 to rank 1 of group "
            "'world'")
      << a.dump(1);
  EXPECT_EQ(a["culprits"], nlohmann::json({0}));
  EXPECT_EQ(a["groups"], nlohmann::json::array()) << "no collective waits";
  ASSERT_EQ(a["p2p"].size(), 1u) << a.dump(1);
  const nlohmann::json& p = a["p2p"][0];
  EXPECT_EQ(p["group"], "world");
  EXPECT_EQ(p["op"], "recv");
  EXPECT_EQ(p["seq"], 4);
  EXPECT_EQ(p["rank"], 1);
  EXPECT_EQ(p["peer"], 0);
  EXPECT_EQ(p["peer_issued_seq"], 3);
  EXPECT_EQ(p["lagging"]["rank"], 0);
  EXPECT_EQ(p["lagging"]["step"], 3);
  EXPECT_NE(r.output.find("hang analysis: rank 1 waits in recv seq 4 from rank 0"),
            std::string::npos)
      << r.output;
  fs::remove_all(job);
}

// A GPT in two pipeline_parallel stages (1F1B, 2 micro-batches): rank 0 sends 2 activations a
// step (seq 1-6 in steps 0-2) and stalls before the first of step 3. Rank 1 waits in recv seq 7,
// and the analysis names both ranks by their pipeline stage and the group by its dimension.
TEST(HangDetector, NamesAStalledPipelineStage) {
  const fs::path job = acc::test::fresh_dir("hang_test_stage");
  const auto r = acc::test::run_command(
      std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np 2" +
      " -x ACC_JOB_DIR=" + job.string() + " -x ACC_HANG_TIMEOUT_SEC=" + std::to_string(kTimeoutS) +
      " -x ACC_FAULT=stall:rank=0:step=3:phase=collective " + PIPELINE_STAGE_STALL_BIN);
  ASSERT_EQ(r.exit_code, acc::elastic::kHangExitCode) << r.output;
  const nlohmann::json a = read_json(run_dir(job) / "analysis.json");
  const std::string part =
      "rank 1 (stage 1) waits in recv seq 7 from rank 0 (stage 0) of group 'pp'; rank 0 last "
      "issued send seq 6 to rank 1";
  EXPECT_NE(a["summary"].get<std::string>().find(part), std::string::npos) << a.dump(1);
  EXPECT_NE(r.output.find("hang analysis: " + part), std::string::npos) << r.output;
  EXPECT_EQ(a["culprits"], nlohmann::json({0}));
  ASSERT_EQ(a["p2p"].size(), 1u) << a.dump(1);
  EXPECT_EQ(a["p2p"][0]["group"], "pp");
  EXPECT_EQ(a["p2p"][0]["seq"], 7);
  fs::remove_all(job);
}

// A dp=2 x tp=2 mesh in which rank 3 stalls right before its tp all-reduce at step 2 (tp seq 3:
// steps 0 and 1 were seq 1 and 2): rank 2, its tp peer, waits in it, and the analysis names the
// group by its dimension and place, the collective, its sequence number and rank 3 as the rank
// behind; ranks 0 and 1 completed theirs (the tp group of dp=0) and wait in the world's all-reduce.
TEST(HangDetector, NamesAStalledMeshGroupByItsDimensionAndPlace) {
  const fs::path job = acc::test::fresh_dir("hang_test_mesh");
  const auto r = acc::test::run_command(
      std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np 4" + " -x ACC_JOB_DIR=" +
      job.string() + " -x ACC_HANG_TIMEOUT_SEC=" + std::to_string(kMeshTimeoutS) +
      " -x ACC_FAULT=stall:rank=3:step=2:phase=collective " + MESH_STALL_BIN);
  ASSERT_EQ(r.exit_code, acc::elastic::kHangExitCode) << r.output;
  const fs::path run = run_dir(job);
  const nlohmann::json a = read_json(run / "analysis.json");
  const std::string tp_part =
      "rank 2 waits in allreduce.sum seq 3 of group 'tp' of dp=1; rank 3 last completed seq 2 and "
      "is in forward at step 2, about to issue allreduce.sum seq 3 of group 'tp' of dp=1";
  EXPECT_NE(a["summary"].get<std::string>().find(tp_part), std::string::npos) << a.dump(1);
  EXPECT_NE(r.output.find("hang analysis: " + tp_part), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("'tp of dp="), std::string::npos) << r.output;
  // The JSON keeps the group's own name; the tp group of dp=0 has nothing in flight.
  const nlohmann::json* tp = nullptr;
  for (const nlohmann::json& g : a["groups"]) {
    EXPECT_NE(g["group"], "tp of dp=0") << a.dump(1);
    if (g["group"] == "tp of dp=1") tp = &g;
  }
  ASSERT_NE(tp, nullptr) << a.dump(1);
  EXPECT_EQ((*tp)["op"], "allreduce.sum");
  EXPECT_EQ((*tp)["seq"], 3);
  EXPECT_EQ((*tp)["waiting"], nlohmann::json({2}));
  ASSERT_EQ((*tp)["lagging"].size(), 1u) << tp->dump();
  EXPECT_EQ((*tp)["lagging"][0]["rank"], 3);
  EXPECT_EQ(read_json(run / "rank-3.json")["entering"],
            "allreduce.sum seq 3 of group 'tp' of dp=1");
  fs::remove_all(job);
}

// A rank slowed 4x is named in the straggler report (every 4 steps) and the job trains on.
TEST(HangDetector, ASlowedRankIsNamedAsAStraggler) {
  const fs::path job = acc::test::fresh_dir("hang_test_slow");
  const auto r = acc::test::run_command(
      train_gpt_job(2, job, "slow:rank=1:step=2:factor=4", " -x ACC_STRAGGLER_EVERY=4"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("straggler: rank 1 "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("straggler: rank 0 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done: loss"), std::string::npos) << r.output;
  fs::remove_all(job);
}

}  // namespace
