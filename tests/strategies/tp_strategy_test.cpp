// The tensor_parallel method trains GPT and Llama to the same losses and parameters as one
// process with the same global batch, alone and composed with the data-parallel family, amp,
// recomputation, gradient accumulation and dropout (issue 32). CTest runs it at 1, 2 and 4 ranks;
// a case whose mesh does not fit the world is skipped (tp2 x dp2 needs 4).
//
// Tolerances (fp32): 1e-5 relative on every step's loss and on its gradient norm, and every final
// parameter (gathered with full_parameters) within 5e-5 + 1e-4 |p| of one process's: the
// row-parallel sums, the reduce-scatters and the data-parallel reductions add in another order
// than one process does, and AdamW's normalised update (lr 1e-2) turns a small gradient
// element's relative rounding into up to lr times it per step, over 8 steps. Measured worst:
// 2.9e-5 + 1e-4 |p| (Llama with 2 kv heads, tp2 x dp2 zero1 + megatron sp, up_proj); the other
// cases stay within 2e-5 + 1e-4 |p|. amp is compared with amp in one process
// within bf16's unit roundoff u = 2^-8 on the losses (equivalence_test.cpp explains the bound).
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "acc/autograd/ops.hpp"
#include "acc/data/token_data.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/nn/transformer.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/util/error.hpp"
#include "every_rank_table.hpp"
#include "lm_runs.hpp"

namespace acc {
namespace {

constexpr int64_t kGlobalBatch = 4, kSeq = 16, kSteps = 8, kVocab = 64;

using test::ModelSpec;
using test::self_group;
using test::TrainRun;
using test::world;

// The learnable stream below `vocab` every run of a vocabulary reads.
std::shared_ptr<const data::TokenFile> tokens(int64_t vocab) {
  return test::learnable_tokens(vocab,
                                static_cast<size_t>((kSteps + 1) * kGlobalBatch * kSeq + kSeq + 1));
}

// Two blocks (test::tiny_gpt: 4 heads, no biases); the column- and row-parallel biases are checked
// against the whole Linear's in tp_layers_test.cpp.
ModelSpec gpt(double dropout = 0.0, int64_t vocab = kVocab) {
  return test::tiny_gpt(2, vocab, kSeq, dropout);
}

// Llama with `kv` key/value heads of 4 query heads: kv 4 splits as the query heads do, kv 2 at
// tp 4 puts each kv head on the two ranks whose query heads use it.
ModelSpec llama(int kv, int64_t vocab = kVocab) {
  return test::tiny_llama(kv, vocab, kSeq);
}

TrainRun train(const ModelSpec& spec, const std::string& strategy_json,
               const dist::ProcessGroupPtr& group, strategies::LossFn loss = nullptr) {
  return test::train_lm(spec, strategy_json, group,
                        {.tokens = tokens(spec.config.at("vocab_size").get<int64_t>()),
                         .global_batch = kGlobalBatch,
                         .seq_len = kSeq,
                         .steps = kSteps,
                         .loss = std::move(loss)});
}

// The file comment's tolerances; without `params`, the losses only (amp against amp).
void expect_close(const TrainRun& got, const TrainRun& want, double loss_tol, bool params = true) {
  test::expect_same_training(got, want, loss_tol, params ? 5e-5 : -1);
}

void expect_covered(const dist::PlacementTable& mine) {
  auto world_group = dist::ProcessGroup::world();
  const auto errors = dist::coverage_errors(test::every_rank_table(*world_group, mine));
  EXPECT_TRUE(errors.empty()) << errors.front();
}

const TrainRun& reference(const ModelSpec& spec, const std::string& strategy = "[]") {
  static std::map<std::string, TrainRun> runs;
  const std::string key = spec.type + spec.config.dump() + strategy;
  auto it = runs.find(key);
  if (it == runs.end()) it = runs.emplace(key, train(spec, strategy, self_group())).first;
  return it->second;
}

std::string tp(int t, const std::string& more = "") {
  return R"([{"name": "tensor_parallel", "config": {"size": )" + std::to_string(t) + "}}" +
         (more.empty() ? "" : ", " + more) + "]";
}

// tp over the whole world (tp1 at one rank: the method and its layouts, no shards).
TEST(TensorParallel, GptTpOverTheWorld) {
  const TrainRun got = train(gpt(), tp(world()), dist::ProcessGroup::world());
  expect_close(got, reference(gpt()), 1e-5);
  expect_covered(got.table);
}

TEST(TensorParallel, LlamaTpOverTheWorldKvHeadsEqualToRanksOrMore) {
  const TrainRun got = train(llama(4), tp(world()), dist::ProcessGroup::world());
  expect_close(got, reference(llama(4)), 1e-5);
  expect_covered(got.table);
}

// 2 kv heads: at tp 4 each is held by two ranks (its gradient summed over them).
TEST(TensorParallel, LlamaKvHeadsFewerThanRanks) {
  if (world() < 4) GTEST_SKIP() << "kv heads fewer than ranks needs tp 4";
  const TrainRun got = train(llama(2), tp(4), dist::ProcessGroup::world());
  expect_close(got, reference(llama(2)), 1e-5);
  expect_covered(got.table);
}

// Fewer kv heads than ranks under fsdp, with and without gradient accumulation: the kv weights'
// gradient is summed over their sharers by a gradient hook on the parameter, so the layer's
// forward reads the parameter itself, whose storage fsdp gathers and frees (a copy_to_group
// identity in its place kept each block's gathered storage alive through the forward).
TEST(TensorParallel, LlamaKvHeadsFewerThanRanksUnderFsdp) {
  if (world() < 2) GTEST_SKIP() << "kv heads fewer than ranks needs tp >= 2";
  for (const char* more : {R"({"name": "fsdp"})",
                           R"({"name": "fsdp"}, {"name": "grad_accum", "config": {"steps": 2}})"}) {
    SCOPED_TRACE(more);
    const TrainRun got = train(llama(1), tp(world(), more), dist::ProcessGroup::world());
    expect_close(got, reference(llama(1)), 1e-5);
    expect_covered(got.table);
  }
}

TEST(TensorParallel, Tp2TimesDp2) {
  if (world() != 4) GTEST_SKIP() << "tp2 x dp2 needs 4 ranks";
  for (const char* dp : {R"({"name": "ddp"})", R"({"name": "zero1"})", R"({"name": "zero2"})",
                         R"({"name": "fsdp"})"}) {
    SCOPED_TRACE(dp);
    const TrainRun got = train(gpt(), tp(2, dp), dist::ProcessGroup::world());
    expect_close(got, reference(gpt()), 1e-5);
    expect_covered(got.table);
  }
}

TEST(TensorParallel, Tp2WithRecomputationAndAccumulation) {
  if (world() != 2) GTEST_SKIP() << "tp2 alone at 2 ranks";
  expect_close(train(gpt(), tp(2, R"({"name": "checkpoint"})"), dist::ProcessGroup::world()),
               reference(gpt()), 1e-5);
  const std::string accum = R"({"name": "grad_accum", "config": {"steps": 2}})";
  expect_close(train(gpt(), tp(2, accum), dist::ProcessGroup::world()),
               reference(gpt(), "[" + accum + "]"), 1e-5);
}

// Dropout regions lie between the tensor-parallel ops, where every tp rank holds the whole
// activation: each draws the mask of the same elements from the same generator state, as one
// process does.
TEST(TensorParallel, Tp2WithDropoutEqualsOneProcess) {
  if (world() != 2) GTEST_SKIP() << "tp2 alone at 2 ranks";
  expect_close(train(gpt(0.1), tp(2), dist::ProcessGroup::world()), reference(gpt(0.1)), 1e-5);
}

TEST(TensorParallel, Tp2WithAmp) {
  if (world() != 2) GTEST_SKIP() << "tp2 alone at 2 ranks";
  const std::string amp = R"({"name": "amp"})";
  const TrainRun got = train(gpt(), tp(2, amp), dist::ProcessGroup::world());
  expect_close(got, reference(gpt(), "[" + amp + "]"), 1.0 / 256, /*params=*/false);
}

// A vocabulary of 61 tokens: padded to 62 (tp 2) or 64 (tp 4); the padding rows are in no loss,
// gradient, norm or placement (expect_covered: every element of the (61, C) tables once per
// replica, nothing else). GPT ties its head to the split embedding; Llama's untied lm_head is
// split alike.
TEST(TensorParallel, VocabularyNotDivisibleByTp) {
  for (const ModelSpec& spec : {gpt(0.0, 61), llama(4, 61)}) {
    SCOPED_TRACE(spec.type);
    const TrainRun got = train(spec, tp(world()), dist::ProcessGroup::world());
    expect_close(got, reference(spec), 1e-5);
    expect_covered(got.table);
    for (const auto& e : got.table) {
      if (e.param.find("wte") == std::string::npos &&
          e.param.find("embed_tokens") == std::string::npos &&
          e.param.find("lm_head") == std::string::npos) {
        continue;
      }
      EXPECT_EQ(e.global_shape, (Shape{61, 32})) << e.name;
      // Rows [r 31, ...) of 62 at tp 2, [r 16, ...) of 64 at tp 4, the padding cut off.
      const int64_t rows = (61 + world() - 1) / world();
      const int64_t first = dist::ProcessGroup::world()->rank() * rows;
      EXPECT_EQ(e.box.offsets[0], first) << e.name;
      EXPECT_EQ(e.box.sizes[0], std::min<int64_t>(rows, 61 - first)) << e.name;
    }
  }
}

// A loss of the user's gets whole logits: the vocabulary stays whole (asking for its split is
// refused, naming why), and the layers are still split.
TEST(TensorParallel, AUserLossKeepsTheVocabularyWhole) {
  const strategies::LossFn mine = [](nn::Module& m, const data::Batch& b) {
    return static_cast<models::LanguageModel&>(m).loss(b.idx(), b.targets());
  };
  const TrainRun got = train(gpt(), tp(world()), dist::ProcessGroup::world(), mine);
  expect_close(got, reference(gpt()), 1e-5);
  expect_covered(got.table);
  for (const auto& e : got.table) {
    if (e.param == "transformer.wte.weight") {
      EXPECT_TRUE(e.is_whole()) << e.name;
    }
  }
  if (world() == 1) return;
  try {
    train(gpt(),
          R"([{"name": "tensor_parallel", "config": {"size": )" + std::to_string(world()) +
              R"(, "vocab_parallel": true}}])",
          dist::ProcessGroup::world(), mine);
    FAIL() << "vocab_parallel with a user loss trained";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("a loss function of the user's"), std::string::npos)
        << e.what();
  }
}

std::string megatron_sp() {
  return R"({"name": "sequence_parallel", "config": {"kind": "megatron"}})";
}

// Megatron sequence parallelism: norms, residual adds and dropout on sequence chunks, all-gathers
// and reduce-scatters instead of all-reduces. The norm weights' gradients are partial on each tp
// rank (the field's classic bug when they are not summed over tp): the parameters after 8 steps
// equal one process's only if they are summed.
TEST(TensorParallel, MegatronSequenceParallel) {
  const std::string dp = world() == 4 ? R"({"name": "zero1"})" : "";
  for (const ModelSpec& spec : {gpt(), llama(4), llama(2)}) {
    SCOPED_TRACE(spec.type + spec.config.dump());
    const int t = world() == 4 ? 2 : world();
    const TrainRun got = train(spec, tp(t, megatron_sp() + (dp.empty() ? "" : ", " + dp)),
                               dist::ProcessGroup::world());
    expect_close(got, reference(spec), 1e-5);
    expect_covered(got.table);
  }
  if (world() == 4) {
    expect_close(train(gpt(), tp(4, megatron_sp()), dist::ProcessGroup::world()), reference(gpt()),
                 1e-5);
    expect_close(
        train(gpt(), tp(2, megatron_sp() + R"(, {"name": "fsdp"})"), dist::ProcessGroup::world()),
        reference(gpt()), 1e-5);
  }
}

// Dropout inside the blocks runs on sequence chunks: each element's mask is drawn from its index
// in the whole sequence, so the masks, and the training, are one process's.
TEST(TensorParallel, MegatronSequenceParallelWithDropoutEqualsOneProcess) {
  if (world() != 2) GTEST_SKIP() << "tp2 alone at 2 ranks";
  expect_close(train(gpt(0.1), tp(2, megatron_sp()), dist::ProcessGroup::world()),
               reference(gpt(0.1)), 1e-5);
}

// The collectives of one training step over tp, counted from the flight recorder, against what
// the design predicts for L blocks (GPT, tied vocabulary-parallel head, tp over the whole world,
// so the gradient norm's sum is over the same group):
//   tp only     all-reduce: forward 1 (embedding) + 2L (row-parallel outputs) + 2 (the loss's
//               row maxima; its sums of exponentials and target logits, fused into one);
//               backward 1 (the head's input) + 2L
//               (column-parallel inputs); the step 1 (gradient norm).
//   + megatron  all-gather: forward 2L + 1 (column inputs, the last block's output), backward
//               2L + 1 (row outputs, the first block's input); reduce-scatter: 2L forward (row
//               outputs), 2L backward (column inputs); all-reduce: forward 1 + 2, backward 1,
//               the step 2L (the norm weights' partial gradients) + 1.
std::map<std::string, int> collectives_of_a_step(const std::string& strategy) {
  manual_seed(11);
  Generator gen(5);
  models::LanguageModelPtr model = models::create_model("gpt", gpt().config, gen);
  auto trainer = strategies::apply(model, optim::AdamW::factory({.lr = 1e-2}),
                                   strategies::parse_strategy(nlohmann::json::parse(strategy)), {});
  data::BatchLoader loader(
      tokens(kVocab),
      {.batch_size = kGlobalBatch, .seq_len = kSeq, .order = data::SampleOrder::kSequential});
  trainer->train_step(loader.next());  // warm-up: anything done once is not counted
  dist::ProcessGroup& group = *trainer->context()->group(dist::MeshDim::kTp);
  const uint64_t before = group.sequence_number();
  trainer->train_step(loader.next());
  const uint64_t after = group.sequence_number();
  std::map<std::string, int> count;
  for (const auto& r : group.flight_recorder().entries()) {
    if (r.group == group.name() && !r.p2p && r.seq > before && r.seq <= after) ++count[r.op];
  }
  EXPECT_EQ(after - before, [&] {
    uint64_t n = 0;
    for (const auto& [op, k] : count) n += static_cast<uint64_t>(k);
    return n;
  }()) << "every collective of the step is in the recorder";
  return count;
}

TEST(TensorParallel, CollectivesPerStepAreTheDesigns) {
  if (world() < 2) GTEST_SKIP() << "no collectives at one rank";
  const int L = 2;
  // The loss's row maximum is the one max-reduction; every other reduction sums.
  EXPECT_EQ(collectives_of_a_step(tp(world())),
            (std::map<std::string, int>{{"allreduce.max", 1},
                                        {"allreduce.sum", (1 + 2 * L + 1) + (1 + 2 * L) + 1}}));
  EXPECT_EQ(collectives_of_a_step(tp(world(), megatron_sp())),
            (std::map<std::string, int>{{"allgather", 2 * (2 * L + 1)},
                                        {"reduce_scatter.sum", 2 * 2 * L},
                                        {"allreduce.max", 1},
                                        {"allreduce.sum", (1 + 1) + 1 + (2 * L + 1)}}));
}

// A transformer of the user's own (not a language model of the zoo): an embedding of its features,
// two nn::GPTBlocks in a ModuleList, a classifier head and the user's loss. tensor_parallel finds
// its blocks' attention and MLP by tracing it on the sample batch through that loss and splits
// them as it splits GPT's; the embedding and head stay whole (the loss is the user's).
struct Tagger : nn::Module {
  Tagger() : Module("Tagger") {
    Generator gen(3);
    in = register_module("in", std::make_shared<nn::Linear>(8, 32, true, gen));
    blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
    for (int i = 0; i < 2; ++i) {
      blocks->push_back(
          std::make_shared<nn::GPTBlock>(32, 4, false, nn::Activation::kGeluTanh, 0.0, gen));
    }
    out = register_module("out", std::make_shared<nn::Linear>(32, 5, true, gen));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = in(x);
    for (const auto& b : *blocks) h = (*b)(h);
    return out(h);
  }
  nn::Child<nn::Linear> in, out;
  nn::Child<nn::ModuleList> blocks;
};

// Per-token tags (B, T): the class of each position's features.
data::Batch tagger_batch(int64_t step, int dp, int dp_rank) {
  Generator gen(static_cast<uint64_t>(100 + step));
  const Tensor x = randn({kGlobalBatch, 8, 8}, gen);
  const auto v = x.to_vector<float>();
  std::vector<int64_t> tags(static_cast<size_t>(kGlobalBatch * 8));
  for (size_t i = 0; i < tags.size(); ++i) tags[i] = v[i * 8] > 0 ? (v[i * 8 + 1] > 0 ? 1 : 2) : 3;
  const data::Batch whole({{"x", x}, {"tags", from_vector(tags, {kGlobalBatch, 8})}});
  return whole.split(dp, "tagger")[static_cast<size_t>(dp_rank)];
}

TrainRun train_tagger(const std::string& strategy_json, const dist::ProcessGroupPtr& group) {
  auto model = std::make_shared<Tagger>();
  const strategies::LossFn loss = [](nn::Module& m, const data::Batch& b) {
    const Tensor logits = m(b["x"]);
    return cross_entropy(logits.reshape({-1, 5}), b["tags"].reshape({-1}));
  };
  auto trainer = strategies::apply(
      model, optim::AdamW::factory({.lr = 1e-2, .betas = {0.9, 0.95}, .weight_decay = 0.1}),
      strategies::parse_strategy(nlohmann::json::parse(strategy_json)),
      {.group = group, .grad_clip = 1.0, .loss = loss, .sample_batch = tagger_batch(0, 1, 0)});
  const int dp = trainer->context() ? trainer->context()->data_world() : 1;
  const int dp_rank = trainer->context() ? trainer->context()->data_rank() : 0;
  TrainRun r;
  for (int64_t s = 0; s < kSteps; ++s) {
    r.losses.push_back(trainer->train_step(tagger_batch(s, dp, dp_rank)));
    r.norms.push_back(trainer->last_grad_norm());
  }
  r.params = trainer->full_parameters();
  r.table = trainer->placements();
  return r;
}

TEST(TensorParallel, AUserTransformerIsSplitFromItsTrace) {
  static const TrainRun ref = train_tagger("[]", self_group());
  const TrainRun got = train_tagger(tp(world()), dist::ProcessGroup::world());
  expect_close(got, ref, 1e-5);
  expect_covered(got.table);
  if (world() == 1) return;
  std::set<std::string> split;
  for (const auto& e : got.table) {
    if (e.kind == dist::TensorKind::kParameter && !e.is_whole()) split.insert(e.param);
  }
  EXPECT_EQ(split.size(), 2u * 4) << "c_attn, attn.c_proj, c_fc and mlp.c_proj of 2 blocks split";
  // Without the sample batch a module is not traced: named.
  try {
    strategies::apply(std::make_shared<Tagger>(), optim::AdamW::factory({.lr = 1e-2}),
                      strategies::parse_strategy(nlohmann::json::parse(tp(world()))),
                      {.loss = [](nn::Module& m, const data::Batch& b) {
                        return cross_entropy(m(b["x"]).reshape({-1, 5}), b["tags"].reshape({-1}));
                      }});
    FAIL() << "traced without a sample batch";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("give ApplyOptions::sample_batch"), std::string::npos)
        << e.what();
  }
}

TEST(TensorParallel, RefusesSplitsThatDoNotDivide) {
  if (world() < 2) GTEST_SKIP() << "needs tp >= 2";
  // GPT with 3 heads at tp 2: the heads are named.
  ModelSpec three = gpt();
  three.config["n_head"] = 3;
  three.config["n_embd"] = 48;
  try {
    train(three, tp(2, world() == 4 ? R"({"name": "ddp"})" : ""), dist::ProcessGroup::world());
    FAIL() << "3 heads at tp 2 trained";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("3 heads, not a multiple of tp 2"), std::string::npos)
        << e.what();
  }
  if (world() == 4) {
    try {
      train(gpt(), tp(3), dist::ProcessGroup::world());
      FAIL() << "tp 3 on 4 ranks trained";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("needs a multiple of 3 ranks, the run has 4"),
                std::string::npos)
          << e.what();
    }
  }
}

// A step that fails on every rank (a batch grad_accum cannot split) tears its Trainer down while
// the exception unwinds: no gather runs (another rank might never reach it), fsdp's shards and
// tensor_parallel's wholes stay released, and the error reaches the caller instead of a terminate
// from the undo (seen once: the search's dry-runs of fsdp + tensor_parallel).
TEST(TensorParallel, AFailedStepUnderFsdpTearsDownWithoutGathering) {
  if (world() < 2) GTEST_SKIP() << "needs tp >= 2";
  auto model = models::create_model(gpt().type, gpt().config);
  const Tensor wte = model->find_tensor("transformer.wte.weight");
  std::vector<int64_t> ids(2 * 8, 3);
  const data::Batch two(from_vector(ids, {2, 8}), from_vector(ids, {2, 8}));
  const std::string strategy =
      tp(2, R"({"name": "fsdp"}, {"name": "grad_accum", "config": {"steps": 4}})");
  try {
    auto trainer = strategies::apply(model, optim::AdamW::factory({.lr = 1e-3}),
                                     strategies::parse_strategy(nlohmann::json::parse(strategy)),
                                     {.group = dist::ProcessGroup::world()});
    trainer->train_step(two);
    FAIL() << "a batch of 2 split into 4 micro-batches";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("does not split into 4"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(wte.is_meta()) << "the table was gathered while the error unwound";
}

}  // namespace
}  // namespace acc
