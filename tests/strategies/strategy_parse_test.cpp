// Strategy JSON: the format, the registry and the composition rules (no MPI needed).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/search.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

using strategies::parse_strategy;

void expect_error(const nlohmann::json& j, const std::string& needle) {
  try {
    parse_strategy(j);
    FAIL() << "no error for " << j.dump();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "'" << e.what() << "' lacks '" << needle << "'";
  }
}

TEST(Strategy, ParsesEveryMethodAndRoundTrips) {
  auto j = nlohmann::json::parse(R"([
    {"name": "zero2", "config": {"bucket_mb": 4}},
    {"name": "amp"},
    {"name": "grad_accum", "config": {"steps": 4}}])");
  strategies::Strategy s = parse_strategy(j);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].name, "zero2");
  EXPECT_EQ(s[0].config["bucket_mb"], 4);
  EXPECT_TRUE(s[1].config.is_object());
  EXPECT_EQ(parse_strategy(strategies::to_json(s)).size(), 3u);
  for (const char* name : {"ddp", "zero1", "zero2", "fsdp", "amp", "grad_accum"}) {
    auto names = strategies::method_names();
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  EXPECT_TRUE(parse_strategy(nlohmann::json::array()).empty());
  EXPECT_EQ(strategies::parse_strategy_arg(R"([{"name": "ddp"}])").at(0).name, "ddp");
}

TEST(Strategy, BadEntriesNameTheEntryAndTheReason) {
  expect_error(nlohmann::json::object(), "must be a JSON list");
  expect_error(nlohmann::json::parse(R"([{"config": {}}])"), "entry 0 must be an object");
  expect_error(nlohmann::json::parse(R"([{"name": "ddp"}, {"name": "tensor_magic"}])"),
               "entry 1: unknown method 'tensor_magic'");
  expect_error(nlohmann::json::parse(R"([{"name": "ddp", "config": {"bucket": 3}}])"),
               "unknown config key 'bucket'");
  expect_error(nlohmann::json::parse(R"([{"name": "ddp", "config": {"bucket_mb": -1}}])"),
               "bucket_mb must be a number in (0, 4096], got -1");
  expect_error(nlohmann::json::parse(R"([{"name": "ddp"}, {"name": "fsdp"}])"),
               "entry 1: 'fsdp' cannot be combined with 'ddp'");
  expect_error(nlohmann::json::parse(R"([{"name": "amp"}, {"name": "amp"}])"),
               "entry 1: method 'amp' is given twice");
  expect_error(nlohmann::json::parse(R"([{"name": "grad_accum", "config": {"steps": 0}}])"),
               "steps must be in [1, 4096], got 0");
  expect_error(nlohmann::json::parse(R"([{"name": "grad_accum"}])"), "needs an integer \"steps\"");
  expect_error(nlohmann::json::parse(R"([{"name": "amp", "config": {"dtype": "fp16"}}])"),
               "dtype must be \"bf16\"");
  expect_error(nlohmann::json::parse(R"([{"name": "ddp", "extra": 1}])"), "unknown field 'extra'");
  expect_error(nlohmann::json::parse(R"([{"name": "checkpoint", "config": {"kind": "partial"}}])"),
               "checkpoint: kind must be \"full\" or \"selective\", got \"partial\"");
  expect_error(nlohmann::json::parse(R"([{"name": "checkpoint", "config": {"kind": 2}}])"),
               "kind must be \"full\" or \"selective\", got 2");
  expect_error(nlohmann::json::parse(R"([{"name": "checkpoint", "config": {"kind": "selective",
                                                                   "blocks": -1}}])"),
               "blocks must be a count >= 0 or \"all\", got -1");
  EXPECT_NO_THROW(parse_strategy(nlohmann::json::parse(
      R"([{"name": "checkpoint", "config": {"kind": "full", "blocks": 1}}])")));
  EXPECT_THROW(strategies::parse_strategy_arg("[{\"name\": "), ValueError);
  EXPECT_THROW(strategies::parse_strategy_arg("/nonexistent/strategy.json"), IoError);
}

// check_composition (the search's check of each combination of configs it checked one by one)
// refuses what parse_strategy refuses for the composition, with the same message, and passes what
// it passes.
TEST(Strategy, CheckCompositionRefusesWhatParseStrategyRefuses) {
  for (const char* text : {
           R"([{"name": "ddp"}, {"name": "amp"}])",
           R"([{"name": "ddp"}, {"name": "fsdp"}])",
           R"([{"name": "amp"}, {"name": "amp"}])",
           R"([{"name": "zero1"}, {"name": "tensor_parallel", "config": {"size": 2}},
               {"name": "zero2"}])",
           R"([{"name": "sequence_parallel", "config": {"kind": "megatron"}}])",
           R"([{"name": "tensor_parallel", "config": {"size": 2}},
               {"name": "sequence_parallel", "config": {"kind": "megatron"}}])",
           R"([{"name": "fsdp"}, {"name": "pipeline_parallel", "config": {"size": 2}}])",
           R"([{"name": "zero1"}, {"name": "pipeline_parallel", "config": {"size": 2}}])",
       }) {
    const nlohmann::json j = nlohmann::json::parse(text);
    strategies::Strategy s;
    for (const auto& e : j) s.push_back({e["name"], e.value("config", nlohmann::json::object())});
    std::string parsed, composed;
    try {
      parse_strategy(j);
    } catch (const ValueError& e) {
      parsed = e.what();
    }
    try {
      strategies::check_composition(s);
    } catch (const ValueError& e) {
      composed = e.what();
    }
    EXPECT_EQ(composed, parsed) << text;
  }
  EXPECT_THROW(strategies::check_config({"ddp", {{"bucket_mb", -1}}}), ValueError);
  EXPECT_THROW(strategies::check_config({"tensor_magic", nlohmann::json::object()}), ValueError);
  EXPECT_NO_THROW(strategies::check_config({"tensor_parallel", {{"size", 2}}}));
}

// parse_strategy_arg (train_gpt --strategy): a file or inline JSON; every refusal names it.
TEST(Strategy, ArgumentErrorsNameTheFileOrTheText) {
  const std::string dir = ::testing::TempDir() + "acc_strategy_arg_test";
  std::filesystem::create_directories(dir);
  const std::string dup = dir + "/dup.json";
  std::ofstream(dup) << R"([{"name": "grad_accum", "config": {"steps": 2, "steps": 4}}])";
  const std::string bad = dir + "/bad.json";
  std::ofstream(bad) << R"([{"name": "ddp", "config": {"bucket": 3}}])";
  const std::string ok = dir + "/ok.json";
  std::ofstream(ok) << R"([{"name": "grad_accum", "config": {"steps": 4}}])";
  struct Case {
    std::string arg;
    bool io;  // acc::IoError, else acc::ValueError
    std::string needle;
  };
  const Case cases[] = {
      {dir, true, "strategy file '" + dir + "': is a directory, not a file"},
      {"ddp", true, "strategy 'ddp' is neither an existing file nor inline JSON"},
      {"/nonexistent/strategy.json", true, "'/nonexistent/strategy.json' is neither"},
      {dup, false, "strategy file '" + dup + "': duplicate key \"steps\" in /0/config"},
      {bad, false,
       "strategy file '" + bad + "': strategy entry 0 ('ddp'): ddp: unknown config key 'bucket'"},
      {R"([{"name": "ddp", "name": "fsdp"}])", false, "strategy: duplicate key \"name\" in /0"},
      {"[{\"name\": ", false, "strategy: invalid JSON: parse error at line 1, column 11"},
  };
  for (const Case& c : cases) {
    try {
      strategies::parse_strategy_arg(c.arg);
      ADD_FAILURE() << "no error for " << c.arg;
    } catch (const Error& e) {
      EXPECT_EQ(dynamic_cast<const IoError*>(&e) != nullptr, c.io) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos)
          << "'" << e.what() << "' lacks '" << c.needle << "'";
    }
  }
  EXPECT_EQ(strategies::parse_strategy_arg(ok).at(0).config["steps"], 4);
  std::filesystem::remove_all(dir);
}

TEST(Strategy, OneRankTrainerSplitsMicroBatches) {
  models::GPTConfig c;
  c.n_layer = 1;
  c.n_head = 2;
  c.n_embd = 16;
  c.vocab_size = 32;
  c.block_size = 16;
  auto model = std::make_shared<models::GPT>(c);
  auto trainer = strategies::apply(
      model, optim::AdamW::factory({}),
      parse_strategy(nlohmann::json::parse(R"([{"name": "grad_accum", "config": {"steps": 3}}])")));
  data::Batch b{randint(0, 32, {4, 8}), randint(0, 32, {4, 8})};
  try {
    trainer->train_step(b);
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("a batch of 4 sample(s) does not split into 3"),
              std::string::npos);
  }
  data::Batch ok{randint(0, 32, {6, 8}), randint(0, 32, {6, 8})};
  EXPECT_TRUE(std::isfinite(trainer->train_step(ok)));
}

}  // namespace
}  // namespace acc

namespace acc {
namespace {

// What the search reads of each method (search.hpp): every registered method declares itself,
// its choices follow the run, and its effects say what it changes.
// pipeline_parallel's effects for {"size": 2, "virtual": 2, "micro_batches": 4}.
strategies::StepEffects effects_of_pipeline(const std::vector<strategies::MethodSearch>& methods,
                                            const strategies::SearchContext& ctx) {
  strategies::StepEffects e;
  for (const auto& m : methods) {
    if (m.name == "pipeline_parallel") {
      m.effects({{"size", 2}, {"virtual", 2}, {"micro_batches", 4}}, ctx, e);
    }
  }
  return e;
}

TEST(SearchDeclarations, EveryMethodDeclaresItsChoicesAndEffects) {
  const auto methods = strategies::searchable_methods();
  ASSERT_EQ(methods.size(), strategies::method_names().size());
  strategies::SearchContext ctx{
      .world = 2, .num_blocks = 4, .per_rank_batch = 8, .allow_bf16 = true};
  std::map<std::string, std::vector<nlohmann::json>> choices;
  for (const auto& m : methods) {
    ASSERT_TRUE(m.choices) << m.name;
    ASSERT_TRUE(m.effects) << m.name;
    choices[m.name] = m.choices(ctx);
    EXPECT_FALSE(choices[m.name].empty()) << m.name;
    for (const auto& c : choices[m.name]) {
      // Every choice is a valid config of the method (Megatron-SP with the tensor_parallel it
      // runs over).
      nlohmann::json s = nlohmann::json::array({{{"name", m.name}, {"config", c}}});
      if (m.name == "sequence_parallel" && c.at("kind") == "megatron") {
        s.push_back({{"name", "tensor_parallel"}, {"config", {{"size", 2}}}});
      }
      EXPECT_NO_THROW(strategies::parse_strategy(s)) << m.name << " " << c.dump();
    }
  }
  // The sizes that divide the world (2 here); the layouts' other splits are their transforms'
  // checks, met when the search traces a candidate (search/space.cpp's layout_refusal).
  EXPECT_EQ(choices["tensor_parallel"], (std::vector<nlohmann::json>{{{"size", 2}}}));
  EXPECT_EQ(
      choices["sequence_parallel"],
      (std::vector<nlohmann::json>{{{"kind", "megatron"}}, {{"kind", "ulysses"}, {"size", 2}}}));
  // Pipelines of the sizes that divide the world and leave each stage a block, filled once, twice
  // and four times, 1F1B and (two stages a rank) interleaved.
  std::vector<nlohmann::json> pp;
  for (const int m : {2, 4, 8}) {
    pp.push_back({{"size", 2}, {"micro_batches", m}});
    pp.push_back({{"size", 2}, {"schedule", "interleaved"}, {"virtual", 2}, {"micro_batches", m}});
  }
  EXPECT_EQ(choices["pipeline_parallel"], pp);
  strategies::SearchContext shallow = ctx;
  shallow.num_blocks = 1;  // a stage a block: no pipeline of 2
  strategies::SearchContext module = ctx;
  module.language_model = false;  // a module of the user's is not cut into stages
  for (const auto& m : methods) {
    if (m.name == "pipeline_parallel") {
      EXPECT_TRUE(m.choices(shallow).empty());
      EXPECT_TRUE(m.choices(module).empty());
    }
  }
  const auto pipe = effects_of_pipeline(methods, ctx);
  EXPECT_EQ(pipe.micro_batches, 4);
  EXPECT_EQ(pipe.pipeline_ranks, 2);
  EXPECT_EQ(pipe.pipeline_virtual, 2);
  EXPECT_EQ(choices["grad_accum"],
            (std::vector<nlohmann::json>{{{"steps", 2}}, {{"steps", 4}}, {{"steps", 8}}}));
  EXPECT_EQ(
      choices["checkpoint"],
      (std::vector<nlohmann::json>{{{"blocks", 2}}, {{"blocks", "all"}}, {{"kind", "selective"}}}));
  for (const auto& m : methods) {
    EXPECT_EQ(m.needs_ranks, m.slot == "grad_sync") << m.name;
    EXPECT_EQ(m.needs_bf16, m.name == "amp") << m.name;
  }
  auto effects_of = [&](const std::string& name, const nlohmann::json& config) {
    strategies::StepEffects e;
    for (const auto& m : methods) {
      if (m.name == name) m.effects(config, ctx, e);
    }
    return e;
  };
  const auto zero2 = effects_of("zero2", nlohmann::json::object());
  EXPECT_TRUE(zero2.shard_gradients && zero2.shard_optimizer_state && !zero2.shard_parameters);
  EXPECT_EQ(zero2.bucket_bytes, 25 << 20);
  const auto fsdp = effects_of("fsdp", nlohmann::json::object());
  EXPECT_TRUE(fsdp.shard_parameters && fsdp.shard_gradients && fsdp.shard_optimizer_state);
  EXPECT_EQ(effects_of("checkpoint", {{"blocks", "all"}}).recompute_blocks, 4);
  EXPECT_FALSE(effects_of("checkpoint", {{"blocks", "all"}}).selective_recompute);
  const auto selective = effects_of("checkpoint", {{"kind", "selective"}, {"blocks", 3}});
  EXPECT_EQ(selective.recompute_blocks, 3);
  EXPECT_TRUE(selective.selective_recompute);
  EXPECT_EQ(effects_of("grad_accum", {{"steps", 4}}).micro_batches, 4);
  EXPECT_TRUE(effects_of("amp", nlohmann::json::object()).bf16_communication);
}

// What a pipeline stage of a layout runs and sends, as the search prices it: the layout but the
// pipeline, and the sequence split over tp under Megatron-SP (not under plain tensor
// parallelism) and over cp under Ulysses.
TEST(StageLayout, AStagesMethodsAndMessageFollowTheLayout) {
  auto tokens = [](const char* text, int world) {
    const strategies::Strategy s = strategies::parse_strategy(nlohmann::json::parse(text));
    return strategies::stage_message_tokens(s, strategies::mesh_for(s, world), 64);
  };
  EXPECT_EQ(tokens(R"([{"name": "pipeline_parallel", "config": {"size": 2}}])", 2), 64);
  EXPECT_EQ(tokens(R"([{"name": "tensor_parallel", "config": {"size": 2}},
                       {"name": "pipeline_parallel", "config": {"size": 2}}])",
                   4),
            64);
  EXPECT_EQ(tokens(R"([{"name": "tensor_parallel", "config": {"size": 2}},
                       {"name": "sequence_parallel", "config": {"kind": "megatron"}},
                       {"name": "pipeline_parallel", "config": {"size": 2}}])",
                   4),
            32);
  EXPECT_EQ(tokens(R"([{"name": "sequence_parallel", "config": {"kind": "ulysses", "size": 2}},
                       {"name": "pipeline_parallel", "config": {"size": 2}}])",
                   8),
            32);
  const strategies::Strategy s = strategies::parse_strategy(nlohmann::json::parse(
      R"([{"name": "zero1"}, {"name": "tensor_parallel", "config": {"size": 2}},
          {"name": "pipeline_parallel", "config": {"size": 2}}])"));
  const strategies::Strategy within = strategies::stage_layout_of(s);
  ASSERT_EQ(within.size(), 1u);
  EXPECT_EQ(within.front().name, "tensor_parallel");
}

// The search keys rank models by layout_key: it must be the layout's JSON, byte for byte, so two
// candidates share rank models exactly when their layouts are equal.
TEST(LayoutKey, IsTheLayoutsJsonDumped) {
  for (const char* text :
       {R"([])", R"([{"name": "zero2", "config": {"bucket_mb": 25}}, {"name": "amp"}])",
        R"([{"name": "tensor_parallel", "config": {"size": 2}}])",
        R"([{"name": "zero1"}, {"name": "tensor_parallel", "config": {"size": 2}},
               {"name": "sequence_parallel", "config": {"kind": "megatron"}},
               {"name": "pipeline_parallel",
                "config": {"size": 2, "schedule": "interleaved", "virtual": 2,
                           "micro_batches": 4}}])",
        R"([{"name": "sequence_parallel", "config": {"kind": "ulysses", "size": 2}},
               {"name": "amp"}, {"name": "pipeline_parallel", "config": {"size": 2}}])"}) {
    const strategies::Strategy s = strategies::parse_strategy(nlohmann::json::parse(text));
    const strategies::Strategy layout = strategies::layout_of(s);
    const std::string expected = layout.empty() ? "" : strategies::to_json(layout).dump();
    EXPECT_EQ(strategies::layout_key(s), expected) << text;
  }
  const strategies::Strategy unknown{{"no_such_method", nlohmann::json::object()}};
  EXPECT_THROW((void)strategies::layout_key(unknown), ValueError);
}

}  // namespace
}  // namespace acc
