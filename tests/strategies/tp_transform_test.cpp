// The tensor-parallel model transform (strategies/tp_transform.hpp) on GPT and Llama at whatever
// world size mpirun gives (CTest: 1, 2 and 4 ranks), every rank one tp rank: the sharded model's
// loss equals the whole model's, and one SGD step on the shards' gradients, gathered back into the
// whole model by the transform's undo, equals the same step on the whole model (fp32, another
// summation order: 1e-5 relative on the loss, 1e-6 + 1e-5 |p| on the parameters). The undo
// without a step gives the original values back bitwise.
#include <gtest/gtest.h>

#include "../../strategies/tp_transform.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/tensor/random.hpp"
#include "acc/trace/tracer.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

constexpr double kLr = 0.1;

models::LanguageModelPtr make(const std::string& type, const nlohmann::json& config) {
  Generator gen(21);
  return models::create_model(type, config, gen);
}

trace::Trace trace_of(models::LanguageModel& m) {
  const Tensor idx = empty({1, 4}, {DType::kInt64, Device::kMeta});
  return trace::trace(m, {idx, idx});
}

std::pair<Tensor, Tensor> batch() {
  Generator gen(23);
  return {randint(0, 64, {2, 8}, gen), randint(0, 64, {2, 8}, gen)};
}

void sgd(nn::Module& m) {
  NoGradGuard ng;
  for (auto& [name, p] : m.named_parameters()) {
    if (p.grad().defined()) p.add_(p.grad(), -kLr);
  }
}

void expect_tp_equals_whole(const std::string& type, const nlohmann::json& config) {
  const dist::ProcessGroupPtr tp = dist::ProcessGroup::world();
  auto [idx, targets] = batch();
  auto whole = make(type, config);
  Tensor want = whole->loss(idx, targets);
  want.backward();
  sgd(*whole);

  auto model = make(type, config);
  const auto original = model->named_parameters();
  std::vector<std::vector<float>> before;
  for (const auto& [n, p] : original) before.push_back(p.to_vector<float>());
  {
    // Undone without a step: the values come back bitwise.
    nn::Undo undo = strategies::shard_tensor_parallel(*model, trace_of(*model), tp);
    undo();
    const auto back = model->named_parameters();
    ASSERT_EQ(back.size(), before.size());
    for (size_t i = 0; i < back.size(); ++i) {
      EXPECT_EQ(back[i].second.to_vector<float>(), before[i]) << type << " " << back[i].first;
    }
  }
  nn::Undo undo = strategies::shard_tensor_parallel(*model, trace_of(*model), tp);
  if (tp->size() > 1) {
    bool sharded = false;
    for (const auto& [name, m] : model->named_modules()) {
      sharded = sharded || m->type_name() == "ColumnParallelLinear";
    }
    EXPECT_TRUE(sharded) << type << ": nothing was sharded";
  }
  Tensor got = model->loss(idx, targets);
  EXPECT_NEAR(got.item(), want.item(), 1e-5 * std::abs(want.item())) << type;
  got.backward();
  sgd(*model);
  undo();
  const auto mine = model->named_parameters(), ref = whole->named_parameters();
  ASSERT_EQ(mine.size(), ref.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    ASSERT_EQ(mine[i].first, ref[i].first);
    const auto a = mine[i].second.to_vector<float>(), b = ref[i].second.to_vector<float>();
    for (size_t k = 0; k < a.size(); ++k) {
      ASSERT_NEAR(a[k], b[k], 1e-6 + 1e-5 * std::abs(b[k]))
          << type << " " << mine[i].first << "[" << k << "] after one step";
    }
  }
}

TEST(TensorParallelTransform, GptShardedEqualsWhole) {
  expect_tp_equals_whole(
      "gpt",
      {{"n_layer", 2}, {"n_head", 4}, {"n_embd", 32}, {"vocab_size", 64}, {"block_size", 16}});
}

TEST(TensorParallelTransform, LlamaShardedEqualsWhole) {
  const int W = dist::world_size();
  expect_tp_equals_whole("llama", {{"hidden_size", 32},
                                   {"intermediate_size", 64},
                                   {"num_hidden_layers", 2},
                                   {"num_attention_heads", 4},
                                   {"num_key_value_heads", W},  // as many kv heads as ranks
                                   {"vocab_size", 64},
                                   {"max_position_embeddings", 16}});
}

TEST(TensorParallelTransform, SplitsThatDoNotDivideAreNamedAndNothingChanges) {
  const int W = dist::world_size();
  if (W < 2) GTEST_SKIP() << "every split divides over one rank";
  // 3 heads over W ranks (W = 2 or 4: never a multiple).
  auto gpt =
      make("gpt",
           {{"n_layer", 1}, {"n_head", 3}, {"n_embd", 24}, {"vocab_size", 64}, {"block_size", 16}});
  try {
    strategies::shard_tensor_parallel(*gpt, trace_of(*gpt), dist::ProcessGroup::world());
    FAIL() << "3 heads over " << W << " ranks";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("has 3 heads, not a multiple of tp " + std::to_string(W)),
              std::string::npos)
        << e.what();
  }
  for (const auto& [name, m] : gpt->named_modules()) {
    EXPECT_NE(m->type_name(), "ColumnParallelLinear") << name;
  }
  // kv heads and ranks where neither count divides the other (3 over 2, 6 over 4): a rank's query
  // heads would use parts of two kv heads' groups. (Fewer kv heads than ranks that divide them
  // train: tp_strategy_test.cpp.)
  const int64_t kv = W == 2 ? 3 : 6;
  auto llama = make("llama", {{"hidden_size", 16 * kv},
                              {"intermediate_size", 64},
                              {"num_hidden_layers", 1},
                              {"num_attention_heads", 2 * kv},
                              {"num_key_value_heads", kv},
                              {"vocab_size", 64},
                              {"max_position_embeddings", 16}});
  try {
    strategies::shard_tensor_parallel(*llama, trace_of(*llama), dist::ProcessGroup::world());
    FAIL() << kv << " kv heads over " << W << " ranks";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("neither is a multiple of the other"), std::string::npos)
        << e.what();
  }
  for (const auto& [name, m] : llama->named_modules()) {
    EXPECT_NE(m->type_name(), "ColumnParallelLinear") << name;
  }
}

}  // namespace
}  // namespace acc
