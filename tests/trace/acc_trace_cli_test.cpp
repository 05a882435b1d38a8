// acc-trace's refusals: each case runs the tool and expects a non-zero exit and a message naming
// the bad value, before any tracing work (no summary printed). And its answer for a model too deep
// to trace: the summary from the estimate, at once.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include "command.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Result = acc::test::CommandResult;

// Under `timeout`: a regression that builds a model of 10^9 blocks again fails instead of hanging.
Result run(const std::string& args) {
  return acc::test::run_command("timeout 120 " + std::string(ACC_TRACE_BIN) + " " + args);
}

// gpt_small.json with `field` set to `value`, in a file of the test's own removed with it.
struct TempConfig {
  std::string path;
  ~TempConfig() { std::filesystem::remove(path); }
};
TempConfig gpt_small_with(const std::string& field, const std::string& value) {
  std::map<std::string, std::string> c = {{"n_layer", "4"},
                                          {"n_head", "4"},
                                          {"n_embd", "128"},
                                          {"vocab_size", "256"},
                                          {"block_size", "128"},
                                          {"bias", "true"},
                                          {"activation", "\"gelu_tanh\""}};
  c[field] = value;
  std::ostringstream json;
  for (const auto& [k, v] : c) json << (json.tellp() > 0 ? ", " : "{") << '"' << k << "\": " << v;
  json << "}";
  const auto path =
      std::filesystem::temp_directory_path() /
      ("acc_trace_cli_test_" + std::to_string(::getpid()) + "_" + field + "_" + value + ".json");
  std::ofstream(path) << json.str();
  return {path.string()};
}

TEST(AccTraceCli, BadArgumentsAreRefusedNamingTheValue) {
  const std::string config = std::string(ACC_SOURCE_DIR) + "/examples/configs/gpt_small.json";
  const std::string tmp = std::filesystem::temp_directory_path().string();
  const TempConfig wide = gpt_small_with("n_embd", "1000000000");
  const TempConfig deep = gpt_small_with("n_layer", "1000000000");
  const TempConfig deeper = gpt_small_with("n_layer", "1000000000000000000");
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"--json /nonexistent-dir/t.json",
       "--json '/nonexistent-dir/t.json': directory '/nonexistent-dir' does not exist"},
      {"--dot /nonexistent-dir/t.dot", "--dot '/nonexistent-dir/t.dot'"},
      {"--json " + tmp, "is a directory, not a file name"},
      {"--batch-size 4611686018427387904",
       "shape [4611686018427387904, 128] has more elements than fit in 64 bits"},
      {"--recompute-blocks -3", "--recompute-blocks: must be >= -1, got -3"},
      {"--batch-size 99999999999999999999", "does not fit in a signed 64-bit integer"},
      {"--batch-size 3abc", "--batch-size: must be an integer, got '3abc'"},
      // n_embd 1e9: 3e18 elements of c_attn fit in 64 bits, their bytes do not (this printed
      // negative parameters and a negative memory peak with exit 0).
      {"--config " + wide.path, "bytes of shape [3000000000, 1000000000] (f32)"},
      {"--config " + deeper.path, "gpt n_layer 1000000000000000000: parameters: "},
      {"--config " + deep.path + " --json " + tmp + "/t.json",
       "--json needs the full graph, but gpt n_layer 1000000000 would make a graph of 71.000B "
       "vertices"},
      // An explicit 0 used the model's maximum; omitting the flag still does.
      {"--seq-len 0", "--seq-len: must be >= 1, got 0"},
      {"--seq-len -5", "--seq-len: must be >= 1, got -5"},
      {"--depth -1", "--depth: must be >= 0, got -1"},  // printed an empty table
      {"--max-vertices 0", "--max-vertices: must be >= 1, got 0"},
  };
  for (const auto& c : cases) {
    const bool own_config = c.args.rfind("--config ", 0) == 0;
    const Result r = run(own_config ? c.args : "--config " + config + " " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("FLOPs/step"), std::string::npos) << c.args << ": traced anyway";
  }
}

// n_layer 1e9 used to be built and traced until killed; now the summary comes from the estimate
// (milliseconds) with a line naming the depth and the graph it would have made, exit 0.
TEST(AccTraceCli, BillionsOfBlocksGetTheEstimatedSummaryAtOnce) {
  const TempConfig deep = gpt_small_with("n_layer", "1000000000");
  const Result r = run("--config " + deep.path);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("parameters   198.272T (198272000049408)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("blocks       1000000000 x GPTBlock in 'transformer.h'"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("graph        not traced: gpt n_layer 1000000000 would make a graph of "
                          "71.000B vertices"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(std::regex_search(r.output, std::regex(" -[0-9]"))) << "negative: " << r.output;
}

// The summary from the estimate is the full trace's, line for line.
TEST(AccTraceCli, EstimatedSummaryEqualsTheTracedOne) {
  const std::string root = std::string(ACC_SOURCE_DIR) + "/examples/configs/";
  for (const std::string& args :
       {"--config " + root + "gpt_small.json --batch-size 4",
        "--config " + root + "gpt_small.json --recompute block --recompute-blocks 2",
        "--model llama --config " + root + "llama_small.json --bf16-activations"}) {
    const Result full = run(args);
    const Result est = run(args + " --max-vertices 10");
    ASSERT_EQ(full.exit_code, 0) << full.output;
    ASSERT_EQ(est.exit_code, 0) << est.output;
    EXPECT_NE(est.output.find("graph        not traced"), std::string::npos) << est.output;
    // model, parameters, FLOPs/step and memory: the first four lines.
    auto head = [](const std::string& out) {
      size_t pos = 0;
      for (int i = 0; i < 4 && pos != std::string::npos; ++i) pos = out.find('\n', pos + 1);
      return out.substr(0, pos);
    };
    EXPECT_EQ(head(est.output), head(full.output)) << args;
  }
}

TEST(AccTraceCli, WritesTheJsonAndDotItIsAskedFor) {
  const std::string config = std::string(ACC_SOURCE_DIR) + "/examples/configs/gpt_small.json";
  const auto dir =
      std::filesystem::temp_directory_path() / ("acc_trace_cli_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const Result r = run("--config " + config + " --json " + (dir / "t.json").string() + " --dot " +
                       (dir / "t.dot").string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_GT(std::filesystem::file_size(dir / "t.json"), 1000u);
  EXPECT_GT(std::filesystem::file_size(dir / "t.dot"), 1000u);
  std::filesystem::remove_all(dir);
}

}  // namespace
