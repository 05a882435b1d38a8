// Issue 16's table: what a hostile but fair user tried, and what each must now get. One row per
// case: the command (train_gpt, or train_gpt under mpirun), the exit code, the words the output
// must contain and the words it must not (no training step logged, no crash). Every row failed on
// the code before issue 16 (wrong exit code, silent acceptance, a crash or a message without the
// value). acc-trace's rows are in tests/trace/acc_trace_cli_test.cpp, output paths in
// train_gpt_test's BadFlagsGetClearErrors.
//
// Exit codes: 2 a bad command line (CLI11 validators), 1 an error while running.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "acc/io/safetensors.hpp"
#include "acc/util/system.hpp"
#include "command.hpp"

namespace {

namespace fs = std::filesystem;

using acc::test::run_command;

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

struct Case {
  std::string item;     // issue 16 item
  std::string command;  // {tg} = train_gpt with small common flags, {mpi} = mpirun prefix,
                        // {dir} = the fixture directory
  int exit_code;
  std::vector<std::string> words;
  std::vector<std::string> absent = {"| loss", "free()", "Signal:", "Aborted"};
};

class HostileInput : public testing::Test {
 protected:
  static fs::path dir;

  static void SetUpTestSuite() {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);  // as scripts/setup.sh, for a run outside CTest
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
    dir = fs::temp_directory_path() / ("acc_hostile_input_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    std::string text;
    for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog. ";
    write(dir / "text.txt", text);
    const nlohmann::json a = {
        {"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 256}, {"block_size", 64}};
    write(dir / "a.json", a.dump());
    nlohmann::json b = a;
    b["n_layer"] = 3;
    write(dir / "b.json", b.dump());
    nlohmann::json a4 = a;
    a4["n_head"] = 4;
    write(dir / "a_nhead4.json", a4.dump());
    // A config over read_json_file's limit (16 MiB): a key of 17 MiB of spaces.
    write(dir / "huge.json", "{\"n_layer\": 2" + std::string(17 << 20, ' ') + "}");
    nlohmann::json deep = a;
    deep["n_layer"] = 1000000000;
    write(dir / "deep.json", deep.dump());
    write(dir / "dup.json", R"({"n_layer": 2, "n_head": 2, "n_embd": 32, "n_layer": 3})");
    fs::create_directories(dir / "a_directory");

    // A checkpoint at step 2 and weights of the same model, then edited copies.
    const auto ck = run_command(tg() + " --steps 2 --ckpt-dir " + (dir / "ck").string() +
                                " --save " + (dir / "w.st").string());
    ASSERT_EQ(ck.exit_code, 0) << ck.output;
    acc::io::SafetensorsFile w = acc::io::load_safetensors((dir / "w.st").string());
    acc::Tensor wte;
    for (auto& [n, t] : w.tensors) {
      if (n == "transformer.wte.weight") wte = t;
    }
    ASSERT_TRUE(wte.defined());
    auto with_extra = [&](const std::string& file, const std::string& name, acc::Tensor t) {
      auto tensors = w.tensors;
      tensors.emplace_back(name, t);
      acc::io::save_safetensors((dir / file).string(), tensors, w.metadata);
    };
    with_extra("head_equal.st", "lm_head.weight", wte.clone());
    acc::Tensor other = wte.clone();
    other.data<float>()[3] += 1.0f;
    with_extra("head_other.st", "lm_head.weight", other);
    auto nan_weights = w.tensors;
    for (auto& [n, t] : nan_weights) {
      if (n == "transformer.h.1.mlp.c_fc.weight") {
        t = t.clone();
        t.data<float>()[7] = NAN;
      }
    }
    acc::io::save_safetensors((dir / "nan.st").string(), nan_weights, w.metadata);
    // A copy of the checkpoint whose metadata says step "3abc".
    fs::copy(dir / "ck", dir / "ck_badstep", fs::copy_options::recursive);
    const fs::path md = dir / "ck_badstep" / "step-00000002" / "metadata.json";
    nlohmann::json m = nlohmann::json::parse(std::ifstream(md));
    m["step"] = "3abc";
    write(md, m.dump());
  }
  static void TearDownTestSuite() { fs::remove_all(dir); }

  static std::string tg(const std::string& config = "a.json") {
    return std::string(TRAIN_GPT_BIN) + " --config " + (dir / config).string() + " --data " +
           (dir / "text.txt").string() + " --data-format text --seq-len 32 --batch-size 4";
  }
  static std::string expand(std::string s) {
    const std::vector<std::pair<std::string, std::string>> vars = {
        {"{tg_b}", tg("b.json")},
        {"{tg}", tg()},
        {"{mpi}", std::string(MPIEXEC_BIN) + " --oversubscribe"},
        {"{dir}", dir.string()}};
    for (const auto& [k, v] : vars) {
      for (size_t at; (at = s.find(k)) != std::string::npos;) s.replace(at, k.size(), v);
    }
    return s;
  }
  static void check(const Case& c) {
    const std::string cmd = expand(c.command);
    const auto r = run_command(cmd);
    SCOPED_TRACE("item " + c.item + ": " + cmd + "\n" + r.output);
    EXPECT_EQ(r.exit_code, c.exit_code);
    for (const auto& w : c.words)
      EXPECT_NE(r.output.find(w), std::string::npos) << "missing: " << w;
    for (const auto& w : c.absent) EXPECT_EQ(r.output.find(w), std::string::npos) << "found: " << w;
  }
};

fs::path HostileInput::dir;

TEST_F(HostileInput, CommandLineNumbersAreCheckedWhole) {
  const std::vector<Case> cases = {
      {"6",
       "{tg} --steps 99999999999999999999",
       2,
       {"--steps: '99999999999999999999' does not fit in a signed 64-bit integer"}},
      {"6", "{tg} --seed -1", 2, {"--seed: must be >= 0, got -1"}},
      {"6", "{tg} --sample -5", 2, {"--sample: must be >= 0, got -5"}},
      {"6", "{tg} --lr inf", 2, {"--lr: must be a finite number, got 'inf'"}},
      {"6", "{tg} --lr nan", 2, {"--lr: must be a finite number, got 'nan'"}},
      {"6", "{tg} --beta2 1", 2, {"--beta2: must be < 1, got 1"}},
      {"7", "{tg} --steps 3abc", 2, {"--steps: must be an integer, got '3abc'"}},
      {"7", "{tg} --batch-size 0", 2, {"--batch-size: must be >= 1, got 0"}},
  };
  for (const auto& c : cases) check(c);
}

TEST_F(HostileInput, ConfigsThatSayTooMuchOrTheWrongThing) {
  const std::vector<Case> cases = {
      {"6",
       "{tg} --config {dir}/dup.json",
       1,
       {"--config '" + dir.string() + "/dup.json'", "duplicate key", "n_layer"}},
      {"6",
       "{tg} --model llama",
       1,
       {"llama config is missing required field(s) hidden_size", "it has", "n_layer"}},
      {"7",
       "{tg} --config {dir}/a_directory",
       1,
       {"--config '" + dir.string() + "/a_directory': is a directory"}},
      {"7", "{tg} --strategy {dir}/a_directory", 1, {dir.string() + "/a_directory"}},
  };
  for (const auto& c : cases) check(c);
}

// Refused before the model or a batch is built, with the need and the memory available (the
// timeout of the test bounds the time: these used to allocate until killed).
TEST_F(HostileInput, AbsurdSizesAreRefusedWithBothFigures) {
  const std::vector<Case> cases = {
      {"4",
       "{tg} --config {dir}/deep.json",
       1,
       {"a training step of gpt n_layer 1000000000 at batch 4 x seq 32 needs", "TiB",
        "more than the", "of memory available"}},
      {"4",
       "{tg} --batch-size 1000000",
       1,
       {"a training step of gpt n_layer 2 at batch 1000000 x seq 32 needs", "activations peak",
        "of memory available"}},
  };
  for (const auto& c : cases) check(c);
}

TEST_F(HostileInput, PretrainedWeightsAreTakenOnlyAsTheyAre) {
  const std::vector<Case> cases = {
      {"6", "{tg} --steps 1 --init-from {dir}/head_equal.st", 0, {"loaded weights"}, {"error"}},
      {"6",
       "{tg} --steps 1 --init-from {dir}/head_other.st",
       1,
       {"--init-from '" + dir.string() + "/head_other.st'",
        "lm_head.weight differs from the tied transformer.wte.weight (max abs difference 1"}},
      {"9",
       "{tg} --steps 1 --init-from {dir}/nan.st",
       1,
       {"pretrained weights are not finite: transformer.h.1.mlp.c_fc.weight holds 1 non-finite "
        "value(s)",
        "the first nan at index 7"}},
  };
  for (const auto& c : cases) check(c);
}

TEST_F(HostileInput, ResumeRefusesAnotherModelOrNothingToDo) {
  const std::vector<Case> cases = {
      {"5",
       "{tg} --config {dir}/a_nhead4.json --steps 4 --resume {dir}/ck",
       1,
       {"was saved with n_head = 2, this run has n_head = 4"}},
      {"5",
       "{tg} --steps 2 --resume {dir}/ck",
       1,
       {"is at step 2 and --steps is 2: nothing left to train"}},
      {"7",
       "{tg} --steps 4 --resume {dir}/ck_badstep",
       1,
       {"field 'step' must be an integer", "3abc"}},
  };
  for (const auto& c : cases) check(c);
}

TEST_F(HostileInput, MoreThreadsThanCoresIsSaid) {
  const int threads = acc::usable_cores() + 1;
  check({"6",
         "{tg} --steps 1 --threads " + std::to_string(threads),
         0,
         {"threads on " + std::to_string(acc::usable_cores()) + " usable core(s)"},
         {"error"}});
}

// Issue 29's rows of the search and JSON readers (the checkpoint and acc-run rows are in
// tests/checkpoint and tests/elastic).
TEST_F(HostileInput, Issue29ConfigsAndStrategiesThatDoNotFit) {
  const std::vector<Case> cases = {
      {"29.6",
       "{tg} --config {dir}/huge.json",
       1,
       {"--config '" + dir.string() +
        "/huge.json': 17825806 bytes is over the limit of 16777216 "
        "bytes"}},
      {"29.7",
       "{tg} --steps 1 --strategy '[{\"name\": \"checkpoint\", \"config\": {\"blocks\": 99}}]'",
       1,
       {"checkpoint: blocks 99 is more than the 2 repeated block(s) of the model "
        "(transformer.h.0 ... transformer.h.1): give at most 2 or \"all\""}},
      {"29.7",
       "{tg} --steps 1 --strategy '[{\"name\": \"checkpoint\", \"config\": {\"blocks\": 2}}]'",
       0,
       {"done: loss"},
       {"error"}},
  };
  for (const auto& c : cases) check(c);
}

// Ranks started with different configs, batches or strategies: before issue 16 rank 1 died in
// free() while unwinding from "MPI Error in NBC subrequest: 15", printing no AutoAcc message.
TEST_F(HostileInput, RanksThatDisagreeAreNamedBeforeTheFirstCollective) {
  const std::string ddp = " --steps 2 --strategy '[{\"name\": \"ddp\"}]'";
  const std::vector<Case> cases = {
      {"1",
       "{mpi} -np 1 {tg}" + ddp + " : -np 1 {tg_b}" + ddp,
       1,
       {"rank 1 has model.config.n_layer = 3, rank 0 has 2"}},
      {"1",
       "{mpi} -np 1 {tg}" + ddp + " : -np 1 {tg}" + ddp + " --batch-size 2",
       1,
       {"rank 1 has run.batch_size = 2, rank 0 has 4"}},
      {"1",
       "{mpi} -np 1 {tg}" + ddp + " : -np 1 {tg} --steps 2 --strategy '[{\"name\": \"zero1\"}]'",
       1,
       {"rank 1 has strategy = [{\"config\":{},\"name\":\"zero1\"}], rank 0 has "
        "[{\"config\":{},\"name\":\"ddp\"}]"}},
  };
  for (const auto& c : cases) check(c);
}

}  // namespace
