// acc-run across real hosts: two network-namespace nodes (scripts/netns/nodes) joined by a bridge,
// OpenMPI's TCP transport between them, mpirun starting its daemons through scripts/netns/rsh.
// Node 2 is lost for real at step 5 (ACC_FAULT kill-node kills its ranks, and its link is taken
// down as they die): acc-run finds it does not answer, relaunches the job on node 1 with 2 ranks
// (the global batch unchanged; the job's strategy cache, planned for 4 ranks, re-planned for 2),
// which resumes from the newest committed checkpoint and ends with bitwise the losses of a 2-rank
// run resumed from that checkpoint with the same cache; the first step comes within
// 10 s of the ranks' death, and nothing is left running. A partition (node 2's link cut, its ranks
// alive) ends the same way. Faults on healthy nodes (a rank killed, a node's ranks killed, a rank
// stalled, a rank slowed) restart the job on the same two nodes, or (slowed) only name the
// straggler. SIGTERM and SIGINT to acc-run end the job on both nodes. Skipped, saying why, where
// namespaces cannot be made (not root, no iproute2), except when the environment variable CI is
// set: CI runs as root and can make them, so there a skip would hide that the tests never ran, and
// it fails instead.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <thread>

#include "command.hpp"
#include "files.hpp"
#include "job_processes.hpp"

namespace fs = std::filesystem;

namespace {

const std::string kNodes = std::string(ACC_SOURCE_DIR) + "/scripts/netns/nodes";
const std::string kRsh = std::string(ACC_SOURCE_DIR) + "/scripts/netns/rsh";

using acc::test::read_jsonl;

const std::string kDdp = R"('[{"name": "ddp"}]')";
const std::string kConfig = std::string(ACC_GOLDEN_DIR) + "/train_ref/gpt.config.json";

std::string train_args(const fs::path& dir, const std::string& ck, const std::string& resume,
                       const std::string& strategy = kDdp) {
  const std::string data = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  return std::string(TRAIN_GPT_BIN) + " --model gpt --config " + kConfig + " --data " + data +
         " --data-format u16 --data-order sequential --seq-len 16 --global-batch 8 --steps 10"
         " --lr 3e-3 --seed 5 --threads 1 --strategy " +
         strategy + " --save-every 2 --keep 0 --resume " + resume + " --ckpt-dir " + ck +
         " --log-json " + (dir / "log.jsonl").string();
}

// The one incident whose `key` is `value` (a failing expectation, and null, when there is none).
nlohmann::json incident_with(const fs::path& dir, const std::string& key, const std::string& value,
                             const std::string& output) {
  nlohmann::json found;
  for (const auto& inc : read_jsonl(dir / "job" / "incidents.jsonl")) {
    if (inc.value(key, std::string()) == value) {
      EXPECT_TRUE(found.is_null()) << "two incidents with " << key << " " << value;
      found = inc;
    }
  }
  EXPECT_FALSE(found.is_null()) << "no incident with " << key << " " << value << "\n" << output;
  return found.is_null() ? nlohmann::json::object() : found;
}

struct Nodes {
  Nodes() { up = acc::test::run_command(kNodes + " up 2").exit_code == 0; }
  ~Nodes() { acc::test::run_command(kNodes + " down"); }
  bool up = false;
};

// Every test runs on two fresh nodes, torn down after it.
class AccRunNodes : public testing::Test {
 protected:
  void SetUp() override {
    const auto can = acc::test::run_command(kNodes + " check");
    if (can.exit_code != 0 && std::getenv("CI") != nullptr) {
      FAIL() << "network namespaces cannot be made here, and CI is set (CI runs as root and can "
                "make them: these tests must run there, not be skipped): "
             << can.output;
    }
    if (can.exit_code != 0) {
      GTEST_SKIP() << "network namespaces cannot be made here: " << can.output;
    }
    nodes_ = std::make_unique<Nodes>();
    ASSERT_TRUE(nodes_->up);
  }
  std::unique_ptr<Nodes> nodes_;
};

// The mpirun arguments for the two nodes.
std::string two_node_mpirun_args() {
  return "--oversubscribe --bind-to none --mca plm_rsh_agent " + kRsh +
         " --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include "
         "10.77.0.0/24";
}

// The lines of the last attempt in a step log that every attempt appends to; the earlier ones
// come first, from step 0, in the order of their attempts.
std::vector<nlohmann::json> last_attempt(const std::vector<nlohmann::json>& log) {
  std::vector<nlohmann::json> out;
  if (log.empty()) return out;
  EXPECT_EQ(log.front().at("step"), 0) << log.front().dump();
  for (size_t i = 1; i < log.size(); ++i) {
    EXPECT_GE(log[i].at("attempt"), log[i - 1].at("attempt")) << "line " << i;
  }
  const int64_t last = log.back().at("attempt").get<int64_t>();
  for (const auto& l : log) {
    if (l.at("attempt").get<int64_t>() == last) out.push_back(l);
  }
  return out;
}

// The logged losses `got` (by their "step") equal `want`, whose first entry is step `first`.
void expect_losses(const std::vector<nlohmann::json>& got, const std::vector<double>& want,
                   int64_t first) {
  for (const auto& l : got) {
    const int64_t i = l.at("step").get<int64_t>() - first;
    ASSERT_GE(i, 0);
    ASSERT_LT(i, static_cast<int64_t>(want.size()));
    EXPECT_EQ(l.at("loss").get<double>(), want[static_cast<size_t>(i)]) << "step " << i + first;
  }
}

// acc-run on the two nodes (2 ranks each) in `dir`, with `env` before it; node 2's link is taken
// down as soon as cut_now() says so (polled every 20 ms while the job runs). The restarts allow
// for mpirun dying with SIGSEGV at start on the namespaces (1 launch in ~6), an incident each.
acc::test::CommandResult run_on_two_nodes(const fs::path& dir, const std::string& env,
                                          double health_timeout_s,
                                          const std::function<bool()>& cut_now,
                                          int max_restarts = 6,
                                          const std::string& strategy = kDdp) {
  std::ofstream(dir / "hosts") << "10.77.0.11 slots=2\n10.77.0.12 slots=2\n";
  const std::string mpi_args = two_node_mpirun_args();
  std::atomic<bool> done{false};
  std::thread cutter([&] {
    while (!done && !cut_now()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!done) acc::test::run_command(kNodes + " link 2 down");
  });
  const auto r = acc::test::run_command(
      env + " " + ACC_RUN_BIN + " --hostfile " + (dir / "hosts").string() +
      " --nnodes 1:2 --nproc-per-node 2 --max-restarts " + std::to_string(max_restarts) +
      " --job-dir " + (dir / "job").string() + " --health-timeout " +
      std::to_string(health_timeout_s) + " --mpirun " + MPIEXEC_BIN + " --mpirun-args '" +
      mpi_args + "' -- " + train_args(dir, (dir / "ck").string(), "auto", strategy));
  done = true;
  cutter.join();
  return r;
}

// The losses (by step) of `ranks` ranks on this host, from scratch or resumed from `resume`.
std::vector<double> reference_losses(const fs::path& dir, int ranks, const std::string& resume,
                                     const std::string& strategy = kDdp) {
  const fs::path ref = dir / "ref";
  fs::create_directories(ref);
  const auto r = acc::test::run_command(
      std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np " + std::to_string(ranks) +
      " " + train_args(ref, (ref / "ck").string(), resume, strategy));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<double> out;
  for (const auto& l : read_jsonl(ref / "log.jsonl")) out.push_back(l["loss"].get<double>());
  return out;
}

// The processes of both nodes (every process in their namespaces: daemons and ranks).
std::string processes_in_nodes() {
  std::string out;
  for (const char* ns : {"accn1", "accn2"}) {
    out += acc::test::run_command(std::string("ip netns pids ") + ns).output;
  }
  return out;
}

void expect_nothing_left() {
  EXPECT_EQ(processes_in_nodes(), "");
}

TEST_F(AccRunNodes, ALostNodeIsLeftBehindAndTheJobResumesOnTheOther) {
  const fs::path dir = acc::test::fresh_dir("netns_test_lost");
  // The job's strategy: acc-search's cache, planned for its 4 ranks; on the 2 left the program
  // re-plans it for the new world.
  const std::string cache = (dir / "strategy.json").string();
  const auto planned = acc::test::run_command(
      std::string(ACC_SEARCH_BIN) + " --plan-only --world 4 --model gpt --config " + kConfig +
      " --global-batch 8 --seq-len 16 --out " + cache);
  ASSERT_EQ(planned.exit_code, 0) << planned.output;
  // The node dies with its ranks: its link goes down as soon as the fault has fired (its marker
  // is written, JOB/faults/fired-<hash of its text>).
  const auto r = run_on_two_nodes(
      dir, "ACC_FAULT=kill-node:rank=2:step=5", 4.0,
      [&] {
        std::error_code ec;
        return fs::directory_iterator(dir / "job" / "faults", ec) != fs::directory_iterator();
      },
      3, cache);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("re-planned for 2"), std::string::npos) << r.output;
  // The incident of the lost node (mpirun itself now and then dies at start on these
  // namespaces, SIGSEGV: acc-run restarts that too, and it is an incident of its own).
  const nlohmann::json inc = incident_with(dir, "fault", "kill-node:rank=2:step=5", r.output);
  EXPECT_EQ(inc.at("lost_nodes"), nlohmann::json({"10.77.0.12"})) << inc.dump();
  EXPECT_EQ(inc.at("nodes_after"), nlohmann::json({"10.77.0.11"})) << inc.dump();
  EXPECT_EQ(inc.at("fault"), "kill-node:rank=2:step=5");
  EXPECT_LE(inc.at("time_to_first_step_s").get<double>(), 10.0) << inc.dump();
  const auto got = last_attempt(read_jsonl(dir / "log.jsonl"));
  ASSERT_FALSE(got.empty());
  const int64_t resumed = got.front().at("step").get<int64_t>();
  expect_nothing_left();

  // The reference: 2 ranks on this host resumed from the same committed step.
  char step[32];
  std::snprintf(step, sizeof(step), "step-%08lld", static_cast<long long>(resumed));
  const auto want = reference_losses(dir, 2, (dir / "ck" / step).string(), cache);
  ASSERT_EQ(got.size(), want.size());
  ASSERT_EQ(got.size(), static_cast<size_t>(10 - resumed));
  expect_losses(got, want, resumed);
  fs::remove_all(dir);
}

// Faults on healthy nodes, one after the other in one job: rank 1 killed (node 1), node 1's ranks
// killed (the node itself answers), rank 3 stalled in backward (node 2), rank 2 slowed 6x from
// step 7. Every stop restarts the job on both nodes; the stall is diagnosed naming rank 3, its
// module and its collective; the slowed rank is named a straggler and nothing restarts for it; the
// job ends with bitwise the losses of a 4-rank run that never failed (every attempt has the same
// layout).
TEST_F(AccRunNodes, FaultsOnHealthyNodesRestartOnTheSameNodes) {
  const fs::path dir = acc::test::fresh_dir("netns_test_healthy");
  const std::string kill = "kill:rank=1:step=2", kill_node = "kill-node:rank=0:step=4",
                    stall = "stall:rank=3:step=6:phase=backward",
                    slow = "slow:rank=2:step=7:factor=6";
  const auto r = run_on_two_nodes(
      dir,
      "ACC_HANG_TIMEOUT_SEC=3 ACC_STRAGGLER_EVERY=1 ACC_FAULT='" + kill + ";" + kill_node + ";" +
          stall + ";" + slow + "'",
      4.0, [] { return false; },
      9);  // 3 stops, and room for mpirun dying at start (1 launch in ~6 on the namespaces)
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json both = {"10.77.0.11", "10.77.0.12"};
  for (const std::string& f : {kill, kill_node, stall}) {
    const nlohmann::json inc = incident_with(dir, "fault", f, r.output);
    EXPECT_EQ(inc.value("lost_nodes", nlohmann::json()), nlohmann::json::array()) << inc.dump();
    EXPECT_EQ(inc.value("nodes_after", nlohmann::json()), both) << inc.dump();
    EXPECT_LE(inc.value("time_to_first_step_s", 99.0), 10.0) << inc.dump();
  }
  const nlohmann::json hang = incident_with(dir, "fault", stall, r.output);
  EXPECT_EQ(hang.value("what", ""), "hang") << hang.dump();
  EXPECT_EQ(hang.value("culprits", nlohmann::json()), nlohmann::json({3})) << hang.dump();
  const std::string summary = hang.value("summary", "");
  EXPECT_NE(summary.find("rank 3 last completed seq"), std::string::npos) << summary;
  EXPECT_NE(summary.find("is in backward of "), std::string::npos) << summary;
  EXPECT_NE(summary.find(", about to issue allreduce"), std::string::npos) << summary;
  EXPECT_LE(hang.value("time_to_detect_s", 99.0), 3.0 + 2.0 + 1.0) << hang.dump();
  for (const auto& inc : read_jsonl(dir / "job" / "incidents.jsonl")) {
    EXPECT_NE(inc.value("fault", ""), slow) << "the slowed rank stopped the job: " << inc.dump();
  }
  EXPECT_NE(r.output.find("straggler: rank 2 "), std::string::npos) << r.output;
  expect_nothing_left();

  const auto got = last_attempt(read_jsonl(dir / "log.jsonl"));
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.back().at("step"), 9);
  const auto want = reference_losses(dir, 4, "auto");
  ASSERT_EQ(want.size(), 10u);
  expect_losses(got, want, 0);
  fs::remove_all(dir);
}

// Node 2's link goes down with its ranks alive (a partition): acc-run sees the job stop making
// progress, finds node 2 not answering, ends the attempt, says so in the incident log, and the job
// ends on node 1. (Without acc-run, the hang detector's analysis names the partition: "ranks 0,1
// cannot reach ranks 2,3"; fault_test checks that analysis.)
TEST_F(AccRunNodes, APartitionIsDiagnosedAndLeftBehind) {
  const fs::path dir = acc::test::fresh_dir("netns_test_cut");
  const auto r = run_on_two_nodes(dir, "ACC_HANG_TIMEOUT_SEC=3", 6.0, [&] {
    return read_jsonl(dir / "log.jsonl").size() >= 3;  // after 3 logged steps
  });
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json inc = incident_with(dir, "what", "node lost", r.output);
  EXPECT_NE(inc.value("summary", std::string()).find("10.77.0.12 stopped answering"),
            std::string::npos)
      << inc.dump();
  EXPECT_EQ(inc.at("lost_nodes"), nlohmann::json({"10.77.0.12"})) << inc.dump();
  const auto log = read_jsonl(dir / "log.jsonl");
  ASSERT_FALSE(log.empty());
  EXPECT_EQ(log.back()["step"], 9);
  expect_nothing_left();
  fs::remove_all(dir);
}

// SIGTERM, then SIGINT, to acc-run while the job trains on both nodes (two jobs, one after the
// other): before, acc-run alone died and the job trained on in the namespaces. Now the job ends,
// no process is left in either node (nor any with the job's ACC_JOB_DIR) within 10 s of the
// signal, the incident says it stopped and acc-run exits 128 + the signal.
TEST_F(AccRunNodes, SigtermAndSigintStopTheJobOnEveryNode) {
  for (const int sig : {SIGTERM, SIGINT}) {
    const std::string name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
    SCOPED_TRACE(name);
    const fs::path dir = acc::test::fresh_dir("netns_test_signal");
    std::ofstream(dir / "hosts") << "10.77.0.11 slots=2\n10.77.0.12 slots=2\n";
    std::string train = train_args(dir, (dir / "ck").string(), "auto");
    train.replace(train.find("--steps 10 "), 11, "--steps 100000 ");  // trains until stopped
    acc::test::Background run(std::string(ACC_RUN_BIN) + " --hostfile " + (dir / "hosts").string() +
                                  " --nnodes 1:2 --nproc-per-node 2 --max-restarts 6 --job-dir " +
                                  (dir / "job").string() + " --mpirun " + MPIEXEC_BIN +
                                  " --mpirun-args '" + two_node_mpirun_args() + "' -- " + train,
                              dir / "out.txt");
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (read_jsonl(dir / "log.jsonl").size() < 3 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_GE(read_jsonl(dir / "log.jsonl").size(), 3u) << run.output();
    ASSERT_NE(processes_in_nodes(), "") << "the job runs in the nodes";
    const auto signalled = std::chrono::steady_clock::now();
    run.signal(sig);
    EXPECT_EQ(run.wait(std::chrono::seconds(10)), 128 + sig) << run.output();
    const auto rest = std::chrono::seconds(10) - (std::chrono::steady_clock::now() - signalled);
    EXPECT_EQ(acc::test::processes_left(dir / "job", rest), std::vector<std::string>{})
        << "left running";
    std::string in_nodes = processes_in_nodes();
    while (!in_nodes.empty() &&
           std::chrono::steady_clock::now() - signalled < std::chrono::seconds(10)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      in_nodes = processes_in_nodes();
    }
    EXPECT_EQ(in_nodes, "") << "left running in the nodes";
    const auto incidents = read_jsonl(dir / "job" / "incidents.jsonl");
    ASSERT_FALSE(incidents.empty()) << run.output();
    EXPECT_EQ(incidents.back().value("what", ""), "stopped") << incidents.back().dump();
    EXPECT_EQ(incidents.back().value("signal", ""), name) << incidents.back().dump();
    EXPECT_EQ(incidents.back().value("nodes", nlohmann::json()),
              nlohmann::json({"10.77.0.11", "10.77.0.12"}))
        << incidents.back().dump();
    fs::remove_all(dir);
  }
}

}  // namespace
