// examples/custom_model end to end, as a user runs it: with no arguments at 1, 2 and 4 ranks (the
// same losses: every layout trains the global batch as one process), its `search` subcommand
// caching a strategy the program then uses, bad flags named, and under acc-run a rank killed
// mid-run: the job resumes with bitwise the losses of a run that never failed and the step log
// holds every step of every attempt.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "../elastic/files.hpp"
#include "../elastic/local_job.hpp"
#include "command.hpp"

namespace {

namespace fs = std::filesystem;
using acc::test::read_jsonl;
using acc::test::run_command;

std::string mpirun(int np) {
  return std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np " + std::to_string(np) +
         " ";
}

const std::string kBin = CUSTOM_MODEL_BIN;

std::vector<double> losses(const fs::path& log) {
  std::vector<double> out;
  for (const auto& l : read_jsonl(log)) out.push_back(l.at("loss").get<double>());
  return out;
}

TEST(CustomModelExample, RunsWithNoArgumentsAtOneTwoAndFourRanksToTheSameLosses) {
  const fs::path dir = acc::test::fresh_dir("custom_model_ranks");
  std::vector<double> one;
  for (const int np : {1, 2, 4}) {
    const fs::path log = dir / ("log" + std::to_string(np) + ".jsonl");
    const auto r =
        run_command((np == 1 ? std::string() : mpirun(np)) + kBin + " --log-json " + log.string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("custom_model: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("on " + std::to_string(np) + " rank(s), steps 0..300"),
              std::string::npos)
        << r.output;
    const std::vector<double> got = losses(log);
    ASSERT_EQ(got.size(), 300u);
    EXPECT_LT(got.back(), 0.5 * got.front()) << "it learns";
    if (np == 1) {
      one = got;
      continue;
    }
    // fp32, another reduction order and whatever layout the search chose (amp is not allowed by
    // default): 300 steps drift apart by far less than 1e-3 relative.
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_NEAR(got[s], one[s], 1e-3 * std::abs(one[s])) << np << " ranks, step " << s;
    }
  }
  fs::remove_all(dir);
}

TEST(CustomModelExample, SearchCachesAStrategyTheProgramThenUses) {
  const fs::path dir = acc::test::fresh_dir("custom_model_search");
  {
    std::ofstream(dir / "net.json")
        << R"({"features": 32, "width": 64, "hidden": 128, "layers": 4, "classes": 8})";
  }
  const fs::path cache = dir / "strategy.json";
  const auto s = run_command(mpirun(2) + kBin + " search --model residual_mlp --config " +
                             (dir / "net.json").string() + " --global-batch 64 --top-k 2 --out " +
                             cache.string());
  ASSERT_EQ(s.exit_code, 0) << s.output;
  ASSERT_TRUE(fs::exists(cache)) << s.output;
  const nlohmann::json c = nlohmann::json::parse(std::ifstream(cache));
  EXPECT_EQ(c.at("key").at("model_type"), "Net") << c.dump();
  EXPECT_EQ(c.at("key").at("world"), 2);
  // The program with the cache: used as it is (same model, batch, world and machine), no search.
  const auto r = run_command(mpirun(2) + kBin + " --steps 20 --strategy " + cache.string() +
                             " --search-report " + (dir / "report").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json report = nlohmann::json::parse(std::ifstream(dir / "report/report.json"));
  EXPECT_EQ(report.at("source"), "cache") << report.dump().substr(0, 400);
  EXPECT_EQ(report.at("chosen"), c.at("strategy"));
  // Another model (one more layer): the cache is stale, named by field, and the search runs.
  const auto other =
      run_command(mpirun(2) + kBin + " --steps 20 --layers 5 --strategy " + cache.string());
  ASSERT_EQ(other.exit_code, 0) << other.output;
  EXPECT_NE(other.output.find("trace_hash"), std::string::npos) << other.output;
  // --plan-only for 4 ranks, no MPI: the model built on the meta device.
  const auto plan = run_command(
      kBin + " search --model residual_mlp --config " + (dir / "net.json").string() +
      " --global-batch 64 --plan-only --world 4 --out " + (dir / "plan4.json").string());
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("planned for 4 rank(s)"), std::string::npos) << plan.output;
  fs::remove_all(dir);
}

TEST(CustomModelExample, BadInputIsNamed) {
  struct Case {
    std::string command;
    int exit_code;
    std::string says;
  };
  const fs::path dir = acc::test::fresh_dir("custom_model_bad");
  const std::vector<Case> cases = {
      {kBin + " --layers -1", 2, "--layers"},
      {kBin + " --global-batch 0", 2, "--global-batch"},
      {mpirun(2) + kBin + " --global-batch 7", 1, "--global-batch 7 does not split over 2"},
      {kBin + " --resume auto", 1, "--ckpt-dir"},
      {kBin + " --save-every 5", 1, "--ckpt-dir"},
      {kBin + " --strategy '[{\"name\": \"fsdp\", \"config\": {\"units\": [\"blocks.9\"]}}]'", 1,
       "unit 'blocks.9' names no module"},
      {kBin + " search --model residual_mlp --config /nonexistent.json --global-batch 8 --out " +
           (dir / "x.json").string(),
       1, "/nonexistent.json"},
      {kBin + " search --model nosuch --config x --global-batch 8 --out x", 2, "--model"},
  };
  for (const auto& c : cases) {
    const auto r = run_command(c.command);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.command << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.command << "\n" << r.output;
  }
  fs::remove_all(dir);
}

// A user program (not train_gpt) under acc-run: rank 1 killed at step 25 of 40, the job resumes
// from the newest committed checkpoint with bitwise the losses of the uninterrupted run, and the
// step log holds every step of every attempt.
TEST(CustomModelExample, UnderAccRunAKilledRankResumesBitwise) {
  const fs::path dir = acc::test::fresh_dir("custom_model_acc_run");
  auto program = [&](const fs::path& run) {
    return kBin + " --steps 40 --global-batch 32 --threads 1 --strategy '[{\"name\": \"zero2\"}]'" +
           " --save-every 5 --resume auto --ckpt-dir " + (run / "ck").string() + " --log-json " +
           (run / "log.jsonl").string();
  };
  const fs::path ref = dir / "ref";
  fs::create_directories(ref);
  const auto r = run_command(mpirun(2) + program(ref));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> want = losses(ref / "log.jsonl");
  ASSERT_EQ(want.size(), 40u);

  const auto job = run_command(
      acc::test::local_acc_run(dir, 2, 1, "ACC_FAULT=kill:rank=1:step=25", program(dir)));
  ASSERT_EQ(job.exit_code, 0) << job.output;
  const auto incidents = read_jsonl(dir / "job" / "incidents.jsonl");
  ASSERT_EQ(incidents.size(), 1u) << job.output;
  EXPECT_EQ(incidents[0].at("fault"), "kill:rank=1:step=25");
  const int64_t resumed = incidents[0].at("resumed_at_step").get<int64_t>();
  EXPECT_TRUE(resumed == 20 || resumed == 25) << incidents[0].dump();
  // Attempt 0: steps 0..24 (killed as step 25 began); attempt 1: from the resumed step to 39, each
  // loss bitwise the uninterrupted run's.
  const auto log = read_jsonl(dir / "log.jsonl");
  std::vector<std::pair<int64_t, int64_t>> got, expected;
  for (const auto& l : log) {
    got.emplace_back(l.at("attempt"), l.at("step"));
    const auto step = l.at("step").get<size_t>();
    ASSERT_LT(step, want.size());
    EXPECT_EQ(l.at("loss").get<double>(), want[step]) << l.dump();
  }
  for (int64_t s = 0; s <= 24; ++s) expected.emplace_back(0, s);
  for (int64_t s = resumed; s < 40; ++s) expected.emplace_back(1, s);
  EXPECT_EQ(got, expected);
  fs::remove_all(dir);
}

}  // namespace
