// End-to-end tests of examples/train_gpt: the PyTorch training reference
// (tests/golden/make_train_reference.py), exact resume, and clear errors for bad flags.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "command.hpp"

namespace {

namespace fs = std::filesystem;

using ProcessResult = acc::test::CommandResult;

ProcessResult run(const std::string& args) {
  return acc::test::run_command(std::string(TRAIN_GPT_BIN) + " " + args);
}

std::vector<double> losses_from_log(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line))
    out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

// One directory per test; a parameterised test's name ("TwentyStepsSameLosses/0") has a slash,
// which would nest the directory and leave its parent behind when the test removes it.
fs::path temp_dir() {
  std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(name.begin(), name.end(), '/', '_');
  fs::path d =
      fs::temp_directory_path() / ("acc_train_gpt_test_" + std::to_string(::getpid()) + "_" + name);
  fs::create_directories(d);
  return d;
}

class TrainMatchesPyTorch : public testing::TestWithParam<std::string> {};

// A model loaded from a PyTorch-written safetensors file, trained with --data-order sequential,
// gives PyTorch's per-step losses on the same tokens (AdamW, clipping at 1.0). Tolerance: 1e-4
// relative per step (fp32 against fp32; rounding differences grow slowly over 20 steps).
TEST_P(TrainMatchesPyTorch, TwentyStepsSameLosses) {
  const std::string model = GetParam();
  const std::string ref = std::string(ACC_GOLDEN_DIR) + "/train_ref/";
  auto expect = nlohmann::json::parse(std::ifstream(ref + model + ".losses.json"));
  fs::path log = temp_dir() / "log.jsonl";
  std::string args = "--model " + model + " --config " + ref + model + ".config.json" +
                     " --init-from " + ref + model + ".init.safetensors" + " --data " + ref +
                     "tokens.u16.bin --data-format u16 --data-order sequential" + " --steps " +
                     std::to_string(expect["steps"].get<int>()) + " --batch-size " +
                     std::to_string(expect["batch_size"].get<int>()) + " --seq-len " +
                     std::to_string(expect["seq_len"].get<int>()) + " --lr " +
                     std::to_string(expect["lr"].get<double>()) +
                     " --beta1 0.9 --beta2 0.95 --eps 1e-8 --weight-decay 0.1 --grad-clip 1.0" +
                     " --threads 1 --log-json " + log.string();
  ProcessResult r = run(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto got = losses_from_log(log.string());
  auto want = expect["losses"].get<std::vector<double>>();
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < want.size(); ++s) {
    EXPECT_NEAR(got[s], want[s], 1e-4 * std::abs(want[s])) << model << " step " << s;
  }
  fs::remove_all(log.parent_path());
}

INSTANTIATE_TEST_SUITE_P(Models, TrainMatchesPyTorch, testing::Values("gpt", "llama"));

// Training 6 steps, checkpointing, and resuming to 12 gives the same losses as 12 straight steps
// (--resume auto from the --ckpt-dir; --save-every 4 leaves step 4 and step 6, --keep 1 only 6).
TEST(TrainGpt, ResumeFromCheckpointIsExact) {
  fs::path dir = temp_dir();
  const std::string data = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  const std::string common = "--model gpt --data " + data +
                             " --data-format u16 --batch-size 2 --seq-len 16 --lr 3e-3"
                             " --grad-clip 1.0 --seed 5 --threads 1";
  ASSERT_EQ(run(common + " --steps 12 --log-json " + (dir / "full.jsonl").string()).exit_code, 0);
  const std::string ck = " --ckpt-dir " + (dir / "ck").string();
  ProcessResult first = run(common + " --steps 6 --save-every 4 --keep 1" + ck + " --log-json " +
                            (dir / "a.jsonl").string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_TRUE(fs::exists(dir / "ck" / "step-00000006" / "metadata.json"));
  EXPECT_FALSE(fs::exists(dir / "ck" / "step-00000004")) << "--keep 1 kept step 4";
  ProcessResult second =
      run(common + " --steps 12 --resume auto" + ck + " --log-json " + (dir / "b.jsonl").string());
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("at step 6"), std::string::npos) << second.output;
  auto full = losses_from_log((dir / "full.jsonl").string());
  auto a = losses_from_log((dir / "a.jsonl").string());
  auto b = losses_from_log((dir / "b.jsonl").string());
  a.insert(a.end(), b.begin(), b.end());
  ASSERT_EQ(a.size(), full.size());
  for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(a[i], full[i]) << "step " << i;
  fs::remove_all(dir);
}

// A run saved by 2 ranks with zero2 resumes on 4 ranks with fsdp (the same global batch of 4:
// --batch-size is per rank) and trains as one process would, within 1e-5 (other reduction
// orders).
TEST(TrainGpt, ResumesInAnotherWorldSizeAndStrategy) {
  fs::path dir = temp_dir();
  const std::string data = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  const std::string common = " --model gpt --data " + data +
                             " --data-format u16 --data-order sequential --seq-len 16 --lr 3e-3"
                             " --grad-clip 1.0 --seed 5 --threads 1 --ckpt-dir " +
                             (dir / "ck").string();
  const std::string mpi = std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np ";
  const std::string tg = std::string(TRAIN_GPT_BIN);
  ASSERT_EQ(run("--model gpt --data " + data +
                " --data-format u16 --data-order sequential --seq-len 16 --lr 3e-3 --grad-clip 1.0"
                " --seed 5 --threads 1 --batch-size 4 --steps 8 --log-json " +
                (dir / "full.jsonl").string())
                .exit_code,
            0);
  const auto first = acc::test::run_command(
      mpi + "2 " + tg + common + " --batch-size 2 --steps 4 --strategy '[{\"name\": \"zero2\"}]'" +
      " --log-json " + (dir / "a.jsonl").string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto second = acc::test::run_command(
      mpi + "4 " + tg + common + " --batch-size 1 --steps 8 --resume auto" +
      " --strategy '[{\"name\": \"fsdp\"}]' --log-json " + (dir / "b.jsonl").string());
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  auto full = losses_from_log((dir / "full.jsonl").string());
  auto a = losses_from_log((dir / "a.jsonl").string());
  auto b = losses_from_log((dir / "b.jsonl").string());
  a.insert(a.end(), b.begin(), b.end());
  ASSERT_EQ(a.size(), full.size());
  for (size_t i = 0; i < full.size(); ++i) {
    EXPECT_NEAR(a[i], full[i], 1e-5 * std::abs(full[i])) << "step " << i;
  }
  fs::remove_all(dir);
}

// A rank killed (SIGKILL) while a checkpoint is saved: mid-write, before the step directory is
// renamed into place, and after it (before `latest` moves). Each time the next --resume auto
// loads the newest committed step (2, 2 and 4), nothing committed is lost, and the run finishes
// with bitwise the losses of one that never stopped.
TEST(TrainGpt, AKilledSaveLosesNothingCommitted) {
  fs::path dir = temp_dir();
  const std::string data = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  const std::string mpi = std::string(MPIEXEC_BIN) + " --oversubscribe --bind-to none -np 2 ";
  const std::string args = std::string(TRAIN_GPT_BIN) + " --model gpt --data " + data +
                           " --data-format u16 --seq-len 16 --batch-size 2 --lr 3e-3"
                           " --grad-clip 1.0 --seed 5 --threads 1 --steps 6 --save-every 2" +
                           " --strategy '[{\"name\": \"zero2\"}]'";
  const auto full =
      acc::test::run_command(mpi + args + " --ckpt-dir " + (dir / "ck-full").string() +
                             " --log-json " + (dir / "full.jsonl").string());
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const auto want = losses_from_log((dir / "full.jsonl").string());
  // The crash points of a save are ACC_FAULT faults (elastic/README.md); the fired faults' markers
  // go to a job directory of the test's own.
  struct Crash {
    std::string point;
    int rank;
    int64_t resumed_at;
    std::string spec() const {
      return "kill:rank=" + std::to_string(rank) + ":step=4:point=" + point;
    }
  };
  for (const Crash& c :
       {Crash{"mid_write", 1, 2}, Crash{"before_rename", 0, 2}, Crash{"after_rename", 0, 4}}) {
    const std::string spec = c.spec();
    const fs::path ck = dir / ("ck-" + c.point);
    const auto killed = acc::test::run_command(
        mpi + "-x ACC_FAULT=" + spec + " -x ACC_JOB_DIR=" + (dir / ("job-" + c.point)).string() +
        " " + args + " --ckpt-dir " + ck.string());
    EXPECT_NE(killed.exit_code, 0) << spec << ": the job was not killed\n" << killed.output;
    EXPECT_NE(killed.output.find("ACC_FAULT '" + spec + "': kill rank " + std::to_string(c.rank) +
                                 " at " + c.point + " of the save of step 4"),
              std::string::npos)
        << spec << ": not killed by its fault\n"
        << killed.output;
    const fs::path log = dir / ("resumed-" + c.point + ".jsonl");
    const auto resumed = acc::test::run_command(mpi + args + " --ckpt-dir " + ck.string() +
                                                " --resume auto --log-json " + log.string());
    ASSERT_EQ(resumed.exit_code, 0) << spec << "\n" << resumed.output;
    EXPECT_NE(resumed.output.find("at step " + std::to_string(c.resumed_at)), std::string::npos)
        << spec << "\n"
        << resumed.output;
    const auto got = losses_from_log(log.string());
    ASSERT_EQ(got.size(), want.size() - static_cast<size_t>(c.resumed_at)) << spec;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i], want[static_cast<size_t>(c.resumed_at) + i]) << spec << " step " << i;
    }
  }
  fs::remove_all(dir);
}

// --strategy auto: the search runs, prints its table, and training goes on with the choice.
TEST(TrainGpt, StrategyAutoSearchesThenTrains) {
  const std::string data = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  const fs::path dir = temp_dir();
  const ProcessResult r =
      run("--model gpt --data " + data + " --batch-size 4 --seq-len 16 --steps 3 --threads 1 " +
          "--strategy auto --log-json " + (dir / "log.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("auto_accelerate: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("candidate"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\n* "), std::string::npos) << "no chosen row: " << r.output;
  EXPECT_EQ(losses_from_log((dir / "log.jsonl").string()).size(), 3u);
  fs::remove_all(dir);
}

TEST(TrainGpt, BadFlagsGetClearErrors) {
  const std::string data = std::string(ACC_GOLDEN_DIR) + "/train_ref/tokens.u16.bin";
  struct Case {
    std::string args, needle;
  };
  std::vector<Case> cases = {
      {"--model bert --data " + data, "--model must be gpt or llama, got 'bert'"},
      {"--data " + data + " --data-format u8", "u8"},
      {"--data " + data + " --data-order shuffled", "shuffled"},
      {"--data /nonexistent/tokens.bin", "/nonexistent/tokens.bin"},
      {"--data " + data + " --steps 0", "--steps: must be >= 1, got 0"},
      {"--data " + data + " --seq-len 100000", "--seq-len 100000 exceeds"},
      {"--data " + data + " --config /nonexistent.json", "/nonexistent.json"},
      {"--data " + data + " --init-from /nonexistent.safetensors", "/nonexistent.safetensors"},
      {"--data " + data + " --grad-clip -1", "--grad-clip: must be >= 0, got -1"},
      // Output paths are checked before any training (no step is logged).
      {"--data " + data + " --save /nonexistent-dir/w.safetensors",
       "--save '/nonexistent-dir/w.safetensors': directory '/nonexistent-dir' does not exist"},
      {"--data " + data + " --save " + fs::temp_directory_path().string(),
       "is a directory, not a file name"},
      {"--data " + data + " --ckpt-dir /nonexistent-dir/ck",
       "--ckpt-dir '/nonexistent-dir/ck': directory '/nonexistent-dir' does not exist"},
      {"--data " + data + " --save-every 2", "--save-every needs --ckpt-dir"},
      {"--data " + data + " --resume auto", "--resume auto resumes from --ckpt-dir"},
      {"--data " + data + " --resume " + data, "single-file checkpoints (the former"},
      {"--data " + data + " --log-json /nonexistent-dir/log.jsonl",
       "--log-json '/nonexistent-dir/log.jsonl'"},
  };
  for (const auto& c : cases) {
    ProcessResult r = run(c.args + " --threads 1");
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("| loss"), std::string::npos) << c.args << ": trained before failing";
  }
}

}  // namespace
