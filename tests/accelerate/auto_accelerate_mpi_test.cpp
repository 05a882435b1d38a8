// auto_accelerate end to end at whatever world size mpirun gives (CTest: 1 and 2 ranks): the
// choice is made on every rank alike, leaves the user's model and RNG untouched, trains exactly
// as the chosen strategy applied by hand, respects the memory budget, and refuses bad options.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "acc/accelerate.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
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
  unknown.excluded = {"tensor_parallel"};
  EXPECT_NE(error_of(unknown).find("unknown method 'tensor_parallel' in excluded"),
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

}  // namespace
}  // namespace acc
