// The strategy layer itself, at whatever world size mpirun gives (CTest runs 1, 2 and 4):
//  - the placement table of every method covers every element of every global tensor (parameters,
//    gradients, optimizer state) exactly once per replica, and what it says a rank holds is what
//    the rank holds;
//  - applying a strategy and dropping the Trainer leaves the model as one never touched: it trains
//    bitwise like a fresh model given the same values (same code path, same thread count);
//  - the checkpoint method lowers the tracked peak of a step as the trace predicts.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "acc/dist/agreement.hpp"
#include "acc/dist/dist.hpp"
#include "acc/dist/sharding.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/error.hpp"
#include "every_rank_table.hpp"

namespace acc {
namespace {

using dist::TensorKind;

models::LanguageModelPtr make_model(int64_t n_layer = 2) {
  models::GPTConfig c;
  c.n_layer = n_layer;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 64;
  c.block_size = 16;
  manual_seed(11);
  return std::make_shared<models::GPT>(c);
}

data::Batch batch_for(int64_t step, int64_t B, int rank) {
  manual_seed(static_cast<uint64_t>(1000 + 10 * step + rank));
  return {randint(0, 64, {B, 16}), randint(0, 64, {B, 16})};
}

std::unique_ptr<strategies::Trainer> apply_strategy(const models::LanguageModelPtr& model,
                                                    const std::string& strategy) {
  return strategies::apply(
      model, optim::AdamW::factory({.lr = 1e-2, .weight_decay = 0.1}, optim::decay_matrices_only()),
      strategies::parse_strategy(nlohmann::json::parse(strategy)),
      {.group = nullptr, .grad_clip = 1.0});
}

// Strategies valid at any world size (the world is the group).
std::vector<std::string> strategies_for_world() {
  std::vector<std::string> s = {
      R"([{"name": "ddp"}])",
      R"([{"name": "ddp", "config": {"bucket_mb": 0.01}}])",
      R"([{"name": "zero1", "config": {"bucket_mb": 0.01}}])",
      R"([{"name": "zero2"}])",
      R"([{"name": "zero2", "config": {"bucket_mb": 0.01}}])",
      R"([{"name": "fsdp"}])",
      R"([{"name": "fsdp"}, {"name": "amp"}])",
      R"([{"name": "zero1"}, {"name": "checkpoint"}])",
      R"([{"name": "fsdp"}, {"name": "checkpoint", "config": {"blocks": 1}}])",
      R"([{"name": "ddp"}, {"name": "grad_accum", "config": {"steps": 2}}])"};
  if (dist::world_size() == 1) {
    s.push_back("[]");
    s.push_back(R"([{"name": "amp"}, {"name": "checkpoint"}])");
  }
  return s;
}

// ---- placement coverage ----

TEST(Placement, EveryElementIsHeldExactlyOncePerReplica) {
  auto world = dist::ProcessGroup::world();
  for (const std::string& s : strategies_for_world()) {
    SCOPED_TRACE(s);
    auto model = make_model();
    std::map<std::string, int64_t> numel;
    for (const auto& [name, p] : model->named_parameters()) numel[name] = p.numel();
    auto trainer = apply_strategy(model, s);
    trainer->train_step(batch_for(0, 4, world->rank()));
    std::map<std::string, std::vector<float>> full_values;
    for (const auto& kv : trainer->full_parameters()) {
      full_values[kv.first] = kv.second.contiguous().template to_vector<float>();
    }

    std::map<std::string, int> kinds;  // parameter, gradient, exp_avg, exp_avg_sq per parameter
    const dist::PlacementTable mine = trainer->placements();
    for (const auto& e : mine) {
      ASSERT_EQ(numel_of(e.global_shape), numel.at(e.param)) << e.name;
      ASSERT_TRUE(e.local.defined()) << e.name << " (" << dist::tensor_kind_name(e.kind)
                                     << ") has no local tensor after a step";
      ASSERT_EQ(e.local.numel(), e.held_numel()) << e.name;
      EXPECT_TRUE(e.kind != TensorKind::kOptimizerState || e.field == "exp_avg" ||
                  e.field == "exp_avg_sq")
          << e.name;
      ++kinds[e.param];
      if (e.kind == TensorKind::kParameter) {  // holds the values it claims to hold
        const std::vector<float> got = e.local.contiguous().template to_vector<float>();
        const auto& want = full_values.at(e.param);
        for (const auto& [run, at] : e.global_runs()) {
          for (int64_t i = 0; i < run.length; ++i) {
            ASSERT_EQ(got[static_cast<size_t>(at + i)], want[static_cast<size_t>(run.offset + i)])
                << e.name << " element " << run.offset + i;
          }
        }
      }
    }
    // Every rank's table, on every rank: each element of each tensor once per replica.
    const std::vector<dist::PlacementTable> tables = test::every_rank_table(*world, mine);
    const auto errors = dist::coverage_errors(tables);
    for (const auto& e : errors) ADD_FAILURE() << e;
    // Every parameter, its gradient and both AdamW fields are in the table, on some rank.
    std::map<std::pair<std::string, int>, int> seen;
    for (const auto& t : tables) {
      for (const auto& e : t) {
        ++seen[{e.param, e.kind == TensorKind::kOptimizerState ? (e.field == "exp_avg" ? 2 : 3)
                                                               : static_cast<int>(e.kind)}];
      }
    }
    EXPECT_EQ(seen.size(), numel.size() * 4);
  }
}

// ---- reversible application ----

TEST(Reversible, DroppedTrainerLeavesAModelThatTrainsLikeAnUntouchedOne) {
  const int rank = dist::rank();
  for (const std::string& s : strategies_for_world()) {
    SCOPED_TRACE(s);
    auto used = make_model();
    {
      auto trainer = apply_strategy(used, s);
      for (int64_t step = 0; step < 2; ++step) trainer->train_step(batch_for(step, 4, rank));
    }
    // Nothing of the strategy is left on the model.
    for (const auto& [name, m] : used->named_modules()) {
      EXPECT_EQ(m->num_forward_hooks(), 0u) << "module '" << name << "'";
      EXPECT_FALSE(m->has_forward_wrapper()) << "module '" << name << "'";
    }
    for (const auto& [name, p] : used->named_parameters()) {
      EXPECT_EQ(p.num_post_accumulate_grad_hooks(), 0u) << name;
      EXPECT_FALSE(p.grad().defined()) << name;
      EXPECT_FALSE(p.is_meta()) << name;
      EXPECT_TRUE(p.is_contiguous()) << name;
      EXPECT_EQ(p.offset(), 0) << name;
      EXPECT_EQ(p.storage()->nbytes(), p.nbytes()) << name << " still lives in a larger buffer";
    }
    // A fresh model with the same values, and both trained alike: bitwise the same.
    auto fresh = make_model();
    {
      NoGradGuard ng;
      fresh->load_state_dict(used->state_dict());
    }
    std::vector<std::shared_ptr<models::LanguageModel>> models = {used, fresh};
    std::vector<std::vector<float>> losses(2), params(2);
    for (size_t k = 0; k < 2; ++k) {
      optim::AdamW opt(models[k]->named_parameters(), {.lr = 1e-2, .weight_decay = 0.1});
      for (int64_t step = 0; step < 3; ++step) {
        opt.zero_grad();
        const data::Batch b = batch_for(10 + step, 4, rank);
        Tensor loss = models[k]->loss(b.idx(), b.targets());
        losses[k].push_back(loss.item());
        loss.backward();
        opt.step();
      }
      for (const auto& [name, p] : models[k]->named_parameters()) {
        const auto v = p.contiguous().to_vector<float>();
        params[k].insert(params[k].end(), v.begin(), v.end());
      }
    }
    EXPECT_EQ(losses[0], losses[1]);
    EXPECT_TRUE(params[0] == params[1]) << "parameters differ after training";
  }
}

TEST(Reversible, AFailedApplyLeavesTheModelUntouched) {
  auto model = make_model();
  const auto before = model->state_dict();
  std::vector<std::vector<float>> values;
  for (const auto& [n, t] : before) values.push_back(t.to_vector<float>());
  // The optimizer factory fails after the methods have changed the model.
  optim::OptimizerFactory failing(
      [](std::vector<optim::ParamGroup>) -> std::unique_ptr<optim::Optimizer> {
        ACC_THROW(ValueError, "optimizer refused");
      },
      nullptr);
  EXPECT_THROW(strategies::apply(model, failing,
                                 strategies::parse_strategy(nlohmann::json::parse(
                                     R"([{"name": "zero2"}, {"name": "amp"}])")),
                                 {}),
               ValueError);
  for (const auto& [name, m] : model->named_modules()) {
    EXPECT_EQ(m->num_forward_hooks(), 0u) << name;
    EXPECT_FALSE(m->has_forward_wrapper()) << name;
  }
  size_t i = 0;
  for (const auto& [name, p] : model->named_parameters()) {
    EXPECT_EQ(p.num_post_accumulate_grad_hooks(), 0u) << name;
    EXPECT_EQ(p.storage()->nbytes(), p.nbytes()) << name;
    EXPECT_EQ(p.to_vector<float>(), values[i++]) << name;
  }
}

// ---- recomputation ----

// The checkpoint method on 0, half and all blocks: the tracked peak of a real step (forward,
// backward, AdamW update) is what the trace with the same recomputation predicts, within 5%, and
// recomputing more blocks lowers it. One process (the self group) at any world size.
TEST(Checkpoint, LowersThePeakAsTheTracePredicts) {
  auto world = dist::ProcessGroup::world();
  static dist::ProcessGroupPtr self = world->split(world->rank(), 0, "self");
  const int64_t L = 4, B = 8;
  std::vector<int64_t> peaks;
  for (int64_t blocks : {int64_t{0}, L / 2, L}) {
    SCOPED_TRACE("blocks " + std::to_string(blocks));
    auto model = make_model(L);
    Tensor idx = batch_for(0, B, 0).idx();
    trace::Trace t =
        trace::trace(*model, {idx, idx},
                     {.recompute = blocks > 0 ? trace::Recompute::kBlock : trace::Recompute::kNone,
                      .recompute_blocks = blocks});
    const trace::MemoryEstimate est = trace::estimate_memory(t, "adamw");
    auto trainer = strategies::apply(
        model, optim::AdamW::factory({}),
        strategies::parse_strategy(
            nlohmann::json::array({{{"name", "checkpoint"}, {"config", {{"blocks", blocks}}}}})),
        {.group = self});
    const data::Batch b = batch_for(1, B, 0);
    trainer->train_step(b);  // optimizer state exists from here on
    model->zero_grad();
    const int64_t base = memory::current_bytes() - est.parameters - est.optimizer_state;
    memory::reset_peak();
    trainer->train_step(b);
    const int64_t measured = memory::peak_bytes() - base;
    const double err = std::abs(static_cast<double>(est.peak - measured)) / measured;
    EXPECT_LT(err, 0.05) << "estimated " << est.peak << " measured " << measured;
    RecordProperty("peak_error_blocks_" + std::to_string(blocks), std::to_string(err));
    peaks.push_back(measured);
  }
  EXPECT_LT(peaks[1], peaks[0]);
  EXPECT_LT(peaks[2], peaks[1]);
}

// amp keeps the activations saved inside blocks in bf16: the trace with bf16_activations predicts
// the step's tracked peak within 5%, and the activation bytes it saves are what the step saves.
TEST(Amp, StoresBlockActivationsInBf16AsTheTracePredicts) {
  auto world = dist::ProcessGroup::world();
  static dist::ProcessGroupPtr self = world->split(world->rank(), 0, "self");
  const int64_t L = 4, B = 8;
  std::map<bool, trace::MemoryEstimate> est;
  std::map<bool, int64_t> measured;
  for (bool amp : {false, true}) {
    SCOPED_TRACE(amp ? "amp" : "fp32");
    auto model = make_model(L);
    Tensor idx = batch_for(0, B, 0).idx();
    est[amp] = trace::estimate_memory(trace::trace(*model, {idx, idx}, {.bf16_activations = amp}),
                                      "adamw");
    auto trainer = strategies::apply(
        model, optim::AdamW::factory({}),
        strategies::parse_strategy(nlohmann::json::parse(amp ? R"([{"name": "amp"}])" : "[]")),
        {.group = self});
    const data::Batch b = batch_for(1, B, 0);
    trainer->train_step(b);
    model->zero_grad();
    const int64_t base = memory::current_bytes() - est[amp].parameters - est[amp].optimizer_state;
    memory::reset_peak();
    trainer->train_step(b);
    measured[amp] = memory::peak_bytes() - base;
    const double err = std::abs(static_cast<double>(est[amp].peak - measured[amp])) / measured[amp];
    EXPECT_LT(err, 0.05) << "estimated " << est[amp].peak << " measured " << measured[amp];
    RecordProperty(std::string("peak_error_") + (amp ? "amp" : "fp32"), std::to_string(err));
  }
  // The activations fall by about half (not all of them live inside blocks: embeddings, the head
  // and the loss stay f32).
  EXPECT_LT(est[true].activations_peak, 0.7 * est[false].activations_peak);
  const double saved_est = static_cast<double>(est[false].peak - est[true].peak);
  const double saved_measured = static_cast<double>(measured[false] - measured[true]);
  EXPECT_GT(saved_measured, 0.0);
  EXPECT_NEAR(saved_measured, saved_est, 0.1 * saved_est)
      << "bytes amp saves: estimated " << saved_est << " measured " << saved_measured;
  RecordProperty("amp_activation_ratio",
                 std::to_string(static_cast<double>(est[true].activations_peak) /
                                est[false].activations_peak));
}

TEST(Checkpoint, BadConfigsAreRefusedByName) {
  for (const char* bad : {R"([{"name": "checkpoint", "config": {"blocks": -1}}])",
                          R"([{"name": "checkpoint", "config": {"blocks": "half"}}])",
                          R"([{"name": "checkpoint", "config": {"layers": 2}}])"}) {
    try {
      strategies::parse_strategy(nlohmann::json::parse(bad));
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("checkpoint"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace acc
