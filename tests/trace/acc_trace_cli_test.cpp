// acc-trace's refusals: each case runs the tool and expects a non-zero exit and a message naming
// the bad value, before any tracing work (no summary printed).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace {

struct Result {
  int exit_code;
  std::string output;
};

Result run(const std::string& args) {
  const std::string cmd = std::string(ACC_TRACE_BIN) + " " + args + " 2>&1";
  Result r{0, ""};
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  while (fgets(buf, sizeof(buf), p)) r.output += buf;
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(AccTraceCli, BadArgumentsAreRefusedNamingTheValue) {
  const std::string config = std::string(ACC_SOURCE_DIR) + "/examples/configs/gpt_small.json";
  const std::string tmp = std::filesystem::temp_directory_path().string();
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
      {"--recompute-blocks -3", "--recompute-blocks must be >= 0 or -1 (all), got -3"},
  };
  for (const auto& c : cases) {
    const Result r = run("--config " + config + " " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("FLOPs/step"), std::string::npos) << c.args << ": traced anyway";
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
