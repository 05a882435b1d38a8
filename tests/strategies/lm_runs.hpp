#pragma once
// Training runs of the zoo's language models for the parallel methods' equivalence tests
// (tp_strategy_test, ulysses_test, selective_recompute_test): a learnable synthetic token stream,
// a run of AdamW steps under a strategy with its losses, gradient norms, gathered parameters and
// placement table, and the comparisons with one process.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "acc/data/token_data.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/random.hpp"

namespace acc::test {

/// This rank alone (a split of the world: collective the first time, so every rank calls it
/// before anything that depends on the world's ranks).
inline dist::ProcessGroupPtr self_group() {
  static dist::ProcessGroupPtr g = [] {
    auto w = dist::ProcessGroup::world();
    return w->split(w->rank(), 0, "self");
  }();
  return g;
}

inline int world() {
  return dist::ProcessGroup::world()->size();
}

/// `n` ids below `vocab`, learnable: mostly the successor v[i] = (v[i - 1] * mul + add) % vocab,
/// every fourth-ish one (by an LCG seeded with `seed`) random.
inline std::shared_ptr<const data::TokenFile> synthetic_tokens(size_t n, int64_t vocab,
                                                               uint32_t seed, uint32_t mul,
                                                               uint32_t add) {
  std::vector<uint32_t> v(n);
  const auto V = static_cast<uint32_t>(vocab);
  uint32_t x = seed;
  for (size_t i = 0; i < v.size(); ++i) {
    x = x * 1103515245u + 12345u;
    v[i] = (x >> 16) % 4 == 0 ? (x >> 8) % V : (i == 0 ? 0 : (v[i - 1] * mul + add) % V);
  }
  return std::make_shared<const data::TokenFile>(std::move(v), "<synthetic>", V);
}

/// The learnable stream below `vocab` (synthetic_tokens, seed 4321) of `n` ids, made once per
/// (vocab, n) and shared by every run that reads it.
inline std::shared_ptr<const data::TokenFile> learnable_tokens(int64_t vocab, size_t n) {
  static std::map<std::pair<int64_t, size_t>, std::shared_ptr<const data::TokenFile>> files;
  auto& t = files[{vocab, n}];
  if (!t) t = synthetic_tokens(n, vocab, 4321, 5, 1);
  return t;
}

struct ModelSpec {
  std::string type;
  nlohmann::json config;
};

/// A GPT of `layers` blocks, hidden size 32 and 4 heads (tp 2 and 4 split them; the MLP widths
/// divide by 4), no biases: a key bias has an exactly-zero gradient whose fp32 noise Adam
/// amplifies into any tolerance (equivalence_test.cpp says the same).
inline ModelSpec tiny_gpt(int64_t layers, int64_t vocab, int64_t block_size, double dropout) {
  return {"gpt",
          {{"n_layer", layers},
           {"n_head", 4},
           {"n_embd", 32},
           {"vocab_size", vocab},
           {"block_size", block_size},
           {"bias", false},
           {"dropout", dropout}}};
}

/// A 2-layer Llama of hidden size 32 with 4 query heads over `kv` key/value heads (kv 2:
/// grouped-query attention, 2 query heads each).
inline ModelSpec tiny_llama(int kv, int64_t vocab, int64_t max_positions) {
  return {"llama",
          {{"hidden_size", 32},
           {"intermediate_size", 48},
           {"num_hidden_layers", 2},
           {"num_attention_heads", 4},
           {"num_key_value_heads", kv},
           {"vocab_size", vocab},
           {"max_position_embeddings", max_positions}}};
}

/// How a run trains: the global batch (split over the trainer's data-parallel ranks: tp and cp
/// ranks read the same samples), its sequence length, the steps, the seeds of the model's build
/// (manual_seed, then a Generator) and the user's loss (none: the model's own).
struct RunOptions {
  std::shared_ptr<const data::TokenFile> tokens;
  int64_t global_batch = 4;
  int64_t seq_len = 16;
  int64_t steps = 8;
  uint64_t manual_seed = 11;
  uint64_t model_seed = 5;
  strategies::LossFn loss = nullptr;
};

struct TrainRun {
  std::vector<double> losses, norms;
  std::vector<std::pair<std::string, Tensor>> params;  // full_parameters() after the last step
  dist::PlacementTable table;                          // placements() after the last step
};

/// The trainer's data-parallel share of each global batch.
inline data::BatchLoader loader_for(const strategies::Trainer& trainer, const RunOptions& o) {
  const int dp_rank = trainer.context() ? trainer.context()->data_rank() : 0;
  const int dp = trainer.context() ? trainer.context()->data_world() : 1;
  return data::BatchLoader(o.tokens, {.batch_size = o.global_batch / dp,
                                      .seq_len = o.seq_len,
                                      .order = data::SampleOrder::kSequential,
                                      .rank = dp_rank,
                                      .world = dp});
}

/// AdamW (lr 1e-2, betas 0.9/0.95, weight decay 0.1) and clipping at 1.0 under `strategy_json`.
/// One model with dropout trains at a time (they share the generator its dropout draws from).
inline std::unique_ptr<strategies::Trainer> make_trainer(const ModelSpec& spec,
                                                         const std::string& strategy_json,
                                                         const dist::ProcessGroupPtr& group,
                                                         const RunOptions& o) {
  manual_seed(o.manual_seed);
  // The model's dropout layers keep the generator they were built with and draw from it while
  // training: it must outlive the trainer, so it lives here, re-seeded for every model.
  static Generator gen;
  gen.set_state(o.model_seed, 0);
  models::LanguageModelPtr model = models::create_model(spec.type, spec.config, gen);
  const optim::AdamW::Options opts{.lr = 1e-2, .betas = {0.9, 0.95}, .weight_decay = 0.1};
  return strategies::apply(model, optim::AdamW::factory(opts),
                           strategies::parse_strategy(nlohmann::json::parse(strategy_json)),
                           {.group = group, .grad_clip = 1.0, .loss = o.loss});
}

inline TrainRun train_lm(const ModelSpec& spec, const std::string& strategy_json,
                         const dist::ProcessGroupPtr& group, const RunOptions& o) {
  auto trainer = make_trainer(spec, strategy_json, group, o);
  data::BatchLoader loader = loader_for(*trainer, o);
  TrainRun r;
  for (int64_t s = 0; s < o.steps; ++s) {
    r.losses.push_back(trainer->train_step(loader.next()));
    r.norms.push_back(trainer->last_grad_norm());
  }
  r.params = trainer->full_parameters();
  r.table = trainer->placements();
  return r;
}

/// Every step's loss and gradient norm within `rel` relative, and (with `param_abs` >= 0) every
/// final parameter element within param_abs + 1e-4 |p| of `want`'s. rel 0 and param_abs 0 with
/// `bitwise`: equal bit for bit.
inline void expect_same_training(const TrainRun& got, const TrainRun& want, double rel,
                                 double param_abs, bool bitwise = false) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) {
    if (bitwise) {
      EXPECT_EQ(got.losses[i], want.losses[i]) << "loss, step " << i;
      EXPECT_EQ(got.norms[i], want.norms[i]) << "grad norm, step " << i;
      continue;
    }
    EXPECT_NEAR(got.losses[i], want.losses[i], rel * std::abs(want.losses[i])) << "step " << i;
    if (param_abs >= 0) {
      EXPECT_NEAR(got.norms[i], want.norms[i], rel * want.norms[i] + 1e-7)
          << "grad norm, step " << i;
    }
  }
  if (param_abs < 0) return;
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    const auto& [name, p] = got.params[i];
    const auto& [ref_name, ref] = want.params[i];
    ASSERT_EQ(name, ref_name);
    ASSERT_EQ(p.shape(), ref.shape()) << name;
    const auto a = p.contiguous().to_vector<float>(), b = ref.contiguous().to_vector<float>();
    if (bitwise) {
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << name << " differs bitwise";
      continue;
    }
    double worst = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      worst = std::max(worst, std::abs(a[k] - b[k]) - (param_abs + 1e-4 * std::abs(b[k])));
    }
    EXPECT_LE(worst, 0.0) << name << ": beyond " << param_abs << " + 1e-4 |p| by " << worst;
  }
}

/// `b` with targets ignored (-100, acc::cross_entropy's ignore index) unevenly: the last 5 tokens
/// of sample 0 and tokens 1 and 2 of sample 1 (`seq_len` tokens a sample), so a split of the
/// sequence in two gives the chunks different counts of counted tokens.
inline data::Batch with_uneven_ignored_targets(const data::Batch& b, int64_t seq_len) {
  Tensor targets = b.targets().clone();
  auto v = targets.to_vector<int64_t>();
  for (int64_t t = seq_len - 5; t < seq_len; ++t) v[static_cast<size_t>(t)] = -100;
  v[static_cast<size_t>(seq_len + 1)] = v[static_cast<size_t>(seq_len + 2)] = -100;
  return data::Batch(b.idx(), from_vector(v, targets.shape()));
}

}  // namespace acc::test
