// A model of the user's own (examples/custom_model.hpp: a residual-MLP classifier with its own
// loss on synthetic data, no language model anywhere) under every strategy and auto_accelerate, at
// whatever world size mpirun gives (CTest: 1, 2 and 4 ranks).
//
// Tolerances as tests/strategies/equivalence_test.cpp states them: fp32 losses within 1e-5
// relative of one process with the same global batch, final parameters within 2e-5 + 1e-4 |p|;
// amp against amp on one rank: losses within bf16's unit roundoff u = 2^-8 relative, each
// parameter tensor within S (N + 1) u of how far training moved it (2-norm).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "../../examples/custom_model.hpp"
#include "acc/accelerate.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/dist/dist.hpp"
#include "acc/optim/adam.hpp"
#include "acc/search/dry_run.hpp"
#include "acc/search/space.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"
#include "plain_loop.hpp"

namespace acc {
namespace {

constexpr int64_t kGlobalBatch = 8, kSteps = 8;
constexpr uint64_t kDataSeed = 3;
constexpr double kBf16UnitRoundoff = 1.0 / 256;

custom::NetConfig net_config(int64_t layers = 3) {
  return {.features = 16, .width = 32, .hidden = 64, .layers = layers, .classes = 4};
}

std::shared_ptr<custom::Net> make_net(int64_t layers = 3) {
  Generator gen(11);
  return std::make_shared<custom::Net>(net_config(layers), gen);
}

dist::ProcessGroupPtr self_group() {
  static dist::ProcessGroupPtr g = [] {
    auto w = dist::ProcessGroup::world();
    return w->split(w->rank(), 0, "self");
  }();
  return g;
}

struct TrainRun {
  int world = 1;
  std::vector<double> losses;
  std::vector<std::pair<std::string, Tensor>> params;
};

// `plain`: the plain loop (Trainer::loss on each micro-batch, backward, step) instead of
// train_step, its loss averaged over the ranks as train_step's is.
TrainRun train(const std::string& strategy_json, const dist::ProcessGroupPtr& group,
               bool plain = false, int64_t layers = 3) {
  auto model = make_net(layers);
  auto trainer =
      strategies::apply(model, optim::AdamW::factory({.lr = 1e-2, .weight_decay = 0.1}),
                        strategies::parse_strategy(nlohmann::json::parse(strategy_json)),
                        {.group = group, .grad_clip = 1.0, .loss = custom::classification_loss});
  custom::SyntheticLoader loader(
      {.rank = group->rank(), .ranks = group->size(), .global_batch = kGlobalBatch},
      net_config(layers), kDataSeed);
  TrainRun r;
  r.world = group->size();
  for (int64_t s = 0; s < kSteps; ++s) {
    const data::Batch b = loader.next();
    if (!plain) {
      r.losses.push_back(trainer->train_step(b));
      continue;
    }
    r.losses.push_back(test::plain_loop_step(*trainer, b, *group));
  }
  r.params = trainer->full_parameters();
  return r;
}

double norm2(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t k = 0; k < a.size(); ++k) s += (a[k] - b[k]) * (a[k] - b[k]);
  return std::sqrt(s);
}

struct Case {
  std::string name;
  std::string strategy;
  std::string reference;  // the one-process strategy it must equal ("" : none)
  bool amp = false;
  int64_t layers = 3;
};

class CustomModel : public testing::TestWithParam<Case> {};

TEST_P(CustomModel, TrainsAsOneProcess) {
  const Case& c = GetParam();
  const TrainRun ref = train(c.amp ? c.strategy : c.reference, self_group(), false, c.layers);
  const TrainRun got = train(c.strategy, dist::ProcessGroup::world(), false, c.layers);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  EXPECT_LT(ref.losses.back(), ref.losses.front()) << "it trains";
  const double rtol = c.amp ? kBf16UnitRoundoff : 1e-5;
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_LE(std::abs(got.losses[s] - ref.losses[s]), rtol * std::abs(ref.losses[s]))
        << c.name << " step " << s << ": " << got.losses[s] << " vs " << ref.losses[s];
  }
  const auto initial = make_net(c.layers)->named_parameters();
  ASSERT_EQ(got.params.size(), ref.params.size());
  ASSERT_EQ(initial.size(), ref.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i) {
    ASSERT_EQ(got.params[i].first, ref.params[i].first);
    const auto a = got.params[i].second.to_vector<double>();
    const auto b = ref.params[i].second.to_vector<double>();
    ASSERT_EQ(a.size(), b.size());
    if (c.amp) {
      const double moved = norm2(b, initial[i].second.to_vector<double>());
      ASSERT_GT(moved, 0) << c.name << " " << ref.params[i].first << " did not train";
      EXPECT_LE(norm2(a, b), kSteps * (got.world + 1) * kBf16UnitRoundoff * moved)
          << c.name << " " << ref.params[i].first;
      continue;
    }
    for (size_t k = 0; k < a.size(); ++k) {
      ASSERT_LE(std::abs(a[k] - b[k]), 2e-5 + 1e-4 * std::abs(b[k]))
          << c.name << " " << ref.params[i].first << "[" << k << "]: " << a[k] << " vs " << b[k];
    }
  }
}

// The plain loop is what train_step runs: bitwise the same losses and parameters.
TEST_P(CustomModel, PlainLoopTrainsAsTrainStep) {
  const Case& c = GetParam();
  const TrainRun step = train(c.strategy, dist::ProcessGroup::world(), false, c.layers);
  const TrainRun plain = train(c.strategy, dist::ProcessGroup::world(), true, c.layers);
  EXPECT_EQ(plain.losses, step.losses) << c.name;
  ASSERT_EQ(plain.params.size(), step.params.size());
  for (size_t i = 0; i < step.params.size(); ++i) {
    EXPECT_EQ(plain.params[i].second.to_vector<float>(), step.params[i].second.to_vector<float>())
        << c.name << " " << step.params[i].first;
  }
}

const char* kAccum = R"({"name": "grad_accum", "config": {"steps": 2}})";

std::string with(const std::string& a, const std::string& b = "") {
  return "[" + a + (b.empty() ? "" : ", " + b) + "]";
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, CustomModel,
    testing::Values(
        Case{"ddp", with(R"({"name": "ddp"})"), "[]"},
        Case{"ddp_accum", with(R"({"name": "ddp"})", kAccum), with(kAccum)},
        Case{"zero1", with(R"({"name": "zero1", "config": {"bucket_mb": 0.01}})"), "[]"},
        Case{"zero2", with(R"({"name": "zero2", "config": {"bucket_mb": 0.01}})"), "[]"},
        Case{"zero2_accum", with(R"({"name": "zero2"})", kAccum), with(kAccum)},
        // Units found (the repeated ResidualBlocks), named as a list, named one by one.
        Case{"fsdp", with(R"({"name": "fsdp"})"), "[]"},
        Case{"fsdp_units_list", with(R"({"name": "fsdp", "config": {"units": ["blocks"]}})"), "[]"},
        Case{"fsdp_units_named",
             with(R"({"name": "fsdp", "config": {"units": ["input", "blocks.0", "blocks.2"]}})"),
             "[]"},
        Case{"fsdp_accum", with(R"({"name": "fsdp"})", kAccum), with(kAccum)},
        // No repeated blocks: the model is one unit.
        Case{"fsdp_one_unit", with(R"({"name": "fsdp"})"), "[]", false, 0},
        Case{"ddp_checkpoint", with(R"({"name": "ddp"})", R"({"name": "checkpoint"})"), "[]"},
        Case{"fsdp_checkpoint_units",
             with(R"({"name": "fsdp"})",
                  R"({"name": "checkpoint", "config": {"units": ["blocks.1", "head"]}})"),
             "[]"},
        Case{"ddp_amp", with(R"({"name": "ddp"})", R"({"name": "amp"})"), "", true},
        Case{"fsdp_amp", with(R"({"name": "fsdp"})", R"({"name": "amp"})"), "", true},
        Case{
            "zero2_amp_accum",
            R"([{"name": "zero2"}, {"name": "amp"}, {"name": "grad_accum", "config": {"steps": 2}}])",
            "", true}),
    [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

// ---- bad input: a clear error naming the value, nothing applied ----

// The model's parameters, bitwise, and whether it trains as a fresh one does afterwards.
void expect_untouched(const std::shared_ptr<custom::Net>& model) {
  const auto fresh = make_net()->named_parameters();
  const auto now = model->named_parameters();
  ASSERT_EQ(now.size(), fresh.size());
  for (size_t i = 0; i < now.size(); ++i) {
    EXPECT_EQ(now[i].second.to_vector<float>(), fresh[i].second.to_vector<float>()) << now[i].first;
    EXPECT_FALSE(now[i].second.grad().defined()) << now[i].first;
  }
  // No wrapper or hook left: a plain forward/backward works and matches a fresh model's loss.
  const data::Batch b = custom::synthetic_batch({0, 1, 2, 3}, net_config(), kDataSeed);
  EXPECT_EQ(custom::classification_loss(*model, b).item(),
            custom::classification_loss(*make_net(), b).item());
}

TEST(CustomModelErrors, UnitsThatNameNoModuleAreRefusedByName) {
  if (dist::world_size() < 2) GTEST_SKIP() << "fsdp needs ranks";
  auto model = make_net();
  const std::string e = test::error_of<Error>([&] {
    strategies::apply(model, optim::AdamW::factory({}),
                      strategies::parse_strategy(nlohmann::json::parse(
                          R"([{"name": "fsdp", "config": {"units": ["blocks.7"]}}])")),
                      {.loss = custom::classification_loss});
  });
  EXPECT_NE(e.find("unit 'blocks.7' names no module"), std::string::npos) << e;
  EXPECT_NE(e.find("'blocks' has no '7' (it has 0, 1, 2)"), std::string::npos) << e;
  expect_untouched(model);
}

// Refused before anything changes: with weights that differ by rank, a bad unit leaves each
// rank's own (fsdp would broadcast rank 0's first).
TEST(CustomModelErrors, RefusedUnitsLeaveEveryRanksWeights) {
  if (dist::world_size() < 2) GTEST_SKIP() << "fsdp needs ranks";
  auto model = make_net();
  {
    NoGradGuard ng;
    for (auto& [name, p] : model->named_parameters()) {
      p.add_(full(p.shape(), static_cast<double>(dist::rank())));
    }
  }
  std::vector<std::vector<float>> before;
  for (const auto& [name, p] : model->named_parameters()) before.push_back(p.to_vector<float>());
  EXPECT_THROW(strategies::apply(model, optim::AdamW::factory({}),
                                 strategies::parse_strategy(nlohmann::json::parse(
                                     R"([{"name": "fsdp", "config": {"units": ["nosuch"]}}])")),
                                 {.loss = custom::classification_loss}),
               ValueError);
  const auto after = model->named_parameters();
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].second.to_vector<float>(), before[i]) << after[i].first;
  }
}

// A block instance used twice (ALBERT-style sharing) is one parameter set in two units: refused
// by name rather than sharded twice with one copy trained.
TEST(CustomModelErrors, AParameterSharedBetweenUnitsIsRefusedByName) {
  if (dist::world_size() < 2) GTEST_SKIP() << "fsdp needs ranks";
  auto model = make_net(1);
  model->blocks->push_back((*model->blocks)[0]);  // blocks.1 is blocks.0
  const std::string e = test::error_of<Error>([&] {
    strategies::apply(model, optim::AdamW::factory({}),
                      strategies::parse_strategy(nlohmann::json::parse(
                          R"([{"name": "fsdp", "config": {"units": ["blocks"]}}])")),
                      {.loss = custom::classification_loss});
  });
  EXPECT_NE(e.find("parameter 'blocks.1.norm.weight' of unit 'blocks.1' is also "
                   "'blocks.0.norm.weight'"),
            std::string::npos)
      << e;
}

// A loss that fails once abandons that step only: the next train_step is a fresh trainer's first.
TEST(CustomModelErrors, AFailedLossAbandonsItsStepOnly) {
  auto model = make_net();
  int calls = 0;
  auto trainer = strategies::apply(
      model, optim::AdamW::factory({}), {},
      {.group = self_group(), .loss = [&calls](nn::Module& m, const data::Batch& b) {
         if (calls++ == 0) throw std::runtime_error("the user's loss failed");
         return custom::classification_loss(m, b);
       }});
  const data::Batch b = custom::synthetic_batch({0, 1, 2, 3}, net_config(), kDataSeed);
  EXPECT_THROW(trainer->train_step(b), std::runtime_error);
  auto twin = make_net();
  auto fresh = strategies::apply(twin, optim::AdamW::factory({}), {},
                                 {.group = self_group(), .loss = custom::classification_loss});
  EXPECT_EQ(trainer->train_step(b), fresh->train_step(b));
  EXPECT_EQ(trainer->train_step(b), fresh->train_step(b));
}

TEST(CustomModelErrors, BadUnitsConfigAndUnitlessRecomputationAreRefused) {
  EXPECT_NE(test::error_of<Error>([] {
              strategies::parse_strategy(nlohmann::json::parse(
                  R"([{"name": "checkpoint", "config": {"units": "blocks"}}])"));
            }).find("units must be a non-empty list of module names, got \"blocks\""),
            std::string::npos);
  auto flat = make_net(0);
  const std::string e = test::error_of<Error>([&] {
    strategies::apply(
        flat, optim::AdamW::factory({}),
        strategies::parse_strategy(nlohmann::json::parse(R"([{"name": "checkpoint"}])")),
        {.group = self_group(), .loss = custom::classification_loss});
  });
  EXPECT_NE(e.find("has no repeated blocks to recompute: name its units"), std::string::npos) << e;
  auto model = make_net();
  const std::string overlap = test::error_of<Error>([&] {
    strategies::apply(
        model, optim::AdamW::factory({}),
        strategies::parse_strategy(nlohmann::json::parse(
            R"([{"name": "checkpoint", "config": {"units": ["blocks", "blocks.1"]}}])")),
        {.group = self_group(), .loss = custom::classification_loss});
  });
  EXPECT_NE(overlap.find("unit 'blocks.1' is named twice"), std::string::npos) << overlap;
  expect_untouched(model);
}

TEST(CustomModelErrors, ALossThatIsNotOneNumberIsRefusedWithItsShape) {
  auto model = make_net();
  auto trainer =
      strategies::apply(model, optim::AdamW::factory({}), {},
                        {.group = self_group(),
                         .loss = [](nn::Module& m, const data::Batch& b) { return m(b["x"]); }});
  const data::Batch b = custom::synthetic_batch({0, 1, 2, 3}, net_config(), kDataSeed);
  try {
    trainer->train_step(b);
    FAIL() << "a (4, 4) loss was accepted";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("returned shape [4, 4]"), std::string::npos) << e.what();
  }
}

TEST(CustomModelErrors, ANonLanguageModelWithoutALossIsRefusedByType) {
  const std::string e = test::error_of<Error>([] {
    strategies::apply(make_net(), optim::AdamW::factory({}), {}, {.group = self_group()});
  });
  EXPECT_NE(e.find("the model (Net) is not a language model"), std::string::npos) << e;
}

TEST(CustomModelErrors, BatchesThatDisagreeOrDoNotSplitAreRefusedByName) {
  auto model = make_net();
  auto trainer = strategies::apply(model, optim::AdamW::factory({}),
                                   strategies::parse_strategy(nlohmann::json::parse(with(kAccum))),
                                   {.group = self_group(), .loss = custom::classification_loss});
  const data::Batch good = custom::synthetic_batch({0, 1, 2, 3}, net_config(), kDataSeed);
  const data::Batch disagree({{"x", good["x"]}, {"label", good["label"].narrow(0, 0, 3)}});
  try {
    trainer->train_step(disagree);
    FAIL() << "a batch of 4 inputs and 3 labels was accepted";
  } catch (const ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("x"), std::string::npos) << m;
    EXPECT_NE(m.find("label"), std::string::npos) << m;
    EXPECT_NE(m.find("3"), std::string::npos) << m;
  }
  const data::Batch odd = good.narrow(0, 3);
  const std::string e = test::error_of<Error>([&] { trainer->train_step(odd); });
  EXPECT_NE(e.find("a batch of 3 sample(s) does not split into 2"), std::string::npos) << e;
  // Nothing was applied: the next good step is the first step of a fresh trainer.
  auto twin = make_net();
  auto fresh = strategies::apply(twin, optim::AdamW::factory({}),
                                 strategies::parse_strategy(nlohmann::json::parse(with(kAccum))),
                                 {.group = self_group(), .loss = custom::classification_loss});
  EXPECT_EQ(trainer->train_step(good), fresh->train_step(good));
}

// ---- auto_accelerate on the user's module ----

TEST(CustomModelAccelerate, ReportsEveryCandidateAndAppliesTheFastestMeasured) {
  const int W = dist::world_size();
  auto model = make_net();
  const auto before = model->named_parameters();
  std::vector<std::vector<float>> values;
  for (const auto& [n, p] : before) values.push_back(p.to_vector<float>());
  AccelerateOptions o;
  o.global_batch = kGlobalBatch;
  o.top_k = 2;
  o.measured_steps = 1;
  o.verbose = false;
  o.cache_dir = (std::filesystem::temp_directory_path() / "acc-custom-test-cache").string();
  o.loss = custom::classification_loss;
  const data::Shard shard{.rank = dist::rank(), .ranks = W, .global_batch = kGlobalBatch};
  o.sample_batch = custom::synthetic_batch(shard.sample_indices(0), net_config(), kDataSeed);
  AccelerateResult acc = auto_accelerate(model, optim::AdamW::factory({.lr = 1e-2}), o);
  // The dry-runs left the module as it was (they train it in place and put it back): the model
  // returned is the chosen strategy applied to the user's initial values, as applying it by hand
  // to a fresh copy makes it (a tensor-parallel choice, the fastest on a loaded machine, shards
  // the parameters).
  auto twin = make_net();
  auto by_hand =
      strategies::apply(twin, optim::AdamW::factory({.lr = 1e-2}), acc.strategy,
                        {.loss = custom::classification_loss, .sample_batch = *o.sample_batch});
  const auto after = acc.model->named_parameters();
  const auto applied = twin->named_parameters();
  ASSERT_EQ(after.size(), applied.size()) << acc.report.at("chosen_name");
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].first, applied[i].first);
    EXPECT_EQ(after[i].second.numel(), applied[i].second.numel())
        << after[i].first << " under " << acc.report.at("chosen_name");
  }
  if (strategies::layout_key(acc.strategy).empty()) {  // no shards: the user's own shapes
    ASSERT_EQ(after.size(), values.size());
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_EQ(after[i].second.numel(), static_cast<int64_t>(values[i].size()));
    }
  }
  const nlohmann::json& report = acc.report;
  ASSERT_GE(report.at("candidates").size(), 1u);
  int measured = 0;
  double fastest = 1e300;
  std::string fastest_name, chosen_name;
  for (const auto& c : report.at("candidates")) {
    EXPECT_TRUE(c.contains("predicted")) << c.dump();
    EXPECT_TRUE(c.at("predicted").contains("memory")) << c.dump();
    if (c.contains("measured") && c.at("status") == "ok") {
      ++measured;
      const double s = c.at("measured").at("step_seconds").get<double>();
      if (s < fastest) {
        fastest = s;
        fastest_name = c.at("name");
      }
    }
    if (c.value("chosen", false)) chosen_name = c.at("name");
  }
  EXPECT_GE(measured, 1);
  EXPECT_EQ(chosen_name, fastest_name);
  EXPECT_EQ(report.at("chosen_name"), chosen_name);
  // The shard is this rank's data-parallel coordinate in the chosen layout's mesh.
  const dist::DeviceMesh mesh = strategies::mesh_for(acc.strategy, W);
  EXPECT_EQ(acc.data.ranks, mesh.dp);
  EXPECT_EQ(acc.data.rank, mesh.coordinate_of(dist::rank()).dp);
  EXPECT_EQ(acc.model_hash.size(), 16u);
  // It trains, from the user's own initial values (the search put them back).
  custom::SyntheticLoader loader(acc.data, net_config(), kDataSeed);
  for (int s = 0; s < 3; ++s) {
    const data::Batch b = loader.next();
    EXPECT_EQ(acc.train_step(b), by_hand->train_step(b)) << "step " << s;
  }
}

// A module that is not the registry's cannot be copied: its dry-runs train it in place and put
// parameters, buffers, mode and RNG back, also after a candidate that failed with its parameters
// released (fsdp out of memory on one rank).
TEST(CustomModelAccelerate, DryRunsInPlaceLeaveTheModuleAsItWas) {
  const int W = dist::world_size();
  auto model = make_net();
  const auto initial = make_net()->named_parameters();
  search::SpaceOptions so;
  so.world = W;
  so.global_batch = kGlobalBatch;
  so.seq_len = 1;
  so.excluded = {"amp", "checkpoint", "grad_accum"};
  const auto candidates = search::enumerate_candidates(so, 3);
  const auto fsdp = std::find_if(candidates.begin(), candidates.end(), [&](const auto& c) {
    return c.strategy().size() == (W > 1 ? 1u : 0u) && (W == 1 || c.strategy()[0].name == "fsdp");
  });
  ASSERT_NE(fsdp, candidates.end());
  const data::Shard shard{.rank = dist::rank(), .ranks = W, .global_batch = kGlobalBatch};
  const data::Batch batch = custom::synthetic_batch(shard.sample_indices(0), net_config(), 3);
  const auto factory = optim::AdamW::factory({.lr = 1e-2});
  search::DryRunOptions opts{.warmup_steps = 1, .measured_steps = 2};
  opts.collective_timeout = std::chrono::seconds(3);
  opts.loss = custom::classification_loss;
  manual_seed(42);
  const uint64_t rng_before = default_generator().offset();
  const auto before =
      search::dry_run(*model, factory, *fsdp, batch, dist::ProcessGroup::world(), opts);
  ASSERT_EQ(before.status, search::Status::kOk) << before.error;
  EXPECT_EQ(default_generator().offset(), rng_before);
  auto same_as_initial = [&] {
    const auto now = model->named_parameters();
    ASSERT_EQ(now.size(), initial.size());
    for (size_t i = 0; i < now.size(); ++i) {
      EXPECT_EQ(now[i].second.to_vector<float>(), initial[i].second.to_vector<float>())
          << now[i].first;
      EXPECT_FALSE(now[i].second.grad().defined()) << now[i].first;
    }
  };
  same_as_initial();
  // The last rank runs out of memory in the middle of the candidate.
  search::DryRunOptions starved = opts;
  if (dist::rank() == W - 1) starved.memory_budget = 4096;
  const auto failed =
      search::dry_run(*model, factory, *fsdp, batch, dist::ProcessGroup::world(), starved);
  EXPECT_EQ(failed.status, search::Status::kOom) << failed.error;
  same_as_initial();
  const auto after =
      search::dry_run(*model, factory, *fsdp, batch, dist::ProcessGroup::world(), opts);
  ASSERT_EQ(after.status, search::Status::kOk) << after.error;
  EXPECT_EQ(after.losses, before.losses);
  same_as_initial();
}

TEST(CustomModelAccelerate, MissingSampleBatchOrLossIsNamed) {
  AccelerateOptions o;
  o.global_batch = kGlobalBatch;
  o.verbose = false;
  const std::string e =
      test::error_of<Error>([&] { auto_accelerate(make_net(), optim::AdamW::factory({}), o); });
  EXPECT_NE(e.find("the model (Net) is not a language model of the registry: give "
                   "options.sample_batch"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("options.loss"), std::string::npos) << e;
}

}  // namespace
}  // namespace acc
