// auto_accelerate end to end at whatever world size mpirun gives (CTest: 1 and 2 ranks): the
// choice is made on every rank alike, leaves the user's model and RNG untouched, trains exactly
// as the chosen strategy applied by hand, respects the memory budget, and refuses bad options.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "acc/accelerate.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/search/dry_run.hpp"
#include "acc/search/space.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json.hpp"
#include "acc/util/timer.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

const nlohmann::json kConfig = {
    {"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 64}, {"block_size", 32}};

data::Batch batch_for(int step, int64_t b, int64_t t) {
  std::vector<int64_t> idx(static_cast<size_t>(b * t)), tgt(idx.size());
  const auto rank = static_cast<size_t>(dist::rank());
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = static_cast<int64_t>((i * 7 + static_cast<size_t>(step) * 13 + rank * 29) % 64);
    tgt[i] = static_cast<int64_t>((i * 11 + static_cast<size_t>(step) * 5 + rank * 3) % 64);
  }
  return {from_vector(idx, {b, t}), from_vector(tgt, {b, t})};
}

AccelerateOptions small_options() {
  AccelerateOptions o;
  o.global_batch = 8;
  o.seq_len = 16;
  o.top_k = 2;
  o.measured_steps = 1;
  o.verbose = false;
  o.cache_dir = (std::filesystem::temp_directory_path() / "acc-auto-test-cache").string();
  return o;
}

TEST(AutoAccelerate, ChoosesAlikeAndTrainsAsTheChoiceAppliedByHand) {
  const int W = dist::world_size();
  const int64_t b = 8 / W;
  manual_seed(7);
  auto model = models::create_model("gpt", kConfig);
  manual_seed(7);
  auto twin = models::create_model("gpt", kConfig);
  // The search must not draw from the default generator.
  manual_seed(99);
  const uint64_t control = default_generator().next_u64();
  manual_seed(99);
  const auto factory = optim::AdamW::factory({.lr = 1e-2});
  AccelerateOptions o = small_options();
  AccelerateResult r = auto_accelerate(model, factory, o);
  EXPECT_EQ(default_generator().next_u64(), control) << "auto_accelerate touched the RNG";

  // The report: one row per candidate, the chosen one measured.
  const auto& rows = r.report.at("candidates");
  ASSERT_GT(rows.size(), 0u);
  int chosen = 0, measured = 0;
  for (const auto& row : rows) {
    chosen += row.contains("chosen");
    measured += row.contains("measured");
  }
  EXPECT_EQ(chosen, 1);
  EXPECT_EQ(measured, std::min<int>(o.top_k, static_cast<int>(rows.size())));
  EXPECT_EQ(r.report.at("chosen"), strategies::to_json(r.strategy));

  auto by_hand = strategies::apply(twin, factory, r.strategy, {});
  for (int step = 0; step < 3; ++step) {
    const data::Batch batch = batch_for(step, b, 16);
    EXPECT_EQ(r.train_step(batch), by_hand->train_step(batch)) << "step " << step;
  }
  // The plain loop on the result trains on alike (bitwise: train_step is that loop).
  const int k = r.grad_accum_steps();
  for (int step = 3; step < 5; ++step) {
    const data::Batch batch = batch_for(step, b, 16);
    const int64_t mb = b / k;
    for (int i = 0; i < k; ++i) {
      Tensor l = r.loss(batch.idx().narrow(0, i * mb, mb), batch.targets().narrow(0, i * mb, mb));
      (k > 1 ? scale(l, 1.0 / k) : l).backward();
    }
    r.step();
    by_hand->train_step(batch);
  }
  const auto mine = r.trainer->full_parameters(), theirs = by_hand->full_parameters();
  ASSERT_EQ(mine.size(), theirs.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_EQ(mine[i].second.to_vector<float>(), theirs[i].second.to_vector<float>())
        << mine[i].first;
  }
}

TEST(AutoAccelerate, BudgetsAndBadOptionsAreClearErrors) {
  auto model = models::create_model("gpt", kConfig);
  const auto factory = optim::AdamW::factory({.lr = 1e-2});
  auto error_of = [&](const AccelerateOptions& o) {
    return test::error_of<ValueError>([&] { auto_accelerate(model, factory, o); });
  };
  AccelerateOptions tiny = small_options();
  tiny.mem_per_rank = 1000;
  const std::string msg = error_of(tiny);
  EXPECT_NE(msg.find("no candidate fits the memory budget of 1000.00 B per rank (1000 bytes); the "
                     "smallest predicted need is"),
            std::string::npos)
      << msg;
  AccelerateOptions neg = small_options();
  neg.mem_per_rank = -5;
  EXPECT_EQ(error_of(neg), "auto_accelerate: mem_per_rank must be >= 0 bytes, got -5");
  AccelerateOptions unknown = small_options();
  unknown.excluded = {"expert_parallel"};
  EXPECT_NE(error_of(unknown).find("unknown method 'expert_parallel' in excluded"),
            std::string::npos);
  AccelerateOptions odd = small_options();
  odd.global_batch = 7;
  if (dist::world_size() > 1) {
    EXPECT_NE(error_of(odd).find("global batch 7 does not split evenly"), std::string::npos);
  }
  // A budget between the candidates' peaks: the choice fits and its measured peak is under it.
  AccelerateOptions mid = small_options();
  AccelerateResult all = auto_accelerate(models::create_model("gpt", kConfig), factory, mid);
  std::vector<int64_t> peaks;
  for (const auto& row : all.report.at("candidates")) {
    peaks.push_back(row.at("predicted").at("memory").at("peak").get<int64_t>());
  }
  std::sort(peaks.begin(), peaks.end());
  mid.mem_per_rank = peaks[peaks.size() / 2];
  AccelerateResult fit = auto_accelerate(models::create_model("gpt", kConfig), factory, mid);
  for (const auto& row : fit.report.at("candidates")) {
    if (!row.contains("chosen")) continue;
    EXPECT_LE(row.at("predicted").at("memory").at("peak").get<int64_t>(), mid.mem_per_rank);
    EXPECT_LE(row.at("measured").at("peak_bytes").get<int64_t>(), mid.mem_per_rank);
  }
}

// The directory every rank of this job names alike (rank 0 writes into it).
std::filesystem::path job_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("acc-auto-" + name + "-np" + std::to_string(dist::world_size()));
  if (dist::rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  dist::ProcessGroup::world()->barrier()->wait();
  return dir;
}

std::vector<double> train(AccelerateResult& r, int steps) {
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    losses.push_back(r.train_step(batch_for(step, 8 / dist::world_size(), 16)));
  }
  return losses;
}

TEST(AutoAccelerate, ASavedCacheSkipsTheSearchAndTrainsAsTheSearchedChoice) {
  const auto dir = job_dir("cache");
  const auto factory = optim::AdamW::factory({.lr = 1e-2});
  AccelerateOptions o = small_options();
  o.save_strategy_to = (dir / "strategy.json").string();
  o.report_dir = (dir / "report").string();
  manual_seed(3);
  AccelerateResult searched = auto_accelerate(models::create_model("gpt", kConfig), factory, o);
  EXPECT_EQ(searched.report.at("source"), "search");
  if (dist::rank() == 0) {
    for (const char* f : {"strategy.json", "report/report.json", "report/report.html"}) {
      EXPECT_TRUE(std::filesystem::is_regular_file(dir / f)) << f;
    }
  }

  AccelerateOptions load = small_options();
  load.load_strategy = o.save_strategy_to;
  manual_seed(3);
  AccelerateResult cached = auto_accelerate(models::create_model("gpt", kConfig), factory, load);
  EXPECT_EQ(cached.report.at("source"), "cache");
  EXPECT_EQ(cached.report.at("dry_runs"), 0);
  for (const auto& row : cached.report.at("candidates")) EXPECT_FALSE(row.contains("measured"));
  EXPECT_EQ(strategies::to_json(cached.strategy), strategies::to_json(searched.strategy));
  EXPECT_EQ(train(cached, 3), train(searched, 3));
}

TEST(AutoAccelerate, AStaleCacheIsNamedByFieldAndSearchedAgainOrRefused) {
  const auto dir = job_dir("stale");
  const auto factory = optim::AdamW::factory({.lr = 1e-2});
  AccelerateOptions o = small_options();
  o.save_strategy_to = (dir / "strategy.json").string();
  auto model = models::create_model("gpt", kConfig);
  auto_accelerate(model, factory, o);
  // Every rank reads the file rank 0 wrote (the barrier of job_dir's kind is the search's end).
  nlohmann::json cache = read_json_file(o.save_strategy_to, "test");

  // Another model: searched again, the field named; refused when asked.
  nlohmann::json other = cache;
  other["key"]["trace_hash"] = "0000000000000000";
  AccelerateOptions load = small_options();
  load.load_strategy = other.dump();
  AccelerateResult again = auto_accelerate(models::create_model("gpt", kConfig), factory, load);
  EXPECT_EQ(again.report.at("source"), "search");
  EXPECT_NE(again.report.at("note").get<std::string>().find(
                "key.trace_hash: 0000000000000000 in the cache, "),
            std::string::npos)
      << again.report.at("note");
  load.on_stale = AccelerateOptions::OnStale::kRefuse;
  const std::string refused = test::error_of<ValueError>(
      [&] { auto_accelerate(models::create_model("gpt", kConfig), factory, load); });
  EXPECT_NE(refused.find("does not match this run (key.trace_hash: 0000000000000000 in the cache"),
            std::string::npos)
      << refused;

  // Only the world differs: re-planned for this world, no search.
  nlohmann::json moved = cache;
  moved["key"]["world"] = dist::world_size() == 1 ? 2 : 1;
  moved["micro_batch"] = 1;
  load = small_options();
  load.load_strategy = moved.dump();
  AccelerateResult replanned = auto_accelerate(models::create_model("gpt", kConfig), factory, load);
  EXPECT_EQ(replanned.report.at("source"), "replanned");
  EXPECT_EQ(replanned.report.at("dry_runs"), 0);
  EXPECT_NE(replanned.report.at("note").get<std::string>().find("re-planned for"),
            std::string::npos);
}

TEST(AutoAccelerate, ACorruptCacheIsAnErrorNamingTheFieldAndNothingIsApplied) {
  const auto factory = optim::AdamW::factory({.lr = 1e-2});
  manual_seed(5);
  auto model = models::create_model("gpt", kConfig);
  manual_seed(5);
  auto twin = models::create_model("gpt", kConfig);
  struct Case {
    std::string cache, words;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"format": "autoacc-strategy", "version": 1})", "field 'strategy' is missing"},
           {R"({"format": "autoacc-strategy", "version": 7, "strategy": []})",
            "field 'version' is 7, newer than this build reads (1)"},
           {R"({"format": "autoacc-strategy", "version": 1, "strategy": [{"name": "warp"}],
                "name": "x", "micro_batch": 1, "key": {}, "predicted": {}, "measured": {}})",
            "field 'strategy'"},
           {R"({"format": "autoacc-strategy", )", "strategy"},
       }) {
    AccelerateOptions load = small_options();
    load.load_strategy = c.cache;
    const std::string msg =
        test::error_of<ValueError>([&] { auto_accelerate(model, factory, load); });
    EXPECT_NE(msg.find(c.words), std::string::npos) << msg;
  }
  AccelerateOptions missing = small_options();
  missing.load_strategy = "/nonexistent/strategy.json";
  EXPECT_NE(test::error_of<IoError>([&] {
              auto_accelerate(model, factory, missing);
            }).find("/nonexistent/strategy.json"),
            std::string::npos);
  // The model is as it was: same parameters, bitwise, and it trains as its twin.
  auto a = model->named_parameters();
  auto b = twin->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].second.to_vector<float>(), b[i].second.to_vector<float>()) << a[i].first;
  }
}

// A candidate that fails on one rank fails on every rank within seconds (not the job's collective
// timeout), with the failed rank's message, and the next candidate runs as if nothing happened.
TEST(DryRun, AFailureOnOneRankReachesEveryRankInSecondsAndLeavesNothingBehind) {
  const int W = dist::world_size();
  if (W < 2) GTEST_SKIP() << "needs 2 ranks";
  auto model = models::create_model("gpt", kConfig);
  const auto factory = optim::AdamW::factory({.lr = 1e-2});
  search::SpaceOptions so;
  so.world = W;
  so.global_batch = 8;
  so.seq_len = 16;
  so.excluded = {"amp", "checkpoint", "grad_accum"};
  const auto candidates = search::enumerate_candidates(so, 2);
  const auto ddp = std::find_if(candidates.begin(), candidates.end(), [](const auto& c) {
    return c.strategy().size() == 1 && c.strategy()[0].name == "ddp";
  });
  ASSERT_NE(ddp, candidates.end());
  const data::Batch batch = batch_for(0, 8 / W, 16);
  auto group = dist::ProcessGroup::world();
  search::DryRunOptions opts{.warmup_steps = 1, .measured_steps = 2};
  opts.collective_timeout = std::chrono::seconds(3);
  const auto before = search::dry_run(*model, factory, *ddp, batch, group, opts);
  ASSERT_EQ(before.status, search::Status::kOk) << before.error;

  // Rank 1 runs out of memory (a budget far below the model's state); rank 0 waits for it in a
  // collective it never joins.
  search::DryRunOptions starved = opts;
  if (dist::rank() == 1) starved.memory_budget = 4096;
  Timer t;
  const auto failed = search::dry_run(*model, factory, *ddp, batch, group, starved);
  const double seconds = t.elapsed_s();
  EXPECT_EQ(failed.status, search::Status::kOom);
  EXPECT_NE(failed.error.find("rank 1: out of memory"), std::string::npos) << failed.error;
  EXPECT_LT(seconds, 3 + 5.0) << "the failure took " << seconds << " s to reach rank "
                              << dist::rank();

  const auto after = search::dry_run(*model, factory, *ddp, batch, group, opts);
  ASSERT_EQ(after.status, search::Status::kOk) << after.error;
  EXPECT_EQ(after.losses, before.losses);
}

}  // namespace
}  // namespace acc
