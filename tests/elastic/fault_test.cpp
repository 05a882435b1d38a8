// ACC_FAULT's grammar, the hang analysis on hand-made reports, and the agent of a one-rank job:
// its learned timeout and the options it refuses.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iterator>
#include <thread>
#include <vector>

#include "acc/dist/process_group.hpp"
#include "acc/elastic/agent.hpp"
#include "acc/elastic/fault.hpp"
#include "acc/util/error.hpp"
#include "acc/util/progress.hpp"
#include "error_of.hpp"
#include "files.hpp"

namespace acc::elastic {
namespace {

namespace fs = std::filesystem;

AgentOptions options_in(const fs::path& dir) {
  AgentOptions o;
  o.job_dir = dir.string();
  o.faults = "";
  return o;
}

// The timeout is 600 s until 3 steps have been seen and while a checkpoint is saved or loaded,
// else 10x the longest recent step, never under 60 s; a fixed one overrides all of it.
TEST(Agent, TheLearnedTimeoutAllowsSlowFirstStepsSavesAndLoads) {
  ::unsetenv("ACC_HANG_TIMEOUT_SEC");  // learned, whatever the caller's environment says
  const fs::path dir = test::fresh_dir("agent_test");
  auto world = dist::ProcessGroup::world();
  {
    auto agent = Agent::start(world, options_in(dir));
    EXPECT_EQ(agent->timeout_s(), 600.0);
    for (int64_t s = 0; s < 4; ++s) {
      progress::step(s);
      if (s < 3) {
        EXPECT_EQ(agent->timeout_s(), 600.0) << "after step " << s << " began";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(agent->timeout_s(), 60.0);  // 10 x a few ms: the floor
    progress::phase(progress::Phase::kSave);
    EXPECT_EQ(agent->timeout_s(), 600.0);
    progress::phase(progress::Phase::kForward);
    EXPECT_EQ(agent->timeout_s(), 60.0);
    progress::phase(progress::Phase::kLoad, [] { return std::string("checkpoint step 2"); });
    EXPECT_EQ(agent->timeout_s(), 600.0);
  }
  AgentOptions fixed = options_in(dir);
  fixed.hang_timeout_s = 4.5;
  EXPECT_EQ(Agent::start(world, fixed)->timeout_s(), 4.5);
  fs::remove_all(dir);
}

TEST(Agent, BadOptionsAreNamed) {
  const fs::path dir = test::fresh_dir("agent_bad");
  auto world = dist::ProcessGroup::world();
  struct Case {
    std::function<void(AgentOptions&)> set;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](AgentOptions& o) { o.hang_timeout_s = 0; }, "hang timeout must be > 0, got 0"},
      {[](AgentOptions& o) { o.hang_timeout_s = 1e300; },
       "hang timeout must be at most 604800 seconds (7 days: every timeout is finite), got 1e+300"},
      {[](AgentOptions& o) { o.grace_s = -1; }, "grace_s must be >= 0, got -1"},
      {[](AgentOptions& o) { o.straggler_factor = 1.0; },
       "ACC_STRAGGLER_FACTOR must be > 1, got 1"},
      {[](AgentOptions& o) { o.straggler_min_s = -0.5; },
       "ACC_STRAGGLER_MIN_SEC must be >= 0, got -0.5"},
      {[](AgentOptions& o) { o.straggler_every = -2; }, "ACC_STRAGGLER_EVERY must be >= 0, got -2"},
      {[](AgentOptions& o) { o.faults = "kill:rank=3:step=1"; },
       "ACC_FAULT 'kill:rank=3:step=1': rank 3 is not in a job of 1 rank(s)"},
  };
  auto open_fds = [] {
    return std::distance(fs::directory_iterator("/proc/self/fd"), fs::directory_iterator());
  };
  const auto fds = open_fds();
  for (const Case& c : cases) {
    AgentOptions o = options_in(dir);
    c.set(o);
    const std::string msg = test::error_of<Error>([&] { Agent::start(world, o); });
    EXPECT_NE(msg.find(c.message), std::string::npos) << msg;
  }
  EXPECT_EQ(open_fds(), fds) << "a refused start left a descriptor open (its listening socket)";
  // The checkpoint's former crash injection is refused, not silently ignored.
  ::setenv("ACC_CKPT_CRASH", "mid_write:rank=0:step=2", 1);
  const std::string msg = test::error_of<Error>([&] { Agent::start(world, options_in(dir)); });
  ::unsetenv("ACC_CKPT_CRASH");
  EXPECT_NE(msg.find("ACC_CKPT_CRASH is no longer read: a crash inside a save is an ACC_FAULT, "
                     "kill:rank=R:step=S:point=mid_write|before_rename|after_rename"),
            std::string::npos)
      << msg;
  fs::remove_all(dir);
}

// A fault at a point of a save fires there alone (it kills: firing anywhere else would end this
// test's process): not at the step's start, not at a phase mark of its step, not at another
// point, not at its point in the save of an earlier step. (That it fires at its point is
// train_gpt_test's AKilledSaveLosesNothingCommitted.)
TEST(Agent, AFaultAtAPointOfASaveWaitsForThatPoint) {
  const fs::path dir = test::fresh_dir("agent_point");
  auto world = dist::ProcessGroup::world();
  {
    AgentOptions o = options_in(dir);
    o.faults = "kill:rank=0:step=2:point=before_rename";
    auto agent = Agent::start(world, o);
    for (int64_t s = 0; s < 4; ++s) {
      progress::step(s);
      progress::phase(progress::Phase::kSave);
      progress::phase(progress::Phase::kCollective);
      progress::point(progress::Point::kMidWrite, s);
      progress::point(progress::Point::kAfterRename, s);
    }
    progress::point(progress::Point::kBeforeRename, 1);  // the save of step 1
  }
  EXPECT_FALSE(fs::exists(dir / "faults")) << "a fault was marked fired";
  fs::remove_all(dir);
}

TEST(Faults, ParsesEveryActionWithItsOptions) {
  const auto f = parse_faults(
      "kill:rank=1:step=5; stall:rank=2:step=3:phase=backward;slow:rank=0:step=0:factor=2.5;"
      "kill-node:rank=3:step=7:phase=collective;kill:rank=1:step=4:point=mid_write;"
      "kill-node:rank=0:step=2:point=after_rename");
  ASSERT_EQ(f.size(), 6u);
  EXPECT_EQ(f[0].action, FaultAction::kKill);
  EXPECT_EQ(f[0].rank, 1);
  EXPECT_EQ(f[0].step, 5);
  EXPECT_FALSE(f[0].phase.has_value());
  EXPECT_EQ(f[1].action, FaultAction::kStall);
  EXPECT_EQ(f[1].phase, progress::Phase::kBackward);
  EXPECT_EQ(f[1].text, "stall:rank=2:step=3:phase=backward");
  EXPECT_EQ(f[2].action, FaultAction::kSlow);
  EXPECT_DOUBLE_EQ(f[2].factor, 2.5);
  EXPECT_EQ(f[3].action, FaultAction::kKillNode);
  EXPECT_EQ(f[3].phase, progress::Phase::kCollective);
  EXPECT_FALSE(f[3].point.has_value());
  EXPECT_EQ(f[4].action, FaultAction::kKill);
  EXPECT_EQ(f[4].point, progress::Point::kMidWrite);
  EXPECT_EQ(f[4].step, 4);
  EXPECT_FALSE(f[4].phase.has_value());
  EXPECT_EQ(f[5].action, FaultAction::kKillNode);
  EXPECT_EQ(f[5].point, progress::Point::kAfterRename);
  EXPECT_EQ(parse_faults("kill:rank=0:step=1:point=before_rename")[0].point,
            progress::Point::kBeforeRename);
  EXPECT_TRUE(parse_faults("").empty());
  EXPECT_TRUE(parse_faults(" ; ").empty());
}

TEST(Faults, BadSpecsAreNamed) {
  struct Case {
    const char* spec;
    const char* message;
  };
  for (const Case& c :
       {Case{"explode:rank=1:step=2", "unknown action 'explode'"},
        Case{"kill:rank=1", "rank=R and step=S are required"},
        Case{"kill:step=1", "rank=R and step=S are required"},
        Case{"kill:rank=-1:step=1", "must be >= 0, got -1"}, Case{"kill:rank=x:step=1", "rank"},
        Case{"kill:rank=1:step=1:phase=lunch", "unknown phase 'lunch'"},
        Case{"kill:rank=1:step=1:when=now", "unknown key 'when'"},
        Case{"kill:rank=1:step=1:factor=2", "factor applies to slow only"},
        Case{"slow:rank=1:step=1", "slow needs factor=F with F > 1"},
        Case{"slow:rank=1:step=1:factor=0.5", "slow needs factor=F with F > 1"},
        Case{"kill:rank=1:step", "is not KEY=VALUE"},
        Case{"kill:rank=1:rank=2:step=3", "'kill:rank=1:rank=2:step=3': key 'rank' is given twice"},
        Case{"slow:rank=1:step=2:factor=2:factor=3", "key 'factor' is given twice"},
        Case{"slow:rank=0:step=1:factor=1e308",
             "factor must be at most 1000 (a rank slowed more is stalled: use stall), got 1e308"},
        Case{"slow:rank=0:step=1:factor=0.5", "slow needs factor=F with F > 1, got 0.5"},
        Case{"kill:rank=0:step=2;kill:rank=0:step=2", "'kill:rank=0:step=2' is listed twice"},
        // The crash points of a save (they were ACC_CKPT_CRASH's).
        Case{"kill:rank=1:step=4:point=mid_read",
             "'kill:rank=1:step=4:point=mid_read': unknown point 'mid_read' (expected mid_write, "
             "before_rename or after_rename)"},
        Case{"kill:rank=1:point=mid_write", "rank=R and step=S are required"},
        Case{"stall:rank=1:step=4:point=mid_write", "point applies to kill and kill-node only"},
        Case{"slow:rank=1:step=4:point=mid_write:factor=2",
             "point applies to kill and kill-node only"},
        Case{"kill:rank=1:step=4:point=mid_write:phase=save",
             "a fault is reached at a phase or at a point, not both"},
        Case{"kill:rank=1:step=4:point=mid_write:point=after_rename", "key 'point' is given twice"},
        Case{"kill:rank=1:step=4:point=", "unknown point ''"}}) {
    const std::string msg = test::error_of<ValueError>([&] { parse_faults(c.spec); });
    EXPECT_NE(msg.find(c.message), std::string::npos) << c.spec << ": " << msg;
    EXPECT_NE(msg.find("ACC_FAULT"), std::string::npos) << msg;
  }
}

nlohmann::json report(int rank, int64_t step, const std::string& phase, const std::string& what,
                      uint64_t last_completed, const std::vector<uint64_t>& in_flight,
                      const std::string& group = "dp") {
  nlohmann::json flights = nlohmann::json::array();
  for (uint64_t s : in_flight)
    flights.push_back({{"op", "allreduce.sum"}, {"seq", s}, {"state", "started"}});
  return {{"rank", rank},
          {"step", step},
          {"phase", phase},
          {"what", what},
          {"groups",
           {{{"group", group}, {"last_completed_seq", last_completed}, {"in_flight", flights}}}}};
}

TEST(HangAnalysis, NamesTheWaitersTheLaggardAndTheSilent) {
  // Ranks 0 and 2 wait in seq 1042; rank 1 completed 1041 and stopped in backward of a module,
  // right before it issued 1042; rank 3 is silent.
  nlohmann::json lagging = report(1, 9, "backward", "", 1041, {});
  lagging["module"] = "transformer.h.7.mlp";
  lagging["entering"] = "allreduce.sum seq 1042 of group 'dp'";
  const auto a = analyze_hang({report(0, 9, "backward", "", 1041, {1042}), lagging,
                               report(2, 9, "backward", "", 1041, {1042}), std::nullopt});
  EXPECT_EQ(a["summary"],
            "ranks 0,2 wait in allreduce.sum seq 1042 of group 'dp'; rank 1 last completed seq "
            "1041 and is in backward of transformer.h.7.mlp at step 9, about to issue "
            "allreduce.sum seq 1042 of group 'dp'; rank 3 wrote no report (stopped or dead)");
  EXPECT_EQ(a["culprits"], nlohmann::json({1, 3}));
  EXPECT_EQ(a["not_reporting"], nlohmann::json({3}));
  ASSERT_EQ(a["groups"].size(), 1u);
  EXPECT_EQ(a["groups"][0]["seq"], 1042);
  EXPECT_EQ(a["groups"][0]["waiting"], nlohmann::json({0, 2}));
  EXPECT_EQ(a["groups"][0]["lagging"][0]["rank"], 1);
  EXPECT_EQ(a["groups"][0]["lagging"][0]["last_completed_seq"], 1041);
  EXPECT_EQ(a["groups"][0]["lagging"][0]["module"], "transformer.h.7.mlp");
}

TEST(HangAnalysis, ARankAheadIsNoCulpritAndNoCollectiveMeansEveryoneStopped) {
  // Rank 1 has completed 1042 and waits in 1043: it is ahead of rank 0, which waits in 1042, so
  // nobody is behind in 1042 (whatever holds rank 0 there, it is not rank 1).
  const auto ahead = analyze_hang(
      {report(0, 4, "backward", "", 1041, {1042}), report(1, 4, "backward", "", 1042, {1043})});
  EXPECT_EQ(ahead["culprits"], nlohmann::json::array());
  EXPECT_EQ(ahead["groups"][0]["waiting"], nlohmann::json({0}));
  const auto idle =
      analyze_hang({report(0, 2, "forward", "", 10, {}), report(1, 2, "update", "", 10, {})});
  EXPECT_EQ(
      idle["summary"],
      "no collective in flight; rank 0 is in forward at step 2; rank 1 is in update at step 2");
  EXPECT_EQ(idle["culprits"], nlohmann::json::array());
}

// A rank's report of group 'pp' (world ranks 0, 1, 2 in that order), with its messages: per peer
// and direction the last issued and completed (both `done` here), and those in flight.
struct Msg {
  std::string dir;
  int peer;
  uint64_t seq;
  int tag = 0;
};
nlohmann::json pp_report(int rank, int64_t step, const std::string& phase,
                         const std::vector<std::pair<Msg, uint64_t>>& done,
                         const std::vector<Msg>& in_flight, const std::string& entering = "",
                         const std::string& group = "pp") {
  nlohmann::json flights = nlohmann::json::array(), p2p = nlohmann::json::array();
  for (const Msg& m : in_flight) {
    flights.push_back({{"op", m.dir},
                       {"p2p", m.dir},
                       {"seq", m.seq},
                       {"peer", m.peer},
                       {"peer_rank", m.peer},
                       {"tag", m.tag},
                       {"state", "started"}});
  }
  for (const auto& [m, last] : done) {
    p2p.push_back({{"peer", m.peer},
                   {"peer_rank", m.peer},
                   {"direction", m.dir},
                   {"issued_seq", m.seq},
                   {"last_completed_seq", last}});
  }
  return {{"rank", rank},
          {"step", step},
          {"phase", phase},
          {"entering", entering},
          {"groups",
           {{{"group", group},
             {"members", {0, 1, 2}},
             {"issued_seq", 7},
             {"last_completed_seq", 7},
             {"in_flight", flights},
             {"p2p", p2p}}}}};
}

// Rank 2 waits in recv seq 14 from rank 1 (on the pipeline's group 'pp' both are named by their
// stage, their place among its members); rank 1 has sent 13 messages to rank 2 and stopped in
// forward right before its 14th. Its gradient messages to rank 0 (recv seq 14 from rank 0 is
// done) and the group's collectives (seq 7 everywhere) are no part of it.
TEST(HangAnalysis, NamesAStalledRecvByItsOwnNumberAndThePeerThatDidNotSend) {
  const auto a =
      analyze_hang({pp_report(0, 5, "backward", {{{"send", 1, 14}, 14}}, {}),
                    pp_report(1, 5, "forward", {{{"recv", 0, 14}, 14}, {{"send", 2, 13}, 13}}, {},
                              "send seq 14 to rank 2 of group 'pp'"),
                    pp_report(2, 5, "forward", {{{"recv", 1, 14}, 13}}, {{"recv", 1, 14}})});
  EXPECT_EQ(
      a["summary"],
      "rank 2 (stage 2) waits in recv seq 14 from rank 1 (stage 1) of group 'pp'; rank 1 last "
      "issued send seq 13 to rank 2 and is in forward at step 5, about to issue send seq 14 "
      "to rank 2 of group 'pp'");
  EXPECT_EQ(a["culprits"], nlohmann::json({1}));
  EXPECT_EQ(a["groups"], nlohmann::json::array());
  ASSERT_EQ(a["p2p"].size(), 1u);
  const nlohmann::json& p = a["p2p"][0];
  EXPECT_EQ(p["op"], "recv");
  EXPECT_EQ(p["seq"], 14);
  EXPECT_EQ(p["rank"], 2);
  EXPECT_EQ(p["peer"], 1);
  EXPECT_EQ(p["peer_issued_seq"], 13);
  EXPECT_EQ(p["peer_waiting"], false);
  EXPECT_EQ(p["lagging"]["rank"], 1);
  EXPECT_EQ(p["lagging"]["step"], 5);
}

// Both sides of one message in flight: told once. With different tags the two ranks pair
// different messages under that number (a schedule bug); nobody lags.
TEST(HangAnalysis, AMessageBothSidesWaitInIsToldOnceWithItsTags) {
  const auto a =
      analyze_hang({pp_report(0, 2, "forward", {{{"send", 1, 3}, 2}}, {{"send", 1, 3, 1}}),
                    pp_report(1, 2, "forward", {{{"recv", 0, 3}, 2}}, {{"recv", 0, 3, 0}})});
  EXPECT_EQ(a["summary"],
            "rank 0 (stage 0) waits in send seq 3 to rank 1 (stage 1) of group 'pp'; rank 1 waits "
            "in its recv seq 3 with tag 0, this one has tag 1 (the two ranks pair different "
            "messages)");
  EXPECT_EQ(a["culprits"], nlohmann::json::array());
  ASSERT_EQ(a["p2p"].size(), 1u);
  EXPECT_EQ(a["p2p"][0]["peer_tag"], 0);
  EXPECT_EQ(a["p2p"][0]["peer_waiting"], true);
}

// A mesh group's report names it "tp of dp=1" (dist::ParallelContext): the analysis says which
// group along tp stalled as "group 'tp' of dp=1", for a collective and for a message alike, and
// keeps the name itself in its JSON.
TEST(HangAnalysis, NamesAMeshGroupByItsDimensionAndPlace) {
  nlohmann::json lagging = report(1, 6, "forward", "", 40, {}, "tp of dp=1");
  lagging["entering"] = "allreduce.sum seq 41 of group 'tp' of dp=1";
  const auto a = analyze_hang({report(0, 6, "forward", "", 40, {41}, "tp of dp=1"), lagging});
  EXPECT_EQ(a["summary"],
            "rank 0 waits in allreduce.sum seq 41 of group 'tp' of dp=1; rank 1 last completed seq "
            "40 and is in forward at step 6, about to issue allreduce.sum seq 41 of group 'tp' of "
            "dp=1");
  ASSERT_EQ(a["groups"].size(), 1u);
  EXPECT_EQ(a["groups"][0]["group"], "tp of dp=1");
  const auto p = analyze_hang(
      {pp_report(0, 5, "backward", {{{"send", 1, 14}, 14}}, {}, "", "pp of tp=1"),
       pp_report(1, 5, "forward", {{{"recv", 0, 14}, 14}, {{"send", 2, 13}, 13}}, {},
                 "send seq 14 to rank 2 of group 'pp' of tp=1", "pp of tp=1"),
       pp_report(2, 5, "forward", {{{"recv", 1, 14}, 13}}, {{"recv", 1, 14}}, "", "pp of tp=1")});
  EXPECT_EQ(p["summary"],
            "rank 2 (stage 2) waits in recv seq 14 from rank 1 (stage 1) of group 'pp' of tp=1; "
            "rank 1 last issued send seq 13 to rank 2 and is in forward at step 5, about to issue "
            "send seq 14 to rank 2 of group 'pp' of tp=1");
  ASSERT_EQ(p["p2p"].size(), 1u);
  EXPECT_EQ(p["p2p"][0]["group"], "pp of tp=1");
}

TEST(HangAnalysis, APartitionIsNamed) {
  auto a0 = report(0, 4, "update", "", 72, {73}), a1 = report(1, 4, "update", "", 72, {73});
  auto b2 = report(2, 4, "update", "", 72, {73}), b3 = report(3, 4, "update", "", 72, {73});
  a0["unreachable"] = a1["unreachable"] = {2, 3};
  b2["unreachable"] = b3["unreachable"] = {0, 1};
  const auto a = analyze_hang({a0, a1, b2, b3});
  EXPECT_EQ(
      a["summary"],
      "ranks 0,1,2,3 wait in allreduce.sum seq 73 of group 'dp'; ranks 2,3 cannot reach ranks "
      "0,1 (a link down or a partition); ranks 0,1 cannot reach ranks 2,3 (a link down or a "
      "partition)");
  EXPECT_EQ(a["partition"].size(), 4u);
}

}  // namespace
}  // namespace acc::elastic
