// The memory model against the measured peak for every candidate of the data-parallel space and
// the tensor- and sequence-parallel layouts with each gradient synchronisation (below), at
// whatever world size mpirun gives (CTest: 1, 2 and 4 ranks): within 5% for every candidate.
// fsdp keeps one block's reduce-scatter in flight while the next block's backward runs
// (strategies/fsdp.cpp, kReducesInFlight) and holds its input until it waits for it there, so the
// step's peak does not depend on how fast the peers are. When that input was freed as the
// reduction completed, fsdp's peaks moved with the ranks' scheduling and were held to 10% (20%
// over under Ulysses at 4 ranks on 2 cores with every block recomputed: +15.3% measured twice on
// 2026-11-29). Before the bound on reductions in flight, a rank running ahead of ranks that share
// its cores held every block's buffer: -28% at 4 ranks on 2 cores.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <thread>

#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/optim/sgd.hpp"
#include "acc/search/dry_run.hpp"
#include "acc/search/space.hpp"
#include "acc/trace/passes.hpp"

namespace acc::search {
namespace {

// The small GPT these tests dry-run, and the space of `world` ranks over a global batch of 8 x 32.
constexpr int64_t kSeq = 32, kGlobalBatch = 8;
const nlohmann::json& small_gpt() {
  static const nlohmann::json config = {
      {"n_layer", 4}, {"n_head", 4}, {"n_embd", 64}, {"vocab_size", 256}, {"block_size", 64}};
  return config;
}
SpaceOptions space_of(int world) {
  SpaceOptions so;
  so.world = world;
  so.global_batch = kGlobalBatch;
  so.seq_len = kSeq;
  return so;
}

TEST(MemoryModel, EveryCandidatesPredictedPeakIsWithinFivePercent) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size();
  const int64_t T = kSeq;
  const nlohmann::json& config = small_gpt();
  auto model = models::create_model("gpt", config);
  MemoryModel mm("gpt", config, T);
  SpaceOptions so = space_of(W);
  so.allow_bf16 = true;
  const auto cands = enumerate_candidates(so, mm.num_blocks());
  // A rank's batch: global / dp samples (tp and cp ranks read the same ones).
  auto batch_of = [&](int64_t b) {
    std::vector<int64_t> idx(static_cast<size_t>(b * T));
    for (size_t i = 0; i < idx.size(); ++i) {
      idx[i] = static_cast<int64_t>((i * 37 + static_cast<size_t>(world->rank()) * 11) % 256);
    }
    return data::Batch{from_vector(idx, {b, T}), from_vector(idx, {b, T})};
  };
  double worst = 0, worst_fsdp = 0;
  std::string worst_name, worst_fsdp_name;
  int64_t tried = 0;
  for (const auto& c : cands) {
    // The tensor- and sequence-parallel layouts with every gradient synchronisation, whole or
    // every block recomputed, in fp32 and one micro-batch (all 840 candidates at 2 ranks were
    // within the bounds on 2026-11-27, worst -2.4 %, in 80 s: too long for every CI run).
    const strategies::StepEffects& e = c.effects;
    if (!c.layout_key().empty() &&
        (e.micro_batches > 1 || e.bf16_communication || e.selective_recompute ||
         (e.recompute_blocks != 0 && e.recompute_blocks != -1 &&
          e.recompute_blocks < mm.num_blocks()))) {
      continue;
    }
    ++tried;
    const MemoryPrediction p = mm.predict(c);
    const data::Batch batch = batch_of(c.per_rank_batch);
    const DryRunResult r = dry_run(*model, optim::AdamW::factory({.lr = 1e-3}), c, batch, world,
                                   {.warmup_steps = 1, .measured_steps = 1});
    ASSERT_EQ(r.status, search::Status::kOk) << c.describe() << ": " << r.error;
    // The time blocked in Work::wait, least and most over the ranks; a tensor-parallel step
    // waits on every forward all-reduce of its blocks.
    EXPECT_GE(r.wait_seconds_min, 0) << c.describe();
    EXPECT_LE(r.wait_seconds_min, r.wait_seconds_max) << c.describe();
    if (c.mesh.tp > 1) {
      EXPECT_GT(r.wait_seconds_max, 0) << c.describe();
    }
    const double err = static_cast<double>(p.peak - r.peak_bytes) / r.peak_bytes;
    const bool fsdp = c.effects.shard_parameters;
    if (std::abs(err) > std::abs(fsdp ? worst_fsdp : worst)) {
      (fsdp ? worst_fsdp : worst) = err;
      (fsdp ? worst_fsdp_name : worst_name) = c.describe();
    }
    EXPECT_LE(std::abs(err), 0.05) << c.describe() << ": predicted " << p.peak << ", measured "
                                   << r.peak_bytes << " (" << p.to_json().dump() << ")";
  }
  if (world->rank() == 0) {
    std::printf(
        "%d rank(s): %lld of %zu candidates, worst peak error %+.2f%% (%s); fsdp's worst "
        "%+.2f%% (%s)\n",
        W, static_cast<long long>(tried), cands.size(), 100 * worst, worst_name.c_str(),
        100 * worst_fsdp, worst_fsdp_name.c_str());
  }
}

// The user's optimizer sets the state the model charges: SGD with momentum keeps one buffer a
// parameter, AdamW two (optim::optimizer_state_buffers of the factory). Each prediction holds for
// its own optimizer within 5 % on a whole, a sharded (zero2) and, from 2 ranks, a pipelined
// candidate, and the two differ by one buffer of the state each rank holds.
TEST(MemoryModel, TheOptimizersStateIsTheUsersOwn) {
  auto world = dist::ProcessGroup::world();
  const int64_t T = kSeq;
  const nlohmann::json& config = small_gpt();
  auto model = models::create_model("gpt", config);
  const SpaceOptions so = space_of(world->size());
  auto batch_of = [&](int64_t b) {
    std::vector<int64_t> idx(static_cast<size_t>(b * T));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>((i * 37) % 256);
    return data::Batch{from_vector(idx, {b, T}), from_vector(idx, {b, T})};
  };
  struct Optimizer {
    optim::OptimizerFactory factory;
    int buffers;
  };
  const std::vector<Optimizer> optimizers = {
      {optim::SGD::factory({.lr = 1e-2, .momentum = 0.9}), 1},
      {optim::AdamW::factory({.lr = 1e-3}), 2}};
  std::map<std::string, std::vector<int64_t>> predicted;  // candidate -> per optimizer
  for (const Optimizer& opt : optimizers) {
    ASSERT_EQ(optim::optimizer_state_buffers(opt.factory), opt.buffers);
    MemoryModel mm("gpt", config, T, trace::optimizer_with_state_buffers(opt.buffers));
    for (const auto& c : enumerate_candidates(so, mm.num_blocks())) {
      const std::string name = c.describe();
      const bool wanted = name == "single process" || name == "ddp" || name == "zero2" ||
                          name == "ddp + pipeline_parallel{\"micro_batches\":4,\"size\":2}";
      if (!wanted) continue;
      const MemoryPrediction p = mm.predict(c);
      const DryRunResult r = dry_run(*model, opt.factory, c, batch_of(c.per_rank_batch), world,
                                     {.warmup_steps = 1, .measured_steps = 1});
      ASSERT_EQ(r.status, search::Status::kOk) << name << ": " << r.error;
      const double err = static_cast<double>(p.peak - r.peak_bytes) / r.peak_bytes;
      EXPECT_LE(std::abs(err), 0.05) << name << " with " << opt.buffers << " buffer(s): predicted "
                                     << p.peak << ", measured " << r.peak_bytes;
      predicted[name].push_back(p.optimizer_state);
      if (std::getenv("ACC_TEST_VERBOSE") && world->rank() == 0) {
        std::printf("%-60s %d buffer(s): predicted %lld measured %lld (%+.1f%%)\n", name.c_str(),
                    opt.buffers, static_cast<long long>(p.peak),
                    static_cast<long long>(r.peak_bytes), 100 * err);
      }
    }
  }
  ASSERT_FALSE(predicted.empty());
  for (const auto& [name, state] : predicted) {
    ASSERT_EQ(state.size(), 2u) << name;
    EXPECT_GT(state[0], 0) << name;
    EXPECT_EQ(state[1], 2 * state[0]) << name << ": AdamW keeps twice SGD-with-momentum's state";
  }
}

// fsdp over tensor parallelism with fewer kv heads than ranks (Llama, one kv head, tp over the
// world): each kv head's weights are held by several ranks and their gradient summed over them.
// That sum was copy_to_group's in the forward, whose identity (a tensor of its own on the weight's
// storage) linear saved for backward: every block's gathered parameters stayed alive through the
// forward after fsdp released them, -7.3 % (-12.3 % with grad_accum 8) at tp 2 against this
// prediction on 2026-11-30, -11.2 % at tp 4 over two kv heads. With a gradient hook on the
// parameter instead (strategies/tp_layers.cpp), within 5 % whole, in amp and accumulating.
TEST(MemoryModel, FsdpOverKvHeadsSharedByTensorParallelRanksIsWithinFivePercent) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size();
  if (W < 2) GTEST_SKIP() << "kv heads shared by tensor-parallel ranks need 2 ranks";
  const int64_t T = kSeq;
  const nlohmann::json config = {{"hidden_size", 64},
                                 {"intermediate_size", 176},
                                 {"num_hidden_layers", 4},
                                 {"num_attention_heads", 4},
                                 {"num_key_value_heads", 1},
                                 {"vocab_size", 256},
                                 {"max_position_embeddings", 64}};
  auto model = models::create_model("llama", config);
  MemoryModel mm("llama", config, T);
  SpaceOptions so = space_of(W);
  so.allow_bf16 = true;
  auto batch_of = [&](int64_t b) {
    std::vector<int64_t> idx(static_cast<size_t>(b * T));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>((i * 37) % 256);
    return data::Batch{from_vector(idx, {b, T}), from_vector(idx, {b, T})};
  };
  const std::string tp = "tensor_parallel{\"size\":" + std::to_string(W) + "}";
  const std::set<std::string> wanted = {"fsdp + " + tp, "fsdp + amp + " + tp,
                                        "fsdp + grad_accum{\"steps\":8} + " + tp};
  std::set<std::string> seen;
  for (const auto& c : enumerate_candidates(so, mm.num_blocks())) {
    if (wanted.count(c.describe()) == 0) continue;
    seen.insert(c.describe());
    const MemoryPrediction p = mm.predict(c);
    const DryRunResult r =
        dry_run(*model, optim::AdamW::factory({.lr = 1e-3}), c, batch_of(c.per_rank_batch), world,
                {.warmup_steps = 1, .measured_steps = 1});
    ASSERT_EQ(r.status, search::Status::kOk) << c.describe() << ": " << r.error;
    const double err = static_cast<double>(p.peak - r.peak_bytes) / r.peak_bytes;
    if (std::getenv("ACC_TEST_VERBOSE") && world->rank() == 0) {
      std::printf("%-60s predicted %lld measured %lld (%+.1f%%)\n", c.describe().c_str(),
                  static_cast<long long>(p.peak), static_cast<long long>(r.peak_bytes), 100 * err);
    }
    EXPECT_LE(std::abs(err), 0.05) << c.describe() << ": predicted " << p.peak << ", measured "
                                   << r.peak_bytes << " (" << p.to_json().dump() << ")";
  }
  EXPECT_EQ(seen, wanted);
}

}  // namespace
}  // namespace acc::search

namespace acc::search {
namespace {

// Each pipeline stage's tracked peak against its prediction (MemoryPrediction::stage_peaks), for
// every pipeline candidate with each gradient synchronisation, whole, selective or every block
// recomputed, at each micro-batch count and schedule the search offers (tensor-parallel ones
// included at 4 ranks): the first stage holds its in-flight micro-batches' activations, the last
// the head's. GPT (its tied embedding on the first and the last stage) and Llama.
void expect_stage_peaks(const std::string& type, const nlohmann::json& config) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size();
  const int64_t T = kSeq;
  auto model = models::create_model(type, config);
  MemoryModel mm(type, config, T);
  const SpaceOptions so = space_of(W);
  const auto cands = enumerate_candidates(so, mm.num_blocks());
  const int64_t V = config.value("vocab_size", 0);
  auto batch_of = [&](int64_t b) {
    std::vector<int64_t> idx(static_cast<size_t>(b * T));
    for (size_t i = 0; i < idx.size(); ++i) {
      idx[i] = static_cast<int64_t>((i * 37 + static_cast<size_t>(world->rank()) * 11) % V);
    }
    return data::Batch{from_vector(idx, {b, T}), from_vector(idx, {b, T})};
  };
  double worst = 0;
  std::string worst_name;
  int64_t tried = 0, pairs = 0, within = 0, wide_pairs = 0, wide_within = 0;
  for (const auto& c : cands) {
    const strategies::StepEffects& e = c.effects;
    // Some blocks recomputed (checkpoint{"blocks": k}) was left out until 2026-11-29: interleaved,
    // pp rank 0 was +6.2 %, -8.7 %, -5.0 % off at 2 ranks (GPT), as the model added a moment's
    // in-flight activations to the trace's peak wherever that peak fell, while a recomputed
    // stage's transient comes at its own backward, among other in-flight counts. Each action of
    // the schedule is now priced from the trace's timeline over its own stage (stage_highs):
    // these models' ranks (2 blocks each) are traced whole, which a rank of several stages needs
    // for that; a deeper one of several stages keeps the former model (MemoryModel::predict_rank).
    if (c.mesh.pp == 1) continue;
    bool buckets = false;  // the bucket sizes' variants hold the same memory here
    for (const auto& m : c.strategy()) buckets |= m.config.contains("bucket_mb");
    if (buckets || mm.layout_refusal(c)) continue;
    // ACC_TEST_ONLY=<text>: only the candidates whose description holds it (to look at one).
    if (const char* only = std::getenv("ACC_TEST_ONLY");
        only != nullptr && c.describe().find(only) == std::string::npos) {
      continue;
    }
    // More ranks than cores (CTest's 4 on 2 cores): ddp and zero2, whole or all recomputed (zero1
    // and selective recomputation lie between; every one of them was run on 2026-11-27 within
    // the bounds below, 62 s on 2 cores).
    if (W > static_cast<int>(std::thread::hardware_concurrency()) &&
        (e.selective_recompute ||
         std::any_of(c.strategy().begin(), c.strategy().end(),
                     [](const strategies::Method& m) { return m.name == "zero1"; }))) {
      continue;
    }
    ++tried;
    const MemoryPrediction p = mm.predict(c);
    ASSERT_EQ(p.stage_peaks.size(), static_cast<size_t>(c.mesh.pp)) << c.describe();
    const DryRunResult r =
        dry_run(*model, optim::AdamW::factory({.lr = 1e-3}), c, batch_of(c.per_rank_batch), world,
                {.warmup_steps = 1, .measured_steps = 1});
    ASSERT_EQ(r.status, search::Status::kOk) << c.describe() << ": " << r.error;
    ASSERT_EQ(r.rank_step_peak_bytes.size(), static_cast<size_t>(W));
    for (int rank = 0; rank < W; ++rank) {
      const int stage = c.mesh.coordinate_of(rank).pp;
      const int64_t predicted = p.stage_peaks[static_cast<size_t>(stage)];
      const int64_t measured = r.rank_step_peak_bytes[static_cast<size_t>(rank)];
      const double err = static_cast<double>(predicted - measured) / static_cast<double>(measured);
      if (std::abs(err) > std::abs(worst)) {
        worst = err;
        worst_name = c.describe() + " pp rank " + std::to_string(stage);
      }
      if (std::getenv("ACC_TEST_VERBOSE") && world->rank() == 0) {
        std::printf("%-90s rank %d: predicted %lld measured %lld (%+.1f%%)\n", c.describe().c_str(),
                    rank, static_cast<long long>(predicted), static_cast<long long>(measured),
                    100 * err);
      }
      // 5 % whenever the ranks have a core each: 1F1B and interleaved stages (each stage's saved
      // and gradient bytes from the trace's per-block figures and the model's ends, its in-flight
      // micro-batches and held gradients from the schedule's list, each action's own excess from
      // the trace's timeline over its stage: MemoryModel::predict_rank), none, some, selective
      // or every block recomputed, Ulysses and tensor parallelism inside the stages. On
      // 2026-11-29 at 2 ranks: 288 of 288 pairs (GPT and Llama, -2.1 % to +1.7 %). More ranks
      // than cores (4 on this 2-core machine) are held to -6 % / +7 %: when a posted receive or
      // a deferred send completes depends on how the ranks share the cores. At 4 ranks on
      // 2026-11-29: 1,152 of 1,152 pairs within 5 % (worst +4.9 %).
      const bool wide = W > static_cast<int>(std::thread::hardware_concurrency());
      ++(wide ? wide_pairs : pairs);
      if (std::abs(err) <= 0.05) ++(wide ? wide_within : within);
      EXPECT_TRUE(wide ? err >= -0.06 && err <= 0.07 : std::abs(err) <= 0.05)
          << c.describe() << " rank " << rank << " (pp rank " << stage << "): predicted "
          << predicted << ", measured " << measured << " (" << p.to_json().dump() << ")";
    }
  }
  if (W > 1) {
    EXPECT_GT(tried, 0);
  }
  if (world->rank() == 0) {
    std::printf(
        "%s at %d rank(s): %lld pipeline candidates; (candidate, rank) pairs within 5 %%: %lld of "
        "%lld (a core a rank), %lld of %lld (more ranks than cores); worst "
        "%+.2f%% (%s)\n",
        type.c_str(), W, static_cast<long long>(tried), static_cast<long long>(within),
        static_cast<long long>(pairs), static_cast<long long>(wide_within),
        static_cast<long long>(wide_pairs), 100 * worst, worst_name.c_str());
  }
}

TEST(MemoryModel, EveryPipelineStagesPeakIsWithinFivePercentGpt) {
  expect_stage_peaks("gpt", small_gpt());
}

TEST(MemoryModel, EveryPipelineStagesPeakIsWithinFivePercentLlama) {
  expect_stage_peaks("llama", {{"hidden_size", 64},
                               {"intermediate_size", 176},
                               {"num_hidden_layers", 4},
                               {"num_attention_heads", 4},
                               {"num_key_value_heads", 2},
                               {"vocab_size", 256},
                               {"max_position_embeddings", 64}});
}

}  // namespace
}  // namespace acc::search
