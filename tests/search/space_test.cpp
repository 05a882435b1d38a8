// The candidate space built from the methods' declarations, and the memory predicted for each
// candidate against the tracked allocator's measured peak (one process here; several ranks in
// space_mpi_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/search/cost.hpp"
#include "acc/search/dry_run.hpp"
#include "acc/search/space.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc::search {
namespace {

SpaceOptions opts(int world, int64_t batch, bool bf16 = false,
                  std::vector<std::string> excluded = {}, std::vector<std::string> included = {}) {
  SpaceOptions o;
  o.world = world;
  o.global_batch = batch;
  o.seq_len = 32;
  o.allow_bf16 = bf16;
  o.excluded = std::move(excluded);
  o.included = std::move(included);
  return o;
}

std::string error_of(const SpaceOptions& o, int64_t blocks = 4) {
  return test::error_of<ValueError>([&] { enumerate_candidates(o, blocks); });
}

TEST(Space, OneRankSpaceHasNoGradSyncAndEveryOtherCombination) {
  const auto cands = enumerate_candidates(opts(1, 8), 4);
  // checkpoint: none, half, all, selective (4) x grad_accum: none, 2, 4, 8 (4); amp not allowed.
  EXPECT_EQ(cands.size(), 16u);
  std::set<std::string> seen;
  for (const auto& c : cands) {
    EXPECT_TRUE(seen.insert(c.describe()).second) << "twice: " << c.describe();
    for (const auto& m : c.strategy) {
      EXPECT_NE(m.name, "ddp");
      EXPECT_NE(m.name, "amp");
    }
    EXPECT_EQ(c.micro_batch * c.effects.micro_batches, 8);
  }
  EXPECT_TRUE(seen.count("single process"));
  EXPECT_TRUE(seen.count("checkpoint{\"blocks\":\"all\"} + grad_accum{\"steps\":8}"));
  EXPECT_TRUE(seen.count("checkpoint{\"kind\":\"selective\"}"));
}

TEST(Space, SeveralRanksAlwaysSynchroniseGradients) {
  const auto cands = enumerate_candidates(opts(2, 8, true), 4);
  // grad_sync: ddp x2 buckets, zero1 x2, zero2 x2, fsdp (7) x amp (2) x checkpoint (4) x
  // grad_accum on 4 per rank: none, 2, 4 (3).
  EXPECT_EQ(cands.size(), 7u * 2 * 4 * 3);
  for (const auto& c : cands) {
    int sync = 0;
    for (const auto& m : c.strategy) {
      sync += m.name == "ddp" || m.name == "zero1" || m.name == "zero2" || m.name == "fsdp";
    }
    EXPECT_EQ(sync, 1) << c.describe();
  }
  const auto only_fsdp_amp =
      enumerate_candidates(opts(2, 8, true, {"ddp", "zero1", "zero2"}, {"amp"}), 4);
  EXPECT_EQ(only_fsdp_amp.size(), 4u * 3);
  for (const auto& c : only_fsdp_amp) {
    EXPECT_EQ(c.strategy.front().name, "fsdp");
    EXPECT_TRUE(c.effects.bf16_communication);
  }
}

TEST(Space, BadOptionsNameTheValue) {
  EXPECT_EQ(error_of(opts(2, 7)), "search: global batch 7 does not split evenly over 2 ranks");
  EXPECT_NE(error_of(opts(1, 8, false, {"pipeline_parallel"}))
                .find("unknown method 'pipeline_parallel' in excluded (known: ddp, zero1"),
            std::string::npos);
  EXPECT_EQ(error_of(opts(1, 8, false, {}, {"amp"})),
            "search: included method 'amp' cannot be tried: bf16 is not allowed (allow_bf16)");
  EXPECT_NE(error_of(opts(2, 8, false, {"ddp", "zero1", "zero2", "fsdp"}))
                .find("no method of slot 'grad_sync' can be tried"),
            std::string::npos);
  EXPECT_EQ(error_of(opts(1, 0)), "search: global batch must be >= 1, got 0");
  EXPECT_NE(error_of(opts(1, 8, true, {"amp"}, {"amp"})).find("both excluded and included"),
            std::string::npos);
}

nlohmann::json tiny_gpt() {
  return {{"n_layer", 4}, {"n_head", 4}, {"n_embd", 64}, {"vocab_size", 256}, {"block_size", 64}};
}

// Every one-rank candidate's predicted peak against the measured one (AdamW, 2 steps).
TEST(MemoryModel, OneRankPredictionsMatchTheMeasuredPeak) {
  const int64_t T = 32, B = 8;
  auto model = models::create_model("gpt", tiny_gpt());
  MemoryModel mm("gpt", tiny_gpt(), T);
  const auto cands = enumerate_candidates(opts(1, B), mm.num_blocks());
  std::vector<int64_t> idx(B * T);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>((i * 37) % 256);
  data::Batch batch{from_vector(idx, {B, T}), from_vector(idx, {B, T})};
  double worst = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> peaks;  // predicted, measured
  for (const auto& c : cands) {
    const MemoryPrediction p = mm.predict(c);
    const DryRunResult r = dry_run(*model, optim::AdamW::factory({.lr = 1e-3}), c, batch, nullptr,
                                   {.warmup_steps = 1, .measured_steps = 1});
    ASSERT_EQ(r.status, search::Status::kOk) << c.describe() << ": " << r.error;
    const double err = std::abs(static_cast<double>(p.peak - r.peak_bytes)) / r.peak_bytes;
    worst = std::max(worst, err);
    EXPECT_LE(err, 0.05) << c.describe() << ": predicted " << p.peak << ", measured "
                         << r.peak_bytes;
    peaks[c.describe()] = {p.peak, r.peak_bytes};
  }
  std::printf("one rank: %zu candidates, worst peak error %.2f%%\n", cands.size(), 100 * worst);
  // Selective recomputation (the attention cores) sits between none and whole blocks, predicted
  // and measured: it drops what the cores save and keeps the rest.
  const auto none = peaks.at("single process"), full = peaks.at("checkpoint{\"blocks\":\"all\"}"),
             selective = peaks.at("checkpoint{\"kind\":\"selective\"}");
  std::printf(
      "peak bytes predicted/measured: none %lld/%lld, selective %lld/%lld, full %lld/%lld\n",
      static_cast<long long>(none.first), static_cast<long long>(none.second),
      static_cast<long long>(selective.first), static_cast<long long>(selective.second),
      static_cast<long long>(full.first), static_cast<long long>(full.second));
  EXPECT_LT(selective.second, none.second);
  EXPECT_GT(selective.second, full.second);
  EXPECT_LT(selective.first, none.first);
  EXPECT_GT(selective.first, full.first);
}

}  // namespace
}  // namespace acc::search

namespace acc::search {
namespace {

// The time model on a made-up machine (every GEMM at 100 GFLOP/s, 20 GB/s, collectives 50 us +
// 1 ns/byte): what each effect does to the predicted step.
TEST(CostModel, EffectsMoveThePredictionTheWayTheyShould) {
  const nlohmann::json config = tiny_gpt();
  const int64_t T = 32;
  MachineCalibration m;
  m.memory_gbps = 20;
  for (const auto& s : CostModel::shapes_to_measure("gpt", config, {1, 2, 4, 8}, T)) {
    m.gemm_gflops[s] = 100;
  }
  CommCalibration comm;
  comm.world = 2;
  for (const char* op : {"allreduce", "reduce_scatter", "allgather", "broadcast"}) {
    comm.ops[op] = {50e-6, 1e-9};
  }
  CostModel cm("gpt", config, T, m, comm);
  const auto cands = enumerate_candidates(opts(2, 8, true), 4);
  auto find = [&](const std::string& name) {
    for (const auto& c : cands) {
      if (c.describe() == name) return cm.predict(c);
    }
    ADD_FAILURE() << "no candidate " << name;
    return TimePrediction{};
  };
  const TimePrediction ddp = find("ddp"), amp = find("ddp + amp"),
                       ckpt = find("ddp + checkpoint{\"blocks\":\"all\"}"), zero1 = find("zero1"),
                       fsdp = find("fsdp");
  EXPECT_GT(ddp.compute_s, 0);
  EXPECT_GT(ddp.comm_s, 0);
  EXPECT_NEAR(ddp.step_s, ddp.compute_s + ddp.optimizer_s + ddp.exposed_comm_s, 1e-12);
  EXPECT_LT(amp.comm_s, ddp.comm_s);         // bf16 gradients: half the bytes
  EXPECT_GT(ckpt.compute_s, ddp.compute_s);  // the forward again in backward
  // The attention cores again in backward: more than none, less than whole blocks.
  const TimePrediction selective = find("ddp + checkpoint{\"kind\":\"selective\"}");
  EXPECT_GT(selective.compute_s, ddp.compute_s);
  EXPECT_LT(selective.compute_s, ckpt.compute_s);
  EXPECT_LT(zero1.optimizer_s, ddp.optimizer_s);       // half the optimizer state per rank
  EXPECT_GT(zero1.comm_s, ddp.comm_s);                 // plus the parameters' all-gather
  EXPECT_GT(fsdp.exposed_comm_s, ddp.exposed_comm_s);  // gathers before every block, waited for
  // One rank: no communication at all.
  CostModel one("gpt", config, T, m, CommCalibration{});
  for (const auto& c : enumerate_candidates(opts(1, 8), 4)) {
    const TimePrediction t = one.predict(c);
    EXPECT_EQ(t.comm_s, 0) << c.describe();
  }
}

}  // namespace
}  // namespace acc::search
