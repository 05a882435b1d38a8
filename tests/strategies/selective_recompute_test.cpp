// checkpoint {"kind": "selective"} (issue 32: Korthikanti et al. 2022's selective recomputation of
// the attention cores) trains GPT and Llama to the same losses, gradient norms and parameters as
// the same strategy without it, bitwise: the recomputation in backward runs the same kernels on
// the same q, k, v, so every value it gives back is the one the plain run kept. Alone on one
// process, with ddp over the world, and after tensor_parallel at 2 ranks (CTest runs 1 and 2).
//
// Memory: the peak of tracked bytes over a step, none > selective > full, measured with the
// fused flash attention (which saves only its output and row statistics: selective saves those)
// and with the reference attention (which saves its (B, NH, T, T) probabilities: selective saves
// those, the point of the paper). Printed per rank 0 as `selective_memory ...` lines.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "acc/data/token_data.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/util/error.hpp"
#include "lm_runs.hpp"

namespace acc {
namespace {

constexpr int64_t kGlobalBatch = 4, kSeq = 16, kSteps = 5, kVocab = 64;

const char* kSelective = R"({"name": "checkpoint", "config": {"kind": "selective"}})";

using test::ModelSpec;
using test::self_group;
using test::TrainRun;
using test::world;

std::shared_ptr<const data::TokenFile> tokens() {
  static auto t = test::synthetic_tokens(
      static_cast<size_t>((kSteps + 1) * kGlobalBatch * kSeq + kSeq + 1), kVocab, 2468, 3, 5);
  return t;
}

// 4 heads, so tp 2 splits them; dropout on, so the replay's generator state matters.
ModelSpec gpt() {
  return {"gpt",
          {{"n_layer", 2},
           {"n_head", 4},
           {"n_embd", 32},
           {"vocab_size", kVocab},
           {"block_size", kSeq},
           {"dropout", 0.1}}};
}

// Grouped-query attention: 2 key/value heads for 4 query heads.
ModelSpec llama() {
  return test::tiny_llama(2, kVocab, kSeq);
}

TrainRun train(const ModelSpec& spec, const std::string& strategy_json,
               const dist::ProcessGroupPtr& group) {
  return test::train_lm(spec, strategy_json, group,
                        {.tokens = tokens(),
                         .global_batch = kGlobalBatch,
                         .seq_len = kSeq,
                         .steps = kSteps,
                         .manual_seed = 13,
                         .model_seed = 17});
}

void expect_bitwise(const TrainRun& got, const TrainRun& want) {
  test::expect_same_training(got, want, 0, 0, /*bitwise=*/true);
  // The runs trained: the losses moved.
  EXPECT_NE(got.losses.front(), got.losses.back());
}

std::string list(const std::string& a, const std::string& b = "") {
  return "[" + a + (a.empty() || b.empty() ? "" : ", ") + b + "]";
}

TEST(SelectiveRecompute, GptOneProcessEqualsNoRecomputationBitwise) {
  expect_bitwise(train(gpt(), list(kSelective), self_group()), train(gpt(), "[]", self_group()));
}

TEST(SelectiveRecompute, LlamaOneProcessEqualsNoRecomputationBitwise) {
  expect_bitwise(train(llama(), list(kSelective), self_group()),
                 train(llama(), "[]", self_group()));
}

// The first unit only, as "blocks" limits full recomputation.
TEST(SelectiveRecompute, FirstBlockOnlyEqualsNoRecomputationBitwise) {
  const std::string first =
      R"({"name": "checkpoint", "config": {"kind": "selective", "blocks": 1}})";
  expect_bitwise(train(gpt(), list(first), self_group()), train(gpt(), "[]", self_group()));
}

TEST(SelectiveRecompute, DdpOverTheWorldEqualsDdpBitwise) {
  const std::string ddp = R"({"name": "ddp"})";
  for (const ModelSpec& spec : {gpt(), llama()}) {
    SCOPED_TRACE(spec.type);
    expect_bitwise(train(spec, list(ddp, kSelective), dist::ProcessGroup::world()),
                   train(spec, list(ddp), dist::ProcessGroup::world()));
  }
}

TEST(SelectiveRecompute, AfterTensorParallelEqualsTp2Bitwise) {
  if (world() != 2) GTEST_SKIP() << "tp2 alone needs 2 ranks";
  const std::string tp2 = R"({"name": "tensor_parallel", "config": {"size": 2}})";
  for (const ModelSpec& spec : {gpt(), llama()}) {
    SCOPED_TRACE(spec.type);
    expect_bitwise(train(spec, list(tp2, kSelective), dist::ProcessGroup::world()),
                   train(spec, list(tp2), dist::ProcessGroup::world()));
  }
}

TEST(SelectiveRecompute, BadConfigsNameTheKeyAndTheValue) {
  auto error_of = [](const std::string& strategy) -> std::string {
    try {
      train(gpt(), strategy, self_group());
    } catch (const ValueError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(error_of(R"([{"name": "checkpoint", "config": {"kind": "partial"}}])")
                .find("checkpoint: kind must be \"full\" or \"selective\", got \"partial\""),
            std::string::npos);
  // A unit without an attention core is named.
  const std::string mlp = error_of(
      R"([{"name": "checkpoint", "config": {"kind": "selective",
                                            "units": ["transformer.h.0.mlp"]}}])");
  EXPECT_NE(mlp.find("selective recomputation: block 'transformer.h.0.mlp'"), std::string::npos)
      << mlp;
  EXPECT_NE(mlp.find("has no attention"), std::string::npos) << mlp;
  EXPECT_NE(error_of(R"([{"name": "checkpoint", "config": {"kind": "selective", "blocks": 3}}])")
                .find("blocks 3 is more than the 2 repeated block(s)"),
            std::string::npos);
}

// ---- memory ----

// Tracked bytes at the peak of the second step (optimizer state exists from the first), above
// what existed before the model.
int64_t step_peak(const std::string& strategy, bool fused) {
  const int64_t base = memory::current_bytes();
  int64_t peak = 0;
  {
    manual_seed(3);
    models::GPTConfig c;
    c.n_layer = 4;
    c.n_head = 4;
    c.n_embd = 64;
    c.vocab_size = 64;
    c.block_size = 128;
    auto model = std::make_shared<models::GPT>(c);
    model->set_fused_attention(fused);
    auto trainer = strategies::apply(model, optim::AdamW::factory({}),
                                     strategies::parse_strategy(nlohmann::json::parse(strategy)),
                                     {.group = self_group()});
    data::Batch batch{randint(0, 64, {4, 128}), randint(0, 64, {4, 128})};
    trainer->train_step(batch);
    memory::reset_peak();
    trainer->train_step(batch);
    peak = memory::peak_bytes() - base;
  }
  memory::empty_cache();
  return peak;
}

TEST(SelectiveRecompute, StepPeakFallsFromNoneToSelectiveToFull) {
  for (const bool fused : {true, false}) {
    const int64_t none = step_peak("[]", fused);
    const int64_t selective = step_peak(list(kSelective), fused);
    const int64_t full = step_peak(R"([{"name": "checkpoint"}])", fused);
    if (dist::ProcessGroup::world()->rank() == 0) {
      std::printf(
          "selective_memory attention=%s step_peak_bytes none=%lld selective=%lld full=%lld "
          "(selective saves %.1f%% of none's peak, full %.1f%%)\n",
          fused ? "fused" : "reference", static_cast<long long>(none),
          static_cast<long long>(selective), static_cast<long long>(full),
          100.0 * static_cast<double>(none - selective) / static_cast<double>(none),
          100.0 * static_cast<double>(none - full) / static_cast<double>(none));
    }
    RecordProperty(std::string(fused ? "fused" : "reference") + "_none", std::to_string(none));
    RecordProperty(std::string(fused ? "fused" : "reference") + "_selective",
                   std::to_string(selective));
    RecordProperty(std::string(fused ? "fused" : "reference") + "_full", std::to_string(full));
    // By construction: selective keeps everything full recomputation drops except the attention
    // cores' own saves (4 blocks: more than one block's recomputed working set), and none keeps
    // those saves besides (the row statistics at least, the probabilities with the reference).
    EXPECT_LT(selective, none) << (fused ? "fused" : "reference");
    EXPECT_GT(selective, full) << (fused ? "fused" : "reference");
  }
}

}  // namespace
}  // namespace acc
