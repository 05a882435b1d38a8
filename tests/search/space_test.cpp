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
#include "acc/trace/batch_traces.hpp"
#include "acc/trace/dump.hpp"
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
    for (const auto& m : c.strategy()) {
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
  // The data-parallel family alone (the layouts are counted in the next test).
  const std::vector<std::string> layouts = {"tensor_parallel", "sequence_parallel",
                                            "pipeline_parallel"};
  const auto cands = enumerate_candidates(opts(2, 8, true, layouts), 4);
  // grad_sync: ddp x2 buckets, zero1 x2, zero2 x2, fsdp (7) x amp (2) x checkpoint (4) x
  // grad_accum on 4 per rank: none, 2, 4 (3).
  EXPECT_EQ(cands.size(), 7u * 2 * 4 * 3);
  for (const auto& c : cands) {
    int sync = 0;
    for (const auto& m : c.strategy()) {
      sync += m.name == "ddp" || m.name == "zero1" || m.name == "zero2" || m.name == "fsdp";
    }
    EXPECT_EQ(sync, 1) << c.describe();
  }
  const auto only_fsdp_amp = enumerate_candidates(
      opts(2, 8, true,
           {"ddp", "zero1", "zero2", "tensor_parallel", "sequence_parallel", "pipeline_parallel"},
           {"amp"}),
      4);
  EXPECT_EQ(only_fsdp_amp.size(), 4u * 3);
  for (const auto& c : only_fsdp_amp) {
    EXPECT_EQ(c.strategy().front().name, "fsdp");
    EXPECT_TRUE(c.effects.bf16_communication);
  }
}

// tensor_parallel and sequence_parallel declare the sizes that divide the world; Megatron-SP
// comes only with tensor_parallel, and tp x cp must divide the world. A candidate's per-rank batch
// is the global batch over its dp ranks (its tp and cp ranks read the same samples).
TEST(Space, LayoutsAreTheSizesThatDivideTheWorld) {
  for (const int world : {2, 4}) {
    std::map<std::string, std::set<int64_t>> layouts;  // layout -> per-rank batches seen
    for (const auto& c : enumerate_candidates(opts(world, 8), 4)) {
      layouts[strategies::describe(strategies::layout_of(c.strategy()))].insert(c.per_rank_batch);
      EXPECT_EQ(c.mesh.product(), world) << c.describe();
      EXPECT_EQ(c.per_rank_batch, 8 / c.mesh.dp) << c.describe();
      EXPECT_EQ(c.data_parallel_ranks(), c.mesh.dp * c.mesh.cp) << c.describe();
      // Made once per mesh by the enumeration, for every candidate of it: its own layout's.
      EXPECT_EQ(c.layout_key(), strategies::layout_key(c.strategy())) << c.describe();
      // Each combination passed the composition rules alone: the whole list parses.
      EXPECT_NO_THROW(strategies::parse_strategy(strategies::to_json(c.strategy())))
          << c.describe();
    }
    std::set<std::string> names;
    for (const auto& [name, batches] : layouts) names.insert(name);
    const std::string tp2 = "tensor_parallel{\"size\":2}", tp4 = "tensor_parallel{\"size\":4}";
    const std::string megatron = "sequence_parallel{\"kind\":\"megatron\"}";
    auto ulysses = [](int s) {
      return "sequence_parallel{\"kind\":\"ulysses\",\"size\":" + std::to_string(s) + "}";
    };
    auto pipe = [](int p, int m, bool interleaved) {
      return "pipeline_parallel{\"micro_batches\":" + std::to_string(m) +
             (interleaved ? ",\"schedule\":\"interleaved\"" : "") +
             ",\"size\":" + std::to_string(p) + (interleaved ? ",\"virtual\":2}" : "}");
    };
    std::set<std::string> want = {"single process", tp2, tp2 + " + " + megatron, ulysses(2)};
    // Pipelines over 4 blocks: m = p, 2p, 4p dividing the rank's batch (8 / dp); interleaved v = 2
    // where every rank holds two stages (p 2); with tp and Megatron-SP, and with Ulysses 2 at 4
    // ranks (pp2 x cp2: the whole batch of 8 on every rank).
    for (const std::string& with :
         std::vector<std::string>{"", tp2 + " + ", tp2 + " + " + megatron + " + "}) {
      if (world == 2 && !with.empty()) continue;
      for (const int m : {2, 4, 8}) {
        if (world == 4 && with.empty() && m == 8) continue;  // pp2 x dp2: 4 samples a rank
        for (const bool interleaved : {false, true}) want.insert(with + pipe(2, m, interleaved));
      }
    }
    if (world == 4) {
      want.insert({tp4, tp4 + " + " + megatron, ulysses(4), tp2 + " + " + ulysses(2)});
      want.insert({pipe(4, 4, false), pipe(4, 8, false)});
      for (const int m : {2, 4, 8}) {
        for (const bool interleaved : {false, true}) {
          want.insert(ulysses(2) + " + " + pipe(2, m, interleaved));
        }
      }
    }
    EXPECT_EQ(names, want) << "world " << world;
    EXPECT_EQ(layouts[tp2], (std::set<int64_t>{8 / (world / 2)})) << "world " << world;
  }
  // Megatron-SP without tensor_parallel is refused by the composition rules, by name.
  const std::string msg = test::error_of<ValueError>([] {
    strategies::parse_strategy(nlohmann::json::parse(
        R"([{"name": "ddp"}, {"name": "sequence_parallel", "config": {"kind": "megatron"}}])"));
  });
  EXPECT_NE(msg.find("add tensor_parallel to the strategy"), std::string::npos) << msg;
}

TEST(Space, BadOptionsNameTheValue) {
  // Issue 34: a batch the world does not divide is planned on the meshes whose dp divides it
  // (tp 2, cp 2 or pp 2 over 2 ranks: dp 1, 7 samples on each rank); without them, refused.
  const auto odd = enumerate_candidates(opts(2, 7), 4);
  ASSERT_FALSE(odd.empty());
  for (const auto& c : odd) {
    EXPECT_EQ(c.mesh.dp, 1) << c.describe();
    EXPECT_EQ(c.per_rank_batch, 7) << c.describe();
  }
  EXPECT_EQ(
      error_of(opts(2, 7, false, {"tensor_parallel", "sequence_parallel", "pipeline_parallel"})),
      "search: global batch 7 does not split evenly over 2 ranks, nor over the dp of any "
      "mesh tried");
  EXPECT_NE(error_of(opts(1, 8, false, {"expert_parallel"}))
                .find("unknown method 'expert_parallel' in excluded (known: ddp, zero1"),
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

// The candidate of `cands` described as `name`.
const Candidate& candidate(const std::vector<Candidate>& cands, const std::string& name) {
  for (const auto& c : cands) {
    if (c.describe() == name) return c;
  }
  throw std::runtime_error("no candidate " + name);
}

// A layout is checked by tracing the model through it (meta groups: no MPI, no ranks): a split
// that does not divide is refused with the transform's own reason, once per layout; one that
// divides is priced from the trace of its rank, whose parameters are its shards.
TEST(MemoryModel, ALayoutIsPricedFromTheTraceOfItsRankAndRefusedWithItsReason) {
  const nlohmann::json six_heads = {
      {"n_layer", 2}, {"n_head", 6}, {"n_embd", 48}, {"vocab_size", 250}, {"block_size", 32}};
  MemoryModel mm("gpt", six_heads, 32);
  const auto cands = enumerate_candidates(opts(4, 8), mm.num_blocks());
  const Candidate& tp4 = candidate(cands, "ddp + tensor_parallel{\"size\":4}");
  const Candidate& tp2 = candidate(cands, "ddp + tensor_parallel{\"size\":2}");
  const Candidate& u4 =
      candidate(cands, "ddp + sequence_parallel{\"kind\":\"ulysses\",\"size\":4}");
  const Candidate& ddp = candidate(cands, "ddp");
  const auto refused = mm.layout_refusal(tp4);
  ASSERT_TRUE(refused.has_value());
  EXPECT_NE(refused->find("6 heads, not a multiple of tp 4"), std::string::npos) << *refused;
  const auto u4_refused = mm.layout_refusal(u4);
  ASSERT_TRUE(u4_refused.has_value());
  EXPECT_NE(u4_refused->find("6"), std::string::npos) << *u4_refused;
  EXPECT_FALSE(mm.layout_refusal(tp2).has_value());
  EXPECT_FALSE(mm.layout_refusal(ddp).has_value());

  // tp2 holds half of every split tensor: the blocks' linear weights, the column-parallel biases
  // (q|k|v's and the MLP's first) and the token embedding (250 rows: no padding at tp 2; tied to
  // the head). Row-parallel biases, norms and positions stay whole.
  int64_t split = 0;
  for (const auto& [name, p] : models::create_model("gpt", six_heads)->named_parameters()) {
    const bool linear = name.find("c_attn") != std::string::npos ||
                        name.find("c_proj") != std::string::npos ||
                        name.find("c_fc") != std::string::npos;
    const bool bias = name.size() > 5 && name.substr(name.size() - 5) == ".bias";
    const bool row_bias = bias && name.find("c_proj") != std::string::npos;
    if ((linear && !row_bias) || name.find("wte") != std::string::npos) split += p.numel();
  }
  const MemoryPrediction whole = mm.predict(ddp), half = mm.predict(tp2);
  EXPECT_EQ(whole.parameters - half.parameters, 4 * split / 2)
      << "whole " << whole.parameters << ", tp2 " << half.parameters;
  EXPECT_GT(half.activations_peak, 0);
}

// Every figure of a need, for comparing two of them whole.
nlohmann::json need_fields(const trace::TrainingNeed& n) {
  const trace::MemoryEstimate& m = n.memory;
  return {n.model_type,
          n.layers_key,
          n.num_layers,
          n.batch,
          n.seq_len,
          n.optimizer,
          n.parameters,
          {m.parameters, m.gradients, m.optimizer_state, m.activations_peak, m.accumulating_peak,
           m.activations_saved, m.peak},
          {n.compute.forward_flops, n.compute.backward_flops},
          n.block_type,
          n.block_container,
          n.parameters_per_block,
          n.block_activations_saved,
          n.recomputed_block_activations_saved,
          n.blockwise_live_peak,
          n.graph_vertices,
          n.graph_ops,
          n.graph_forward_ops,
          n.trace_host_bytes};
}

// A 6-block tiny GPT and a 6-block GQA Llama (4 query heads, 2 KV heads): deep enough for the
// memory model's cut of the first, middle and last blocks.
std::pair<nlohmann::json, nlohmann::json> six_block_models() {
  nlohmann::json gpt = tiny_gpt();
  gpt["n_layer"] = 6;
  return {gpt,
          {{"hidden_size", 64},
           {"intermediate_size", 176},
           {"num_hidden_layers", 6},
           {"num_attention_heads", 4},
           {"num_key_value_heads", 2},
           {"vocab_size", 256},
           {"max_position_embeddings", 64}}};
}

// The needs at several micro-batches, evaluated from the traces at 2 and 3 samples, are the needs
// traced at each micro-batch, to the byte and FLOP: for the whole model and for ranks of tensor,
// sequence and pipeline layouts, with and without recomputation (all, the first blocks, their
// attention cores), bf16 activations and fsdp's blockwise gradients, on GPT and a GQA Llama.
TEST(MemoryModel, NeedsAtAnyMicroBatchFromTwoTracesAreTheTracedOnes) {
  const int64_t T = 32;
  const std::vector<int64_t> batches{1, 2, 3, 5, 8};
  const auto [gpt, llama] = six_block_models();
  std::vector<trace::TraceOptions> options(4);
  options[1].recompute = trace::Recompute::kBlock;  // every block
  options[2].recompute = trace::Recompute::kSelective;
  options[2].recompute_blocks = 2;
  options[3].recompute = trace::Recompute::kBlock;
  options[3].recompute_blocks = 1;
  options[3].bf16_activations = true;
  const std::vector<std::optional<trace::BlockwiseGradients>> blockwise{
      std::nullopt, trace::BlockwiseGradients{.in_flight_fraction = 0.75, .accumulated = false},
      trace::BlockwiseGradients{.in_flight_fraction = 0.5, .accumulated = true}};
  int compared = 0;
  for (const auto& [type, config] : {std::pair{"gpt", gpt}, std::pair{"llama", llama}}) {
    const auto model = trace::ModelRef::registry(type, config);
    const auto cands = enumerate_candidates(opts(4, 16, true), 6);
    std::vector<RankModel> ranks;
    for (const char* name :
         {"ddp", "ddp + tensor_parallel{\"size\":2} + sequence_parallel{\"kind\":\"megatron\"}",
          "ddp + sequence_parallel{\"kind\":\"ulysses\",\"size\":2}",
          "ddp + pipeline_parallel{\"micro_batches\":4,\"schedule\":\"interleaved\",\"size\":2,"
          "\"virtual\":2}"}) {
      for (RankModel& r : rank_models(model, candidate(cands, name), T)) {
        ranks.push_back(std::move(r));
      }
    }
    for (const RankModel& r : ranks) {
      for (const auto& o : options) {
        // The needs below come from such pairs, not from a fallback to tracing each batch.
        for (const int64_t layers : {1, 2}) {
          EXPECT_TRUE(trace::BatchTraces(r.model.trace(layers, 2, T, o).trace,
                                         r.model.trace(layers, 3, T, o).trace)
                          .affine())
              << type << " " << r.trace_key << " at " << layers << " blocks";
        }
        for (const auto& bw : blockwise) {
          const auto made = trace::estimate_training_needs(r.model, batches, T, o, "adamw", bw);
          ASSERT_EQ(made.size(), batches.size());
          for (size_t i = 0; i < batches.size(); ++i) {
            const auto traced =
                trace::estimate_training_need(r.model, batches[i], T, o, "adamw", bw);
            ASSERT_EQ(need_fields(made[i]), need_fields(traced))
                << type << " " << r.trace_key << " batch " << batches[i] << " recompute "
                << static_cast<int>(o.recompute) << "/" << o.recompute_blocks << " bf16 "
                << o.bf16_activations << " blockwise " << bw.has_value();
            ++compared;
          }
        }
      }
    }
  }
  // Models x ranks (the whole, tp + sp, ulysses, two pp ranks) x options x blockwise x batches.
  EXPECT_EQ(compared, 2 * 5 * 4 * 3 * 5);
  EXPECT_THROW((void)trace::estimate_training_needs(trace::ModelRef::registry("gpt", gpt), {}, T),
               ValueError);
  EXPECT_THROW(
      (void)trace::estimate_training_needs(trace::ModelRef::registry("gpt", gpt), {2, 0}, T),
      ValueError);
}

// At one sample a transpose can leave a tensor contiguous, and the trace then lacks a copy every
// larger batch makes; where the 2-block trace at one sample has the structure of the pair at 2
// and 3 samples, a deeper trace at one sample is the pair's line at 1, to the byte (what
// estimate_training_needs takes instead of tracing it): over the ranks of tensor, sequence and
// pipeline layouts of GPT and a GQA Llama, with no, full and selective recomputation and bf16
// activations, at 3 to 6 blocks. Ulysses' layouts are not alike at one sample: the check does fail.
TEST(BatchTraces, AtOneSampleWhereTwoBlocksAreLikeThePair) {
  const int64_t T = 32;
  const auto [gpt, llama] = six_block_models();
  std::vector<trace::TraceOptions> options(4);
  options[1].recompute = trace::Recompute::kBlock;
  options[2].recompute = trace::Recompute::kSelective;
  options[3].bf16_activations = true;
  int alike = 0, unlike = 0, compared = 0;
  for (const auto& [type, config] : {std::pair{"gpt", gpt}, std::pair{"llama", llama}}) {
    const auto model = trace::ModelRef::registry(type, config);
    const auto cands = enumerate_candidates(opts(4, 16, true), 6);
    for (const char* name :
         {"ddp", "ddp + tensor_parallel{\"size\":2} + sequence_parallel{\"kind\":\"megatron\"}",
          "ddp + tensor_parallel{\"size\":4}",
          "ddp + sequence_parallel{\"kind\":\"ulysses\",\"size\":2}",
          "ddp + pipeline_parallel{\"micro_batches\":4,\"size\":2}"}) {
      for (const RankModel& r : rank_models(model, candidate(cands, name), T)) {
        for (const auto& o : options) {
          const bool like = trace::BatchTraces::same_structure(r.model.trace(2, 1, T, o).trace,
                                                               r.model.trace(2, 2, T, o).trace);
          (like ? alike : unlike) += 1;
          if (!like) continue;
          for (const int64_t layers : {3, 4, 6}) {
            trace::BatchTraces pair(r.model.trace(layers, 2, T, o).trace,
                                    r.model.trace(layers, 3, T, o).trace);
            ASSERT_TRUE(pair.affine());
            const trace::Trace traced = r.model.trace(layers, 1, T, o).trace;
            const trace::Trace& made = pair.at_one();
            const std::string what = std::string(type) + " " + r.trace_key + " at " +
                                     std::to_string(layers) + " blocks, recompute " +
                                     std::to_string(static_cast<int>(o.recompute));
            ASSERT_EQ(trace::to_json(made), trace::to_json(traced)) << what;
            ASSERT_EQ(made.graph.memory_events().size(), traced.graph.memory_events().size());
            for (size_t i = 0; i < made.graph.memory_events().size(); ++i) {
              ASSERT_EQ(made.graph.memory_events()[i].bytes, traced.graph.memory_events()[i].bytes)
                  << what << " event " << i;
            }
            ++compared;
          }
        }
      }
    }
  }
  EXPECT_GT(unlike, 0);  // Ulysses' ranks
  EXPECT_EQ(compared, 3 * alike);
  EXPECT_GE(alike, 2 * 4 * 4);  // the whole, tp + sp, tp 4 and two pp ranks, 4 options, 2 models
}

// The needs of a model that keeps its traces (the search's), one sample's deep traces taken from
// the pairs where the 2-block trace is alike: the needs traced at each micro-batch, and fewer
// traces.
TEST(MemoryModel, OneSamplesNeedsFromThePairsAreTheTracedOnes) {
  const int64_t T = 32;
  const nlohmann::json gpt = six_block_models().first;
  const std::vector<int64_t> batches{1, 2, 4};
  const auto model = trace::ModelRef::registry("gpt", gpt);
  const auto cands = enumerate_candidates(opts(4, 16, true), 6);
  std::vector<trace::TraceOptions> options(2);
  options[1].recompute = trace::Recompute::kBlock;
  for (const char* name : {"ddp", "ddp + tensor_parallel{\"size\":2}",
                           "ddp + sequence_parallel{\"kind\":\"ulysses\",\"size\":2}"}) {
    for (const RankModel& r : rank_models(model, candidate(cands, name), T)) {
      for (const auto& o : options) {
        auto cache = std::make_shared<trace::TraceCache>(2);
        const trace::ModelRef kept = r.model.shared_traces(cache, r.trace_key);
        EXPECT_FALSE(kept.one_sample_like_pair(T, o).has_value());
        const auto made = trace::estimate_training_needs(kept, batches, T, o, "adamw");
        const std::optional<bool> like = kept.one_sample_like_pair(T, o);
        ASSERT_TRUE(like.has_value()) << name;
        EXPECT_EQ(*like, std::string(name).find("ulysses") == std::string::npos) << name;
        for (size_t i = 0; i < batches.size(); ++i) {
          EXPECT_EQ(need_fields(made[i]),
                    need_fields(trace::estimate_training_need(r.model, batches[i], T, o, "adamw")))
              << name << " batch " << batches[i];
        }
        // One sample's 3-block cut traced only where the 2 blocks were not alike.
        const size_t with = cache->traced();
        auto fresh = std::make_shared<trace::TraceCache>(2);
        const trace::ModelRef alone = r.model.shared_traces(fresh, r.trace_key);
        (void)trace::estimate_training_needs(alone, {1}, T, o, "adamw");
        (void)trace::estimate_training_needs(alone, {2, 4}, T, o, "adamw");
        EXPECT_EQ(with + (*like ? 1 : 0), fresh->traced()) << name << " " << with;
      }
    }
  }
}

// Told the candidates (expect), the memory model evaluates each rank trace's micro-batches from
// one set of traces: every candidate of the space at 4 ranks (data-parallel methods, amp,
// recomputation, accumulation, tp, sp, pp) is predicted to the byte as without it, from fewer
// traced needs.
TEST(MemoryModel, ExpectedMicroBatchesGiveTheSamePredictionsFromFewerTraces) {
  const int64_t T = 32;
  MemoryModel direct("gpt", tiny_gpt(), T), told("gpt", tiny_gpt(), T);
  const auto cands = enumerate_candidates(opts(4, 16, true), direct.num_blocks());
  told.expect(cands);
  size_t predicted = 0;
  for (const Candidate& c : cands) {
    if (direct.layout_refusal(c)) continue;
    ASSERT_FALSE(told.layout_refusal(c).has_value()) << c.describe();
    ASSERT_EQ(told.predict(c).to_json(), direct.predict(c).to_json())
        << c.describe() << " micro-batch " << c.micro_batch;
    ++predicted;
  }
  EXPECT_GT(predicted, 100u);
  // Micro-batches of 1 are traced each on their own (trace::BatchTraces starts at 2): here about
  // half of them, so told makes a little over half as many.
  EXPECT_LT(told.needs_traced(), direct.needs_traced())
      << "told " << told.needs_traced() << ", direct " << direct.needs_traced();
}

// Every collective of `world` ranks at alpha + beta x bytes.
CommCalibration made_up_comm(int world, double alpha, double beta) {
  CommCalibration c;
  c.world = world;
  for (const char* op : {"allreduce", "reduce_scatter", "allgather", "broadcast"}) {
    c.ops[op] = {alpha, beta};
  }
  return c;
}

// The tensor-parallel transform finds its patterns in a forward trace shared by every meta copy
// of one type and config (strategies/tensor_parallel.cpp): a copy of another depth is sharded by
// its own, so each block adds the same (sharded) parameters at every depth, fewer than a whole
// block's. Traced 1 block first: a trace shared across depths would leave the later blocks whole.
TEST(MemoryModel, EveryBlockOfATensorParallelCopyIsShardedAtAnyDepth) {
  const int64_t T = 32;
  const auto cands = enumerate_candidates(opts(4, 8), 4);
  const trace::ModelRef gpt = trace::ModelRef::registry("gpt", tiny_gpt());
  const trace::ModelRef tp2 =
      layout_model(gpt, candidate(cands, "ddp + tensor_parallel{\"size\":2}"));
  std::vector<int64_t> sharded, whole;
  for (const int64_t depth : {1, 2, 3, 4}) {
    sharded.push_back(tp2.trace(depth, 2, T, {}).trace.parameter_bytes);
    whole.push_back(gpt.trace(depth, 2, T, {}).trace.parameter_bytes);
  }
  for (size_t d = 1; d < sharded.size(); ++d) {
    EXPECT_EQ(sharded[d] - sharded[d - 1], sharded[1] - sharded[0]) << "depth " << d + 1;
    EXPECT_LT(sharded[d] - sharded[d - 1], whole[d] - whole[d - 1]) << "depth " << d + 1;
  }
}

// RankModels::for_each_rank gives each candidate's distinct pair keys once each (a deep
// pipeline's middle ranks share one), every one of them, and numbers equal trace keys alike.
TEST(RankModels, EachRanksPairKeyOncePerCandidate) {
  const int64_t T = 32;
  RankModels ranks(trace::ModelRef::registry("gpt", tiny_gpt()), T);
  const auto cands = enumerate_candidates(opts(8, 16), 4);
  std::vector<const Candidate*> all;
  for (const Candidate& c : cands) all.push_back(&c);
  std::map<const Candidate*, std::vector<BatchPairKey>> given;
  ranks.for_each_rank(all, [&](const Candidate& c, const RankModel&, const BatchPairKey& key) {
    given[&c].push_back(key);
  });
  size_t deep = 0;
  for (const auto& [c, keys] : given) {
    std::set<BatchPairKey> expected;
    std::map<std::string, int> ids;
    for (const RankModel& r : ranks.of(*c)) {
      expected.insert(
          batch_pair_key(r.trace_key, activation_trace_options(rank_effects(c->effects, r))));
      const auto [it, fresh] = ids.emplace(r.trace_key, r.trace_id);
      EXPECT_EQ(it->second, r.trace_id) << r.trace_key;
    }
    EXPECT_EQ(std::set<BatchPairKey>(keys.begin(), keys.end()), expected) << c->describe();
    EXPECT_EQ(keys.size(), expected.size()) << c->describe();
    deep += c->mesh.pp >= 4 && keys.size() < ranks.of(*c).size() ? 1 : 0;
  }
  EXPECT_GT(deep, 0u);  // some candidate's ranks shared a key
}

TEST(CostModel, ALayoutsCommunicationIsPricedAtItsGroupsFit) {
  const nlohmann::json config = tiny_gpt();
  const int64_t T = 32;
  MachineCalibration m;
  m.memory_gbps = 20;
  const CommCalibration world = made_up_comm(4, 50e-6, 1e-9);
  const auto cands = enumerate_candidates(opts(4, 8), 4);
  const Candidate& tp2 = candidate(cands, "ddp + tensor_parallel{\"size\":2}");
  const Candidate& sp = candidate(
      cands, "ddp + tensor_parallel{\"size\":2} + sequence_parallel{\"kind\":\"megatron\"}");
  const Candidate& ddp = candidate(cands, "ddp");
  for (const auto& s : CostModel::shapes_to_measure(
           layout_model(trace::ModelRef::registry("gpt", config), tp2), {4}, T)) {
    m.gemm_gflops[s] = 100;
  }
  for (const auto& s : CostModel::shapes_to_measure("gpt", config, {2}, T)) m.gemm_gflops[s] = 100;
  CostModel cm("gpt", config, T, m, world);
  const TimePrediction at_world = cm.predict(tp2);
  // The tp all-reduces: 4 per block (2 forward, 2 backward) and the loss's, all waited for.
  EXPECT_GT(at_world.comm_s, cm.predict(ddp).comm_s);
  // A fit measured on groups of 2 ranks prices the tp group (and the dp group of 2 beside it).
  CommCalibration pairs = world;
  pairs.world = 2;
  for (auto& [op, fit] : pairs.ops) fit = {5e-6, 1e-10};
  cm.add_group_calibration(pairs);
  EXPECT_EQ(&cm.comm_for(2), &cm.comm_for(2));
  EXPECT_EQ(cm.comm_for(2).ops.at("allreduce").alpha_s, 5e-6);
  EXPECT_EQ(cm.comm_for(4).ops.at("allreduce").alpha_s, 50e-6);
  const TimePrediction at_pairs = cm.predict(tp2);
  EXPECT_LT(at_pairs.comm_s, at_world.comm_s);
  EXPECT_NEAR(at_pairs.step_s, at_pairs.compute_s + at_pairs.optimizer_s + at_pairs.exposed_comm_s,
              1e-12);
  // Megatron-SP trades each all-reduce for an all-gather and a reduce-scatter of the same bytes.
  EXPECT_GT(cm.predict(sp).comm_s, 0);
  // A wait for descheduled peers (more ranks than cores) is added to each collective of its
  // group's size: the tp group's here, priced at the pairs' fit (4 a block and the loss's).
  CommCalibration waiting = pairs;
  waiting.wait_s = 1e-3;
  CostModel with_wait("gpt", config, T, m, world);
  with_wait.add_group_calibration(waiting);
  const TimePrediction waited = with_wait.predict(tp2);
  EXPECT_GE((waited.comm_s - at_pairs.comm_s) / waiting.wait_s, 4 * 4 + 1 - 1e-9);
  // And the prediction counts what it paid the wait on (bench_search fits its residual on it):
  // the tp group's collectives of a micro-batch at least, whatever the wait.
  EXPECT_GE(at_pairs.waits, 4 * 4 + 1);
  EXPECT_GE(waited.waits, 4 * 4 + 1);
  EXPECT_EQ(at_pairs.to_json().at("waits").get<double>(), at_pairs.waits);
  EXPECT_NEAR(with_wait.predict(ddp).comm_s, cm.predict(ddp).comm_s, 1e-12);  // dp over 4 ranks
  // A bulk wait measured at a size no collective of tp 2 reaches: each collective pays at least
  // wait_s and at most the bulk figure, by its bytes; more than with wait_s alone.
  CommCalibration bulk = waiting;
  bulk.wait_bulk_s = 5e-3;
  bulk.wait_bulk_bytes = int64_t{1} << 40;
  CostModel with_bulk("gpt", config, T, m, world);
  with_bulk.add_group_calibration(bulk);
  const TimePrediction bulked = with_bulk.predict(tp2);
  EXPECT_GT(bulked.comm_s, waited.comm_s);
  EXPECT_LT(bulked.comm_s - at_pairs.comm_s, bulked.waits * bulk.wait_bulk_s);
  // Measured at 4 KiB + 1 byte, every larger collective pays the bulk figure: all but the
  // loss's few-byte all-reduces (which pay wait_s) of the 19 the prediction waits for.
  bulk.wait_bulk_bytes = (4 << 10) + 1;
  CostModel at_bulk("gpt", config, T, m, world);
  at_bulk.add_group_calibration(bulk);
  const double paid = (at_bulk.predict(tp2).comm_s - at_pairs.comm_s) / bulk.wait_bulk_s;
  EXPECT_GT(paid, waited.waits - 1.5) << waited.waits;
  EXPECT_LE(paid, waited.waits + 1e-9);
  // A long-gap wait: tp 2's collectives come after far more compute than a gap of 1 ns, so each
  // of the trace's pays the long figure (the trace's compute per wait is past both gaps); the
  // data-parallel ones after the step (no compute between them) pay wait_s.
  CommCalibration gapped = waiting;
  gapped.wait_gap_s = 0;
  gapped.wait_long_gap_s = 1e-9;
  gapped.wait_long_s = 4e-3;
  CostModel with_gap("gpt", config, T, m, world);
  with_gap.add_group_calibration(gapped);
  const double long_paid = (with_gap.predict(tp2).comm_s - at_pairs.comm_s) / gapped.wait_long_s;
  EXPECT_GT(long_paid, waited.waits - 1.5) << waited.waits;
  EXPECT_LE(long_paid, waited.waits + 1e-9);
  EXPECT_GT(long_paid, (waited.comm_s - at_pairs.comm_s) / gapped.wait_long_s);
}

// Time-sliced cores (more ranks x threads than cores): a pipeline's ranks idle in its fill and
// drain leave their cores to the others, so its step is the longer of the schedule with each rank
// at the contention beyond slicing and all ranks' compute over the cores; a layout without a
// pipeline is priced as before. Not above the contention, and nothing changes at a share of 1.
TEST(CostModel, TimeSlicedCoresShortenAPipelinesFillAndDrain) {
  const nlohmann::json config = tiny_gpt();
  const int64_t T = 32;
  MachineCalibration machine;
  machine.memory_gbps = 20;
  const auto model = trace::ModelRef::registry("gpt", config);
  const auto cands = enumerate_candidates(opts(2, 8), 4);
  const Candidate& pp = candidate(cands, "ddp + pipeline_parallel{\"micro_batches\":2,\"size\":2}");
  const Candidate& ddp = candidate(cands, "ddp");
  for (const RankModel& r : rank_models(model, pp, T)) {
    for (const auto& s : CostModel::shapes_to_measure(r.model, {4}, T)) {
      machine.gemm_gflops[s] = 100;
    }
  }
  for (const auto& s : CostModel::shapes_to_measure("gpt", config, {4}, T)) {
    machine.gemm_gflops[s] = 100;
  }
  const CommCalibration comm = made_up_comm(2, 0, 0);
  CostModel plain(model, T, machine, comm, 2.0);
  CostModel sliced(model, T, machine, comm, 2.0);
  EXPECT_THROW(sliced.set_time_slicing(2.5), ValueError);
  EXPECT_THROW(sliced.set_time_slicing(std::nan("")), ValueError);
  sliced.set_time_slicing(2.0);
  const TimePrediction a = plain.predict(pp), b = sliced.predict(pp);
  // m = 2 over 2 stages: 3 slots of the schedule, one rank busy in the first and the last.
  EXPECT_LT(b.step_s, a.step_s);
  EXPECT_GT(b.step_s, 0.6 * a.step_s);
  EXPECT_NEAR(b.step_s, b.compute_s + b.optimizer_s + b.exposed_comm_s, 1e-12);
  EXPECT_GE(b.bubble_s, 0);
  EXPECT_DOUBLE_EQ(sliced.predict(ddp).step_s, plain.predict(ddp).step_s);
  CostModel one(model, T, machine, comm, 2.0);
  one.set_time_slicing(1.0);
  EXPECT_DOUBLE_EQ(one.predict(pp).step_s, a.step_s);
}

// A pipeline is priced per pp rank from the traces of its stages and by its schedule: with free
// messages, the idle share of the schedule (bubble_s over compute_s) is at least the formula's
// (p - 1) / (v m + p - 1), equal for equal stages (the head makes the last one longer here), and
// falls with more micro-batches and with interleaving.
TEST(CostModel, APipelinesBubbleFollowsItsSchedule) {
  const nlohmann::json config = tiny_gpt();
  const int64_t T = 32;
  MachineCalibration machine;
  machine.memory_gbps = 20;
  const CommCalibration comm = made_up_comm(2, 0, 0);
  const auto model = trace::ModelRef::registry("gpt", config);
  const auto cands = enumerate_candidates(opts(2, 8), 4);
  auto pipe = [&](int m, bool interleaved) -> const Candidate& {
    return candidate(cands, "ddp + pipeline_parallel{\"micro_batches\":" + std::to_string(m) +
                                (interleaved ? ",\"schedule\":\"interleaved\"" : "") +
                                ",\"size\":2" + (interleaved ? ",\"virtual\":2}" : "}"));
  };
  for (const int m : {2, 4, 8}) {
    for (const bool il : {false, true}) {
      for (const RankModel& r : rank_models(model, pipe(m, il), T)) {
        for (const auto& s : CostModel::shapes_to_measure(r.model, {8 / m}, T)) {
          machine.gemm_gflops[s] = 100;
        }
      }
    }
  }
  CostModel cm(model, T, machine, comm);
  std::map<std::pair<int, bool>, double> share;
  for (const int m : {2, 4, 8}) {
    for (const bool il : {false, true}) {
      const TimePrediction t = cm.predict(pipe(m, il));
      const double v = il ? 2 : 1;
      const double idle = t.bubble_s / t.compute_s;
      share[std::make_pair(m, il)] = idle;
      EXPECT_GE(idle, (2 - 1) / (v * m + 2 - 1) - 1e-12) << m << " " << il;
      EXPECT_LT(idle, 0.5) << m << " " << il;
      EXPECT_NEAR(t.step_s, t.compute_s + t.optimizer_s + t.exposed_comm_s, 1e-12);
    }
  }
  auto at = [&](int m, bool il) { return share.at(std::make_pair(m, il)); };
  EXPECT_LT(at(4, false), at(2, false));
  EXPECT_LT(at(8, false), at(4, false));
  for (const int m : {2, 4, 8}) EXPECT_LT(at(m, true), at(m, false)) << m;
  // Each stage's peak is predicted, the first stage's in-flight micro-batches beyond the trace's.
  MemoryModel mm(model, T);
  const MemoryPrediction p = mm.predict(pipe(8, false));
  ASSERT_EQ(p.stage_peaks.size(), 2u);
  EXPECT_EQ(p.peak, std::max(p.stage_peaks[0], p.stage_peaks[1]));
  EXPECT_GT(p.in_flight_activations, 0);
}

// An interleaved rank's stages are unequal: the last stage saves the head's logits on top of its
// blocks, and each stage holds its own count of micro-batches in flight, from the schedule's list
// (tests/strategies/data/schedule_interleaved_p2_v2_m4.txt). Pricing the rank's saved bytes as
// even shares over its stages (as before 2026-11-28) over-predicted interleaved peaks by up to
// 10 %; priced per stage they came within 5 % at 2 ranks (space_mpi_test).
TEST(MemoryModel, AnInterleavedRanksStagesSaveAndHoldTheirOwn) {
  nlohmann::json config = tiny_gpt();
  config["vocab_size"] = 2048;  // logits worth more than a block
  const int64_t T = 32;
  const auto model = trace::ModelRef::registry("gpt", config);
  const auto cands = enumerate_candidates(opts(2, 8), 4);
  const Candidate& one =
      candidate(cands, "ddp + pipeline_parallel{\"micro_batches\":4,\"size\":2}");
  const Candidate& il = candidate(
      cands,
      "ddp + pipeline_parallel{\"micro_batches\":4,\"schedule\":\"interleaved\",\"size\":2,"
      "\"virtual\":2}");
  // The in-flight counts at a rank's first backward (no gradient held yet).
  auto first_backward = [](const RankModel& r) {
    for (const StageAction& a : r.actions) {
      if (a.backward) {
        EXPECT_EQ(a.gradients, std::vector<bool>(r.stages.size(), false));
        return a.in_flight;
      }
    }
    ADD_FAILURE() << "no backward on pp rank " << r.pp_rank;
    return std::vector<int>{};
  };
  const std::vector<RankModel> flat = rank_models(model, one, T);
  ASSERT_EQ(flat.size(), 2u);
  EXPECT_EQ(first_backward(flat[0]), std::vector<int>{2});  // p micro-batches on the first stage
  EXPECT_EQ(first_backward(flat[1]), std::vector<int>{1});
  const std::vector<RankModel> ranks = rank_models(model, il, T);
  ASSERT_EQ(ranks.size(), 2u);
  // Rank 0: F0@0 F1@0 F0@2 F1@2 F2@0 B0@2; rank 1: F0@1 F1@1 F0@3 B0@3.
  EXPECT_EQ(first_backward(ranks[0]), (std::vector<int>{3, 2}));
  EXPECT_EQ(first_backward(ranks[1]), (std::vector<int>{2, 1}));
  // F0@0 and F1@0 are not kept: F2@0 holds more on every stage, nothing else differing.
  auto kept = [&](const StageAction& a) {
    return std::count(ranks[0].actions.begin(), ranks[0].actions.end(), a);
  };
  EXPECT_EQ(kept({0, false, {1, 0}, {false, false}}), 0);
  EXPECT_EQ(kept({0, false, {2, 0}, {false, false}}), 0);
  EXPECT_EQ(kept({0, false, {3, 2}, {false, false}}), 1);
  // After B0@2, rank 0 holds stage 2's gradients and not yet stage 0's: at F3@0, four
  // micro-batches in flight on stage 0 and one on stage 2, before B0@0.
  const StageAction f3{0, false, {4, 1}, {false, true}};
  EXPECT_NE(std::find(ranks[0].actions.begin(), ranks[0].actions.end(), f3),
            ranks[0].actions.end());
  for (const StageAction& at : ranks[0].actions) {
    ASSERT_EQ(at.in_flight.size(), 2u);
    ASSERT_EQ(at.gradients.size(), 2u);
  }
  // Under 1F1B every action after the rank's first backward holds its gradients.
  bool after = false;
  for (const StageAction& at : flat[0].actions) {
    if (after) {
      EXPECT_EQ(at.gradients, std::vector<bool>{true});
    }
    after |= at.backward;
  }
  EXPECT_TRUE(after);

  for (const RankModel& r : ranks) {
    const trace::TrainingNeed need = trace::estimate_training_need(r.model, 2, T);
    const std::vector<int64_t> saved = stage_saved_bytes(need, il.effects, r);
    ASSERT_EQ(saved.size(), 2u);
    EXPECT_EQ(saved[0] + saved[1], need.memory.activations_saved);
    ASSERT_GT(need.block_activations_saved, 0);
    const std::vector<int64_t> grads = stage_gradient_bytes(need, r);
    ASSERT_EQ(grads.size(), 2u);
    EXPECT_EQ(grads[0] + grads[1], need.memory.gradients);
    EXPECT_GT(grads[0], 0);
    EXPECT_GT(grads[1], 0);
    // One block a stage: rank 0's stage 0 holds the embedding, stage 2 only its block; rank 1's
    // stage 1 its block, stage 3 its block and the head's logits.
    const int64_t block = need.block_activations_saved;
    if (r.first) {
      EXPECT_GT(saved[0], block);
      EXPECT_EQ(saved[1], block);
    } else {
      EXPECT_EQ(saved[0], block);
      EXPECT_GT(saved[1], 2 * block) << "the logits of 2 x 32 tokens x 2048 words";
    }
  }
  // The last rank's first backward holds two of stage 1's micro-batches and one of stage 3's: one
  // block's saved bytes beyond the trace, where even shares counted half of the logits too.
  MemoryModel mm(model, T);
  const MemoryPrediction p = mm.predict(il);
  ASSERT_EQ(p.stage_peaks.size(), 2u);
  EXPECT_EQ(p.peak, std::max(p.stage_peaks[0], p.stage_peaks[1]));

  // A model traced whole (2 blocks) and one extrapolated (6) give one per-block figure.
  nlohmann::json deep = config;
  deep["n_layer"] = 6;
  nlohmann::json shallow = config;
  shallow["n_layer"] = 2;
  const trace::TraceOptions all{.recompute = trace::Recompute::kBlock, .recompute_blocks = -1};
  for (const trace::TraceOptions& o : {trace::TraceOptions{}, all}) {
    const auto d = trace::estimate_training_need("gpt", deep, 2, T, o);
    const auto s2 = trace::estimate_training_need("gpt", shallow, 2, T, o);
    EXPECT_EQ(d.block_activations_saved, s2.block_activations_saved);
    EXPECT_EQ(d.memory.activations_saved - 6 * d.block_activations_saved,
              s2.memory.activations_saved - 2 * s2.block_activations_saved);
  }
  // Recomputed, a block saves only its input.
  EXPECT_LT(trace::estimate_training_need("gpt", deep, 2, T, all).block_activations_saved,
            trace::estimate_training_need("gpt", deep, 2, T).block_activations_saved);
}

// A GPT of `layers` blocks (d32, `vocab` words) on 2 ranks with a global batch of 8, and its
// pp2 candidate with 4 micro-batches.
struct PipelineCase {
  trace::ModelRef model;
  std::vector<Candidate> cands;
  Candidate pipe;
  PipelineCase(int64_t layers, int64_t vocab)
      : model(trace::ModelRef::registry("gpt", with_depth_and_vocab(layers, vocab))),
        cands(enumerate_candidates(opts(2, 8), layers)),
        pipe(candidate(cands, "ddp + pipeline_parallel{\"micro_batches\":4,\"size\":2}")) {}
  static nlohmann::json with_depth_and_vocab(int64_t layers, int64_t vocab) {
    nlohmann::json config = tiny_gpt();
    config["n_layer"] = layers;
    config["n_embd"] = 32;
    config["vocab_size"] = vocab;
    return config;
  }
};

// The search cuts a pipeline where the cost model balances its stages' time, not their FLOPs.
// On a machine whose memory is slow, every op is memory-bound: the head's projection then costs
// the last stage less, against a block's elementwise work, than its FLOPs say (the method's own
// cut), so the balanced cut gives the last stage a block more, and the candidate so cut is
// predicted faster.
TEST(CostModel, APipelineIsCutWhereItsStagesTakeEvenTime) {
  const int64_t T = 32;
  const PipelineCase pc(6, 1024);
  const auto& [model, cands, c] = pc;
  // The method's own cut: the head's 1024 / (12 x 32 + 2 x 64) = 2 blocks of FLOPs.
  const std::vector<strategies::StageBlocks> flop_cut = {{0, 4}, {4, 6}};
  ASSERT_EQ(
      strategies::pipeline_layout(c.strategy(), 6, strategies::head_cost_in_blocks(32, 1024, 64))
          ->stages,
      flop_cut);
  auto machine_for = [&](double memory_gbps) {
    MachineCalibration m;
    m.memory_gbps = memory_gbps;
    for (const RankModel& r : rank_models(model, c, T)) {
      for (const auto& s : CostModel::shapes_to_measure(r.model, {c.micro_batch}, T)) {
        m.gemm_gflops[s] = 100;
      }
    }
    return m;
  };
  CostModel slow_memory(model, T, machine_for(0.5), made_up_comm(2, 0, 0));
  const auto cut = slow_memory.balanced_stages(c);
  ASSERT_TRUE(cut.has_value());
  ASSERT_EQ(cut->size(), 2u);
  EXPECT_EQ(cut->front().begin, 0);
  EXPECT_EQ(cut->back().end, 6);
  EXPECT_EQ(cut->front().end, 3) << "the balanced cut gives the last stage a block more";
  Candidate recut = c;
  recut.set_strategy(strategies::with_pipeline_stages(c.strategy(), *cut));
  const TimePrediction before = slow_memory.predict(c), after = slow_memory.predict(recut);
  EXPECT_LT(after.step_s, before.step_s);
  EXPECT_LT(after.bubble_s, before.bubble_s);
  // Each stage's memory is that of its own blocks: the first stage now holds less.
  MemoryModel mm(model, T);
  EXPECT_LT(mm.predict(recut).stage_peaks.at(0), mm.predict(c).stage_peaks.at(0));
  // No pipeline, no cut.
  EXPECT_FALSE(slow_memory.balanced_stages(candidate(cands, "ddp")).has_value());
  // The cut written into a strategy is checked as a user's would be.
  EXPECT_THROW(strategies::with_pipeline_stages(c.strategy(), {{0, 6}}), ValueError);
  EXPECT_THROW(strategies::with_pipeline_stages(candidate(cands, "ddp").strategy(), *cut),
               ValueError);
  EXPECT_THROW(strategies::balance_stages(6, 2, -1.0, 0.0), ValueError);
}

// balance_stages' binary search gives the cut of the quadratic dynamic program it replaced (each
// stage's end tried at every block): the least largest stage cost an exhaustive walk of every cut
// finds, and the same cut among those reaching it (the fewest blocks on each stage in turn that
// keeps the rest's optimum), for every block and stage count up to 12 and extras that make the
// first, the last, both or neither stage dear.
TEST(BalanceStages, MatchesTheQuadraticProgramAndAnExhaustiveWalk) {
  for (int64_t blocks = 1; blocks <= 12; ++blocks) {
    for (int stages = 1; stages <= blocks; ++stages) {
      for (const auto& [first, last] : std::vector<std::pair<double, double>>{
               {0.0, 0.0}, {0.0, 2.5}, {1.25, 0.0}, {3.0, 0.7}, {0.0, 40.0}, {0.5, 0.5}}) {
        const auto S = static_cast<size_t>(stages);
        const auto N = static_cast<size_t>(blocks);
        auto cost = [&](size_t i, size_t a, size_t b) {
          return static_cast<double>(b - a) + (i == 0 ? first : 0.0) + (i + 1 == S ? last : 0.0);
        };
        // The exhaustive walk: the least largest stage cost of any cut.
        double least = std::numeric_limits<double>::infinity();
        auto walk = [&](auto&& self, size_t i, size_t a, double worst) -> void {
          if (i == S) {
            if (a == N) least = std::min(least, worst);
            return;
          }
          for (size_t b = a + 1; b + (S - 1 - i) <= N; ++b) {
            self(self, i + 1, b, std::max(worst, cost(i, a, b)));
          }
        };
        walk(walk, 0, 0, 0.0);
        // The quadratic program and its reconstruction.
        const double inf = std::numeric_limits<double>::infinity();
        std::vector<std::vector<double>> best(S + 1, std::vector<double>(N + 1, inf));
        best[S][N] = 0;
        for (size_t i = S; i-- > 0;) {
          for (size_t a = 0; a < N; ++a) {
            for (size_t b = a + 1; b <= N; ++b) {
              best[i][a] = std::min(best[i][a], std::max(cost(i, a, b), best[i + 1][b]));
            }
          }
        }
        std::vector<int64_t> want;
        for (size_t i = 0, a = 0; i < S; ++i) {
          for (size_t b = a + 1; b <= N; ++b) {
            if (std::max(cost(i, a, b), best[i + 1][b]) <= best[i][a] + 1e-12) {
              want.push_back(static_cast<int64_t>(b));
              a = b;
              break;
            }
          }
        }
        const std::vector<strategies::StageBlocks> cut =
            strategies::balance_stages(blocks, stages, first, last);
        std::vector<int64_t> got;
        double worst = 0;
        for (size_t i = 0; i < cut.size(); ++i) {
          got.push_back(cut[i].end);
          worst = std::max(
              worst, cost(i, static_cast<size_t>(cut[i].begin), static_cast<size_t>(cut[i].end)));
        }
        const std::string what = std::to_string(blocks) + " blocks, " + std::to_string(stages) +
                                 " stages, extras " + std::to_string(first) + " / " +
                                 std::to_string(last);
        EXPECT_EQ(got, want) << what;
        EXPECT_EQ(worst, least) << what;
      }
    }
  }
}

// The other way round, with the first stage's memory respected: where the head's projection is
// slow (its GEMMs at 2 GFLOP/s, the blocks' at 100), the balanced cut gives the first stage more
// blocks than the FLOP cut, and more memory (it holds the most micro-batches in flight). Under a
// budget that cut does not fit, the search takes blocks off the first stage one at a time and
// takes the first cut that fits; under a budget none fits, the candidate keeps its own cut.
TEST(CostModel, ARecutPipelineRespectsTheFirstStagesMemory) {
  const int64_t T = 32;
  const PipelineCase pc(8, 512);
  const auto& [model, cands, c] = pc;
  MachineCalibration machine;
  machine.memory_gbps = 1000;
  for (const RankModel& r : rank_models(model, c, T)) {
    for (const auto& s : CostModel::shapes_to_measure(r.model, {c.micro_batch}, T)) {
      const bool head = s.m == 512 || s.n == 512 || s.k == 512;  // the vocabulary's dimension
      machine.gemm_gflops[s] = head ? 2 : 100;
    }
  }
  CostModel cm(model, T, machine, made_up_comm(2, 0, 0));
  const std::vector<strategies::StageBlocks> own = cm.stages_of(c);
  ASSERT_EQ(own, (std::vector<strategies::StageBlocks>{{0, 4}, {4, 8}}));  // the head: 1 block
  const auto balanced = cm.balanced_stages(c);
  ASSERT_TRUE(balanced.has_value());
  ASSERT_GT(balanced->front().end, own.front().end + 1) << "the slow head moves blocks forward";
  MemoryModel mm(model, T);
  const double margin = 0.05;
  // Room for any cut: the balanced one.
  const auto roomy = rebalanced_pipeline(c, cm, mm, int64_t{1} << 40, margin);
  ASSERT_TRUE(roomy.has_value());
  EXPECT_EQ(cm.stages_of(roomy->candidate), *balanced);
  EXPECT_EQ(roomy->memory.peak, mm.predict(roomy->candidate).peak);
  EXPECT_LT(cm.predict(roomy->candidate).step_s, cm.predict(c).step_s);
  // Just too little for it: a cut with fewer blocks first, which fits.
  const auto peak = static_cast<double>(roomy->memory.peak);
  const auto budget = static_cast<int64_t>(peak * (1 + margin)) - 1;
  const auto tight = rebalanced_pipeline(c, cm, mm, budget, margin);
  ASSERT_TRUE(tight.has_value());
  const auto tight_cut = cm.stages_of(tight->candidate);
  EXPECT_LT(tight_cut.front().end, balanced->front().end);
  EXPECT_GT(tight_cut.front().end, own.front().end);
  EXPECT_LE(static_cast<double>(tight->memory.peak) * (1 + margin), static_cast<double>(budget));
  // Room for none but the candidate's own: it keeps its cut.
  EXPECT_FALSE(rebalanced_pipeline(c, cm, mm, mm.predict(c).peak, margin).has_value());
}

}  // namespace
}  // namespace acc::search
