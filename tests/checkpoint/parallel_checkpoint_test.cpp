// Checkpoints of tensor- and pipeline-parallel runs (issues 32 and 33), at 4 ranks.
//
// Tensor parallel: saved at tp2 x dp2 with zero2, then
// loaded into dp4 (zero2), tp4, one process, tp2 (on 2 ranks, ddp-less) and tp2 x dp2 (zero2)
// again. After the load every parameter and optimizer-state region a rank holds equals the saved
// tensor's bitwise, and one more step gives the saving run's next loss: bitwise in the same
// layout, within 1e-5 relative in another (the reductions add in another order). The vocabulary
// (61 tokens) does not divide by tp: the checkpoint and its safetensors export hold the 61 real
// rows of the tied embedding, never the padding.
//
// Pipeline parallel: saved at pp2 x dp2 with zero1 (each stage writes only its own tensors; the
// tied embedding, held by the first and the last stage, once), then loaded into pp2 x dp2 (zero1)
// again, dp4 (zero1), pp4, pp2 x v2 on 2 ranks and one process, checked the same way.
#include <gtest/gtest.h>

#include <bit>
#include <filesystem>

#include "acc/checkpoint/checkpoint.hpp"
#include "acc/dist/dist.hpp"
#include "acc/io/safetensors.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/random.hpp"
#include "helpers.hpp"

namespace acc::ckpt {
namespace {

using test::expect_holds;
using test::first;
using test::job_dir;
using test::read_whole;
using test::remove_job_dir;
constexpr int64_t kGlobalBatch = 4, kSeq = 16, kVocab = 61;
const char* const kHash = "tp-test-model";
const char* const kPpHash = "pp-test-model";  // the 4-block GPT

models::LanguageModelPtr make_model(uint64_t seed, int64_t layers = 2) {
  manual_seed(seed);
  return models::create_model("gpt", {{"n_layer", layers},
                                      {"n_head", 4},
                                      {"n_embd", 32},
                                      {"vocab_size", kVocab},
                                      {"block_size", kSeq},
                                      {"bias", false}});
}

// Step s's global batch, data-parallel rank r's share of it among n.
data::Batch batch(int64_t step, int n, int r) {
  return test::batch_share(step, n, r, kGlobalBatch, kSeq, kVocab);
}

std::unique_ptr<strategies::Trainer> trainer(models::LanguageModelPtr m, const std::string& s,
                                             dist::ProcessGroupPtr g) {
  return strategies::apply(m, optim::AdamW::factory({.lr = 1e-2, .weight_decay = 0.1}),
                           strategies::parse_strategy(nlohmann::json::parse(s)),
                           {.group = g, .grad_clip = 1.0});
}

double step_of(strategies::Trainer& t, int64_t step) {
  const auto& ctx = t.context();
  return t.train_step(batch(step, ctx ? ctx->data_world() : 1, ctx ? ctx->data_rank() : 0));
}

double exchange(double v, int root) {  // bit-exact, over the world
  Tensor t = from_vector(std::vector<int64_t>{std::bit_cast<int64_t>(v)}, {1});
  dist::ProcessGroup::world()->broadcast(t, root)->wait();
  return std::bit_cast<double>(t.to_vector<int64_t>()[0]);
}

// A layout to load a checkpoint into: `ranks` ranks (the first of the world) under `strategy`.
struct Layout {
  int ranks;
  std::string strategy;
};

// Loads the checkpoint at `dir` (saved at step 2 under layouts[0], the next loss `next_loss`) into
// each layout, on a model of `layers` blocks initialised otherwise: every region a rank holds
// equals `saved` bitwise, and the next step's loss is `next_loss`, bitwise in the saving layout,
// within 1e-5 relative in another. Collective over the world.
void expect_loads(const std::string& dir, const char* hash, int64_t layers,
                  const std::map<std::string, Tensor>& saved, double next_loss,
                  const std::vector<Layout>& layouts) {
  auto world = dist::ProcessGroup::world();
  for (const Layout& l : layouts) {
    const std::string what = std::to_string(l.ranks) + " ranks " + l.strategy;
    if (world->rank() < l.ranks) {
      auto t = trainer(make_model(99, layers), l.strategy, first(l.ranks));
      const Metadata meta = load_trainer(dir, *t, hash);
      EXPECT_EQ(meta.step, 2) << what;
      expect_holds(*t, saved, what);
      const double loss = step_of(*t, 2);
      if (l.strategy == layouts.front().strategy) {
        EXPECT_EQ(loss, next_loss) << what;
      } else {
        EXPECT_NEAR(loss, next_loss, 1e-5 * std::abs(next_loss)) << what;
      }
    }
    world->barrier()->wait();
  }
}

const char* const kTp2Zero2 =
    R"([{"name": "tensor_parallel", "config": {"size": 2}}, {"name": "zero2"}])";

TEST(TensorParallelCheckpoint, SavedAtTp2Dp2LoadsIntoEveryLayout) {
  auto world = dist::ProcessGroup::world();
  if (world->size() != 4) GTEST_SKIP() << "tp2 x dp2 needs 4 ranks";
  const int rank = world->rank();
  for (int n : {1, 2, 4}) first(n);  // collective: every rank makes them in the same order
  const std::string root = job_dir("tp");
  double next_loss = 0;
  {
    auto t = trainer(make_model(7), kTp2Zero2, first(4));
    for (int64_t s = 0; s < 2; ++s) step_of(*t, s);
    save_trainer(root, 2, *t, kHash, {{"note", "tp"}});
    next_loss = step_of(*t, 2);
  }
  next_loss = exchange(next_loss, 0);
  const std::string dir = *resolve(root);
  const std::map<std::string, Tensor> saved = read_whole(dir);
  for (const TensorInfo& t : read_metadata(dir).tensors) {
    if (t.param == "transformer.wte.weight") {
      EXPECT_EQ(t.shape, (Shape{kVocab, 32})) << t.name;
    }
  }
  EXPECT_EQ(saved.count("lm_head.weight"), 0u) << "the head is tied to wte";

  expect_loads(dir, kHash, 2, saved, next_loss,
               {{4, kTp2Zero2},
                {4, R"([{"name": "zero2"}])"},
                {4, R"([{"name": "tensor_parallel", "config": {"size": 4}}])"},
                {2, R"([{"name": "tensor_parallel", "config": {"size": 2}}])"},
                {1, "[]"}});

  // The export: every parameter whole, the embedding's 61 rows and nothing of the padding.
  if (rank == 0) {
    const std::string out = root + "-export.safetensors";
    export_safetensors(dir, out);
    const io::SafetensorsFile f = io::load_safetensors(out);
    const Tensor& wte = f.at("transformer.wte.weight");
    EXPECT_EQ(wte.shape(), (Shape{kVocab, 32}));
    EXPECT_EQ(wte.to_vector<float>(), saved.at("transformer.wte.weight").to_vector<float>());
    for (const auto& [name, t] : f.tensors) {
      EXPECT_EQ(t.to_vector<float>(), saved.at(name).to_vector<float>()) << name;
    }
    std::filesystem::remove(out);
  }
  remove_job_dir(root);
}

std::string pp(int p, const std::string& extra, const std::string& more = "") {
  return R"([{"name": "pipeline_parallel", "config": {"size": )" + std::to_string(p) + extra +
         "}}" + more + "]";
}

TEST(PipelineCheckpoint, SavedAtPp2Dp2LoadsIntoEveryLayout) {
  auto world = dist::ProcessGroup::world();
  if (world->size() != 4) GTEST_SKIP() << "pp2 x dp2 needs 4 ranks";
  for (int n : {1, 2, 4}) first(n);  // collective: every rank makes them in the same order
  const std::string root = job_dir("pp");
  const std::string saving = pp(2, R"(, "micro_batches": 2)", R"(, {"name": "zero1"})");
  double next_loss = 0;
  {
    auto t = trainer(make_model(7, 4), saving, first(4));
    for (int64_t s = 0; s < 2; ++s) step_of(*t, s);
    save_trainer(root, 2, *t, kPpHash, {{"note", "pp"}});
    next_loss = step_of(*t, 2);
  }
  next_loss = exchange(next_loss, 0);
  const std::string dir = *resolve(root);
  const std::map<std::string, Tensor> saved = read_whole(dir);
  EXPECT_EQ(saved.count("lm_head.weight"), 0u) << "the head is tied to wte";
  EXPECT_EQ(saved.count("transformer.h.3.mlp.c_fc.weight"), 1u) << "the last stage's blocks";

  expect_loads(dir, kPpHash, 4, saved, next_loss,
               {{4, saving},
                {4, R"([{"name": "zero1"}])"},
                {4, pp(4, R"(, "micro_batches": 4)")},
                {2, pp(2, R"(, "virtual": 2, "micro_batches": 2)")},
                {1, "[]"}});
  remove_job_dir(root);
}

}  // namespace
}  // namespace acc::ckpt
