// acc-search end to end, and the cache it writes used by train_gpt --strategy: planned without MPI
// (--plan-only --world N), searched under mpirun with dry-runs, then trained from, re-planned for
// another world, searched again or refused when stale. Bad flags exit 2 naming the value.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "acc/search/cache.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/util/json.hpp"
#include "command.hpp"

namespace acc {
namespace {

namespace fs = std::filesystem;
using test::run_command;

class AccSearch : public ::testing::Test {
 protected:
  static inline fs::path dir;
  static void SetUpTestSuite() {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);  // as scripts/setup.sh, for a run outside CTest
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
    dir = fs::temp_directory_path() / ("acc-search-cli-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    std::ofstream(dir / "gpt.json")
        << R"({"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "block_size": 32})";
    std::ofstream text(dir / "text.txt");
    for (int i = 0; i < 200; ++i)
      text << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir); }

  static std::string search(const std::string& flags) {
    return std::string(ACC_SEARCH_BIN) + " --config " + (dir / "gpt.json").string() +
           " --cache-dir " + (dir / "calibration").string() + " " + flags;
  }
  static std::string mpirun(int np) {
    return std::string(MPIEXEC_BIN) + " --oversubscribe -np " + std::to_string(np) + " ";
  }
  static std::string train(const std::string& flags) {
    return std::string(TRAIN_GPT_BIN) + " --config " + (dir / "gpt.json").string() + " --data " +
           (dir / "text.txt").string() + " --data-format text --seq-len 16 --steps 2 " + flags;
  }
  static search::StrategyCache read_cache(const fs::path& p) {
    return search::StrategyCache::from_json(read_json_file(p.string(), "test"), p.string());
  }
};

TEST_F(AccSearch, PlanOnlyWritesACacheForTheWorldAskedWithoutMpi) {
  const fs::path out = dir / "plan4.json";
  const auto r = run_command(search("--plan-only --world 4 --global-batch 8 --seq-len 16 --out " +
                                    out.string() + " --report " + (dir / "plan4").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("planned for 4 rank(s)"), std::string::npos) << r.output;
  const auto cache = read_cache(out);
  EXPECT_EQ(cache.key.world, 4);
  EXPECT_EQ(cache.key.global_batch, 8);
  EXPECT_TRUE(cache.measured.empty());
  EXPECT_TRUE(fs::is_regular_file(dir / "plan4" / "report.html"));
}

TEST_F(AccSearch, SearchUnderMpirunThenTrainGptUsesTheCacheOrSaysWhyNot) {
  const fs::path out = dir / "np2.json";
  const auto s = run_command(mpirun(2) + search("--global-batch 8 --seq-len 16 --top-k 2 "
                                                "--measured-steps 1 --out " +
                                                out.string()));
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const auto cache = read_cache(out);
  EXPECT_EQ(cache.key.world, 2);
  EXPECT_EQ(cache.measured.at("status"), "ok");

  // The same run: the cache is used as it is (no search), and training goes on with it.
  const auto used = run_command(mpirun(2) + train("--batch-size 4 --strategy " + out.string()));
  ASSERT_EQ(used.exit_code, 0) << used.output;
  EXPECT_NE(used.output.find("strategy from strategy cache"), std::string::npos) << used.output;
  EXPECT_EQ(used.output.find("dry-run"), std::string::npos) << used.output;

  // One rank: re-planned for the new world, no search.
  const auto moved = run_command(train("--batch-size 8 --strategy " + out.string()));
  ASSERT_EQ(moved.exit_code, 0) << moved.output;
  EXPECT_NE(moved.output.find("re-planned for 1"), std::string::npos) << moved.output;

  // Another global batch: named, then refused when asked.
  const auto refused = run_command(mpirun(2) + train("--batch-size 2 --on-stale refuse "
                                                     "--strategy " +
                                                     out.string()));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("key.global_batch: 8 in the cache, 4 in this run"),
            std::string::npos)
      << refused.output;
}

// Issue 34: a plan for a cluster not at hand, searched or pinned, with its throughput figures.
TEST_F(AccSearch, PlanOnlyForAClusterProfileSearchedOrPinned) {
  const std::string selene = std::string(ACC_PROFILES_DIR) + "/a100-selene.json";
  const fs::path out = dir / "cluster.json";
  const std::string base = "--plan-only --cluster " + selene +
                           " --world 16 --global-batch 32 --seq-len 32 --allow-bf16 --out " +
                           out.string();
  auto r = run_command(search(base + " --report " + (dir / "cluster").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("on A100-80GB SXM"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("MFU"), std::string::npos) << r.output;
  auto cache = read_cache(out);
  EXPECT_EQ(cache.key.world, 16);
  EXPECT_GT(cache.predicted.at("model_tflops_per_device").get<double>(), 0) << cache.predicted;
  EXPECT_GT(cache.predicted.at("time").at("step_s").get<double>(), 0) << cache.predicted;
  EXPECT_TRUE(fs::is_regular_file(dir / "cluster" / "report.html"));
  // The heap in huge pages (search/huge_page_heap.cpp) changes the speed, not the plan: without
  // it (ACC_HUGE_PAGES=0) the same strategy and predictions.
  const fs::path plain = dir / "cluster-4k-pages.json";
  r = run_command("ACC_HUGE_PAGES=0 " +
                  search("--plan-only --cluster " + selene +
                         " --world 16 --global-batch 32 --seq-len 32 --allow-bf16 --out " +
                         plain.string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto without = read_cache(plain);
  EXPECT_EQ(strategies::to_json(without.strategy), strategies::to_json(cache.strategy));
  EXPECT_EQ(without.predicted, cache.predicted);
  // Pinned: that strategy, whatever the search would choose.
  const std::string pinned =
      R"([{"name":"tensor_parallel","config":{"size":2}},{"name":"grad_accum","config":{"steps":2}},{"name":"amp"},{"name":"ddp"}])";
  r = run_command(search(base + " --strategy '" + pinned + "'"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  cache = read_cache(out);
  EXPECT_EQ(strategies::to_json(cache.strategy),
            strategies::to_json(strategies::parse_strategy(nlohmann::json::parse(pinned))));
  EXPECT_EQ(cache.micro_batch, 2);  // 32 samples over dp 8, in 2 micro-batches
  // The job's optimizer: SGD with momentum keeps half of AdamW's state.
  const int64_t adamw_state = cache.predicted.at("memory").at("optimizer_state");
  r = run_command(search(base + " --strategy '" + pinned + "' --optimizer sgd_momentum"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  cache = read_cache(out);
  EXPECT_EQ(cache.predicted.at("memory").at("optimizer_state").get<int64_t>() * 2, adamw_state);
  // Bad input: named, nothing written.
  fs::remove(out);
  struct Case {
    std::string flags;
    int exit_code;
    std::string words;
  };
  for (const Case& c : std::vector<Case>{
           {base + " --strategy '[{\"name\":\"tensor_parallel\",\"config\":{\"size\":3}}]'", 1,
            "tp 3"},
           {"--plan-only --world 16 --global-batch 32 --seq-len 32 --out " + out.string() +
                " --strategy '[]'",
            2, "--strategy requires --cluster"},
           {"--plan-only --world 16 --global-batch 32 --seq-len 32 --out " + out.string() +
                " --cluster /nonexistent/profile.json",
            1, "/nonexistent/profile.json"},
           {base + " --optimizer lion", 2, "lion"},
       }) {
    r = run_command(search(c.flags));
    SCOPED_TRACE(c.flags + "\n" + r.output);
    EXPECT_EQ(r.exit_code, c.exit_code);
    EXPECT_NE(r.output.find(c.words), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(out)) << "a refused run wrote its output";
}

TEST_F(AccSearch, BadFlagsAndBudgetsAreNamed) {
  struct Case {
    std::string flags;
    int exit_code;
    std::string words;
  };
  const std::string base = "--global-batch 8 --seq-len 16 --out " + (dir / "x.json").string();
  for (const Case& c : std::vector<Case>{
           {"--plan-only --world 2 --mem-per-rank 12XB " + base, 2, "12XB"},
           {"--plan-only --world 2 --mem-per-rank -1GiB " + base, 2, "-1GiB"},
           {"--plan-only --world 2 --mem-per-rank 1KiB " + base, 1,
            "no candidate fits the memory budget of 1.00 KiB per rank"},
           // Issue 29: a bad command line exits 2 (it was 1, after reading the config).
           {"--plan-only " + base, 2, "--plan-only requires --world"},
           {"--model bert --plan-only --world 2 " + base, 2, "--model: bert not in {gpt,llama}"},
           // Issue 29: two methods of one exclusive slot used to mean "either".
           {"--plan-only --world 2 --include ddp zero2 " + base, 1,
            "included methods 'ddp' and 'zero2' both fill the slot"},
           {"--plan-only --world 3 " + base, 1, "global batch 8 does not split evenly over 3"},
           {"--plan-only --world 2 --exclude expert_parallel " + base, 1,
            "unknown method 'expert_parallel' in excluded"},
           {"--plan-only --world 2 --top-k 0 " + base, 2, "--top-k"},
           {"--plan-only --world 2 --global-batch 8 --seq-len 16 --out /nonexistent/dir/x.json", 1,
            "/nonexistent/dir/x.json"},
       }) {
    const auto r = run_command(search(c.flags));
    SCOPED_TRACE(c.flags + "\n" + r.output);
    EXPECT_EQ(r.exit_code, c.exit_code);
    EXPECT_NE(r.output.find(c.words), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(dir / "x.json")) << "a refused run wrote its output";
}

// Issue 29: the cache's "name" went into logs and stale-cache messages as written; it is derived
// from the strategy now, whatever the file says.
TEST_F(AccSearch, ACacheIsNamedByItsStrategyNotByItsNameField) {
  const fs::path out = dir / "named.json";
  const auto p = run_command(
      search("--plan-only --world 1 --global-batch 4 --seq-len 16 --out " + out.string()));
  ASSERT_EQ(p.exit_code, 0) << p.output;
  nlohmann::json j = read_json_file(out.string(), "test");
  const std::string real = read_cache(out).name;
  j["name"] = "fsdp + tensor_parallel{size:8}";
  std::ofstream(out) << j.dump();
  EXPECT_EQ(read_cache(out).name, real);
  const auto used = run_command(train("--batch-size 4 --strategy " + out.string()));
  ASSERT_EQ(used.exit_code, 0) << used.output;
  EXPECT_NE(used.output.find("strategy cache '" + out.string() + "': " + real), std::string::npos)
      << used.output;
  EXPECT_EQ(used.output.find("tensor_parallel"), std::string::npos) << used.output;
}

}  // namespace
}  // namespace acc
