// The planner for clusters not at hand: a cluster profile's reading and prices, and its
// predictions for published measurements (search/profiles/published/) with the published plans.
//
//  - Narayanan et al. SC'21 Table 1 (10 GPT runs on 32-3072 A100s of Selene): predicted achieved
//    TFLOP/s per GPU (the paper's eq. 3 FLOPs over the predicted step) against the published.
//  - vTrain's 109 multi-node iteration times (Megatron-DeepSpeed on A100 nodes with 800 Gb/s of
//    InfiniBand a node): predicted step time against the measured.
// ACC_TEST_VERBOSE=1 prints each row (the tables of search/profiles/README.md).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "acc/accelerate.hpp"
#include "acc/optim/adam.hpp"
#include "acc/optim/sgd.hpp"
#include "acc/search/cluster.hpp"
#include "acc/search/cost.hpp"
#include "acc/search/space.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/trace/model_ref.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json.hpp"
#include "ops_digest.hpp"

namespace acc::search {
namespace {

std::string profiles(const std::string& file) {
  return std::string(ACC_PROFILES_DIR) + "/" + file;
}

bool verbose() {
  return std::getenv("ACC_TEST_VERBOSE") != nullptr;
}

nlohmann::json selene_json() {
  return read_json_file(profiles("a100-selene.json"), "profile");
}

// A tiny GPT of 8 blocks: at 8 ranks its space has pipelines of every depth (pp 1, 2, 4, 8).
nlohmann::json eight_block_gpt() {
  return {{"n_layer", 8}, {"n_head", 4}, {"n_embd", 32}, {"vocab_size", 128}, {"block_size", 32}};
}

// The space of `world` ranks at `global_batch` samples of `seq_len` tokens.
SpaceOptions space_of(int world, int64_t global_batch, int64_t seq_len, bool allow_bf16) {
  SpaceOptions so;
  so.world = world;
  so.global_batch = global_batch;
  so.seq_len = seq_len;
  so.allow_bf16 = allow_bf16;
  return so;
}

// `f()` on `threads` threads, the configured count restored after it (also when it throws).
template <class F>
void on_threads(int threads, const F& f) {
  struct Restore {
    int n;
    ~Restore() { set_num_threads(n); }
  } restore{get_num_threads()};
  set_num_threads(threads);
  f();
}

// ---- the profile ----

TEST(ClusterProfile, ReadsTheShippedProfilesAndWritesWhatItRead) {
  for (const char* f : {"a100-selene.json", "a100-vtrain.json", "h100-dgx.json"}) {
    const ClusterProfile p = ClusterProfile::load(profiles(f));
    EXPECT_EQ(p.devices_per_node, 8) << f;
    EXPECT_GT(p.peak_tflops_bf16, p.peak_tflops_fp32) << f;
    const ClusterProfile again = ClusterProfile::from_json(p.to_json());
    EXPECT_EQ(again.to_json(), p.to_json()) << f;
  }
}

TEST(ClusterProfile, RefusesABadFieldByItsPath) {
  auto refused = [](nlohmann::json j, const std::string& field) {
    try {
      ClusterProfile::from_json(j);
      ADD_FAILURE() << "accepted a profile with a bad " << field;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + field + "'"), std::string::npos) << e.what();
    }
  };
  nlohmann::json j = selene_json();
  j["device"]["peak_tflops"]["bf16"] = -1;
  refused(j, "device.peak_tflops.bf16");
  j = selene_json();
  j["device"]["gemm_efficiency"][2] = {64, 0.5};  // not increasing
  refused(j, "device.gemm_efficiency[2]");
  j = selene_json();
  j["device"]["gemm_efficiency"][0] = {16, 1.5};
  refused(j, "device.gemm_efficiency[0]");
  j = selene_json();
  j["system"]["inter_node"]["efficiency"] = 2;
  refused(j, "system.inter_node.efficiency");
  j = selene_json();
  j["device"]["reserved_gib"] = 90;
  refused(j, "device.reserved_gib");
  j = selene_json();
  j["software"]["attention"] = "flash";
  refused(j, "software.attention");
  j = selene_json();
  j["system"]["nodes"] = 4;
  refused(j, "system.nodes");
  j = selene_json();
  j["system"].erase("devices_per_node");
  refused(j, "system.devices_per_node");
  EXPECT_THROW(ClusterProfile::load(profiles("no-such-profile.json")), IoError);
}

TEST(ClusterProfile, GemmEfficiencyFollowsTheSmallestDimensionInLog2) {
  ClusterProfile p = ClusterProfile::from_json(selene_json());
  p.gemm_efficiency = {{64, 0.2}, {1024, 0.6}};
  EXPECT_DOUBLE_EQ(p.gemm_efficiency_at({8192, 8192, 16}), 0.2);   // below the first point
  EXPECT_DOUBLE_EQ(p.gemm_efficiency_at({256, 8192, 8192}), 0.4);  // halfway in log2 (64..1024)
  EXPECT_DOUBLE_EQ(p.gemm_efficiency_at({1 << 14, 1 << 14, 1 << 14}), 0.6);
  p.kernel_overhead_s = 0;
  const GemmShape s{4096, 4096, 4096};
  EXPECT_NEAR(p.gemm_seconds(s, true), static_cast<double>(s.flops()) / (312e12 * 0.6), 1e-12);
  EXPECT_NEAR(p.gemm_seconds(s, false), static_cast<double>(s.flops()) / (19.5e12 * 0.6), 1e-12);
}

TEST(ClusterProfile, CollectivesUseNvlinkInsideANodeAndEachDevicesNicAcrossNodes) {
  ClusterProfile p = ClusterProfile::from_json(selene_json());
  p.intra_node = {300, 0, 1};
  p.inter_node = {25, 0, 1};
  const int64_t B = int64_t{1} << 30;
  const double b = static_cast<double>(B);
  // tp 8 inside a node: a ring all-reduce moves 2 x 7/8 of the buffer over NVLink.
  EXPECT_NEAR(p.collective_seconds("allreduce", B, {8, 1}), 2 * 7.0 / 8 * b / 300e9, 1e-9);
  // dp 4 across nodes, one member a node (tp 8 apart): over the NIC alone.
  EXPECT_NEAR(p.collective_seconds("allreduce", B, {4, 8}), 2 * 3.0 / 4 * b / 25e9, 1e-9);
  // dp 32 with tp 2: 4 members a node (NVLink) over 8 nodes, each with a quarter over its NIC.
  EXPECT_NEAR(p.collective_seconds("reduce_scatter", B, {32, 2}),
              3.0 / 4 * b / 300e9 + 7.0 / 8 * b / 4 / 25e9, 1e-9);
  EXPECT_NEAR(p.collective_seconds("allgather", B, {32, 2}),
              p.collective_seconds("reduce_scatter", B, {32, 2}), 1e-12);
  EXPECT_EQ(p.collective_seconds("allreduce", B, {1, 1}), 0);
  // A message to a neighbour on the node, and to one on another node.
  EXPECT_NEAR(p.p2p_seconds(B, 4), b / 300e9, 1e-9);
  EXPECT_NEAR(p.p2p_seconds(B, 8), b / 25e9, 1e-9);
  try {
    p.collective_seconds("allscatter", B, {8, 1});
    ADD_FAILURE() << "an unknown collective was priced";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("allscatter"), std::string::npos) << e.what();
  }
}

// ---- the plan for a cluster ----

nlohmann::json gpt_config(int64_t layers, int64_t heads, int64_t hidden, int64_t seq) {
  return {{"n_layer", layers}, {"n_head", heads}, {"n_embd", hidden},    {"vocab_size", 51200},
          {"block_size", seq}, {"bias", true},    {"activation", "gelu"}};
}

// The published plan: tp, pp (equal stages of blocks, as Megatron-LM cuts them; `virtual`
// stages a rank), micro-batches or accumulation, every block recomputed, amp, ddp.
strategies::Strategy published_plan(int64_t layers, int tp, int pp, int virtual_stages,
                                    int64_t micro_batches) {
  nlohmann::json s = nlohmann::json::array();
  if (tp > 1) s.push_back({{"name", "tensor_parallel"}, {"config", {{"size", tp}}}});
  if (pp > 1) {
    nlohmann::json c = {{"size", pp}, {"micro_batches", micro_batches}};
    if (virtual_stages > 1) c["virtual"] = virtual_stages;
    const int64_t stages = static_cast<int64_t>(pp) * virtual_stages;
    if (layers % stages == 0) {
      const int64_t per = layers / stages;
      nlohmann::json cut = nlohmann::json::array();
      for (int64_t i = 0; i < stages; ++i) cut.push_back({i * per, i * per + per - 1});
      c["stages"] = cut;
    }
    s.push_back({{"name", "pipeline_parallel"}, {"config", c}});
  } else if (micro_batches > 1) {
    s.push_back({{"name", "grad_accum"}, {"config", {{"steps", micro_batches}}}});
  }
  s.push_back({{"name", "checkpoint"}});
  s.push_back({{"name", "amp"}});
  s.push_back({{"name", "ddp"}});
  return strategies::parse_strategy(s);
}

// A plan's options: the batch and sequence, amp allowed (every published run was mixed precision).
AccelerateOptions plan_options(int64_t batch, int64_t seq) {
  AccelerateOptions o;
  o.global_batch = batch;
  o.seq_len = seq;
  o.allow_bf16 = true;
  return o;
}

nlohmann::json predicted(const nlohmann::json& config, int world, int64_t batch, int64_t seq,
                         const ClusterProfile& cluster, const strategies::Strategy& plan) {
  const AccelerateOptions o = plan_options(batch, seq);
  const nlohmann::json report =
      plan_for_cluster(trace::ModelRef::registry("gpt", config), world, o, cluster, plan);
  return report.at("candidates").at(0).at("predicted");
}

TEST(PublishedMeasurements, NarayananTable1) {
  const ClusterProfile selene = ClusterProfile::load(profiles("a100-selene.json"));
  const nlohmann::json t =
      read_json_file(profiles("published/narayanan2021_table1.json"), "Table 1");
  double sum = 0, worst = 0;
  int n = 0;
  for (const auto& row : t.at("rows")) {
    const int64_t heads = row[1], h = row[2], l = row[3], B = row[7];
    const int tp = row[4], pp = row[5], gpus = row[6];
    const double published = row[8];
    const int dp = gpus / (tp * pp);
    // Assumed where the paper is silent (search/profiles/README.md): micro-batch 1, the
    // interleaved schedule with 2 stages a rank where a rank's blocks split evenly.
    const int v = pp > 1 && (l / pp) % 2 == 0 ? 2 : 1;
    const nlohmann::json p = predicted(gpt_config(l, heads, h, 2048), gpus, B, 2048, selene,
                                       published_plan(l, tp, pp, v, B / dp));
    const double s = 2048, V = 51200;
    const double F =
        96.0 * static_cast<double>(B) * s * static_cast<double>(l * h * h) *
        (1 + s / (6.0 * static_cast<double>(h)) + V / (16.0 * static_cast<double>(l * h)));
    const double step = p.at("time").at("step_s");
    const double tflops = F / step / gpus / 1e12;
    const double err = (tflops - published) / published;
    sum += std::abs(err);
    worst = std::max(worst, std::abs(err));
    ++n;
    if (verbose()) {
      std::printf("| %.1fB | %d | %d | %d | %lld | %.0f | %.1f | %+.1f%% | %.2f s | %.1f GiB |\n",
                  row[0].get<double>(), tp, pp, gpus, static_cast<long long>(B), published, tflops,
                  100 * err, step, p.at("memory").at("peak").get<double>() / (1 << 30));
    }
  }
  const double mean = sum / n;
  std::printf("Narayanan Table 1: %d rows, mean |error| %.1f%%, max %.1f%%\n", n, 100 * mean,
              100 * worst);
  // The issue's targets: mean 5 %, max 10 % (measured: 3.4 % and 7.3 %, search/profiles/README.md).
  EXPECT_LE(mean, 0.05);
  EXPECT_LE(worst, 0.10);
}

// The issue's target for each Table 1 model: the plan the search chooses predicted at least as
// fast as the paper's plan, within the device's memory. Here the first row with a pipeline, 18.4B
// on 256 GPUs (the whole space, about 7 s on the 2 vCPUs); every row:
// search/profiles/search_table1.py (search/profiles/README.md has the table).
TEST(PublishedMeasurements, TheSearchBeatsThePapersPlanForTable1s18BRow) {
  const ClusterProfile selene = ClusterProfile::load(profiles("a100-selene.json"));
  const nlohmann::json config = gpt_config(40, 48, 6144, 2048);
  const trace::ModelRef model = trace::ModelRef::registry("gpt", config);
  const AccelerateOptions o = plan_options(1024, 2048);
  // tp 8, no pipeline, dp 32: 32 micro-batches of 1 a step.
  const nlohmann::json paper =
      plan_for_cluster(model, 256, o, selene, published_plan(40, 8, 1, 1, 32));
  const nlohmann::json& paper_row = paper.at("candidates").at(0);
  ASSERT_FALSE(paper_row.contains("reason")) << paper_row.dump();
  const nlohmann::json searched = plan_for_cluster(model, 256, o, selene);
  // Its chosen row (acc::ValueError when there is none).
  const nlohmann::json chosen = cache_from_report(searched, {}).predicted;
  const double step = chosen.at("time").at("step_s");
  const double paper_step = paper_row.at("predicted").at("time").at("step_s");
  const int64_t peak = chosen.at("memory").at("peak");
  std::printf("18.4B on 256: chosen %s, %.2f s at %.1f GiB; the paper's plan %.2f s\n",
              searched.at("chosen_name").get<std::string>().c_str(), step,
              static_cast<double>(peak) / (1 << 30), paper_step);
  EXPECT_LE(step, paper_step);
  EXPECT_LE(peak, searched.at("budget_bytes").get<int64_t>());
  EXPECT_GT(step, 0.2 * paper_step);  // a gain of 5x would be a pricing error, not a plan
}

TEST(PublishedMeasurements, VTrainMultiNodeIterationTimes) {
  const ClusterProfile cluster = ClusterProfile::load(profiles("a100-vtrain.json"));
  std::ifstream in(profiles("published/vtrain_ground_truth_multi.csv"));
  ASSERT_TRUE(in.good());
  std::string line;
  double sum = 0, worst = 0;
  int n = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || !std::isdigit(static_cast<unsigned char>(line[0]))) {
      continue;  // the note and the header
    }
    std::vector<double> f;
    std::stringstream cells(line);
    for (std::string cell; std::getline(cells, cell, ',');) f.push_back(std::stod(cell));
    ASSERT_EQ(f.size(), 12u) << line;
    const int gpus = static_cast<int>(f[1]), tp = static_cast<int>(f[8]),
              pp = static_cast<int>(f[10]);
    const int64_t B = static_cast<int64_t>(f[2]), mb = static_cast<int64_t>(f[3]),
                  h = static_cast<int64_t>(f[4]), heads = static_cast<int64_t>(f[5]),
                  l = static_cast<int64_t>(f[6]), seq = static_cast<int64_t>(f[7]);
    const int64_t dp = static_cast<int64_t>(f[9]);
    const double measured = f[11] / 1e3;
    // vTrain's runs: 1F1B, every block recomputed (its configs' use_checkpoint).
    const nlohmann::json p = predicted(gpt_config(l, heads, h, seq), gpus, B, seq, cluster,
                                       published_plan(l, tp, pp, 1, B / dp / mb));
    const double step = p.at("time").at("step_s");
    const double err = (step - measured) / measured;
    sum += std::abs(err);
    worst = std::max(worst, std::abs(err));
    ++n;
    if (verbose()) {
      std::printf(
          "%.1fB %d GPUs tp%d dp%lld pp%d mb%lld: measured %.2f s, predicted %.2f s "
          "(%+.1f%%)\n",
          f[0], gpus, tp, static_cast<long long>(dp), pp, static_cast<long long>(mb), measured,
          step, 100 * err);
    }
  }
  ASSERT_EQ(n, 109);
  const double mean = sum / n;
  std::printf("vTrain multi-node: %d rows, mean |error| %.1f%%, max %.1f%%\n", n, 100 * mean,
              100 * worst);
  EXPECT_LE(mean, 0.10);  // the issue's target
}

TEST(PlanForCluster, APinnedPlanThatDoesNotFitSaysWhyAndBadSizesAreNamed) {
  const ClusterProfile selene = ClusterProfile::load(profiles("a100-selene.json"));
  // GPT-3 175B on 8 GPUs with tp 8 alone cannot hold its training state.
  AccelerateOptions o = plan_options(8, 2048);
  const trace::ModelRef gpt3 = trace::ModelRef::registry("gpt", gpt_config(96, 96, 12288, 2048));
  const nlohmann::json r = plan_for_cluster(gpt3, 8, o, selene, published_plan(96, 8, 1, 1, 8));
  const nlohmann::json& row = r.at("candidates").at(0);
  EXPECT_NE(row.value("reason", "").find("over the device's"), std::string::npos) << row.dump();
  EXPECT_GT(row.at("predicted").at("memory").at("peak").get<double>(), 80.0 * (1 << 30));
  // A mesh that does not tile the world, and a batch its dp does not split.
  EXPECT_THROW(plan_for_cluster(gpt3, 12, o, selene, published_plan(96, 8, 1, 1, 1)), ValueError);
  o.global_batch = 6;
  try {
    plan_for_cluster(gpt3, 32, o, selene, published_plan(96, 8, 1, 1, 1));
    ADD_FAILURE() << "a batch of 6 over dp 4 was planned";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("global batch 6"), std::string::npos) << e.what();
  }
}

// An interleaved pipeline's rank traced at one block does not hold both of its stages: its
// extrapolated messages came out negative (comm_s -0.84 s for this plan) until more blocks were
// held to cost at least what one does.
TEST(PlanForCluster, EveryPartOfAnInterleavedPipelinesStepIsNonNegative) {
  const ClusterProfile selene = ClusterProfile::load(profiles("a100-selene.json"));
  const strategies::Strategy plan = strategies::parse_strategy(nlohmann::json::parse(R"([
      {"name": "tensor_parallel", "config": {"size": 8}},
      {"name": "sequence_parallel", "config": {"kind": "megatron"}},
      {"name": "pipeline_parallel", "config": {"size": 2, "virtual": 2, "micro_batches": 8}},
      {"name": "amp"}, {"name": "ddp"}])"));
  const nlohmann::json p =
      predicted(gpt_config(24, 24, 2304, 2048), 32, 512, 2048, selene, plan).at("time");
  for (const auto& [part, seconds] : p.items()) EXPECT_GE(seconds.get<double>(), 0) << part;
  EXPECT_GT(p.at("comm_s").get<double>(), 0);
}

TEST(PlanForCluster, ReportsModelTflopsAndMfuOfThePlan) {
  const ClusterProfile h100 = ClusterProfile::load(profiles("h100-dgx.json"));
  const AccelerateOptions o = plan_options(64, 2048);
  const nlohmann::json r =
      plan_for_cluster(trace::ModelRef::registry("gpt", gpt_config(24, 24, 2304, 2048)), 16, o,
                       h100, published_plan(24, 2, 1, 1, 4));
  const nlohmann::json& p = r.at("candidates").at(0).at("predicted");
  const double tflops = p.at("model_tflops_per_device");
  // 6 N D plus attention, over the step and 16 devices: within the trace's own count.
  const double N = 12.0 * 24 * 2304 * 2304 + 51200.0 * 2304;
  const double approx = 6 * N * 64 * 2048 / p.at("time").at("step_s").get<double>() / 16 / 1e12;
  EXPECT_NEAR(tflops / approx, 1.0, 0.15);
  EXPECT_NEAR(p.at("mfu").get<double>(), tflops / 989, 1e-9);
  EXPECT_GT(p.at("mfu").get<double>(), 0.05);
  EXPECT_LT(p.at("mfu").get<double>(), 0.8);
  EXPECT_EQ(r.at("cluster").at("name"), h100.name);
}

// The user's optimizer sets the plan's optimizer state: AdamW two f32 buffers a parameter, SGD
// with momentum one, plain SGD none (no factory: AdamW); the update's pass over them shrinks too.
TEST(PlanForCluster, TheOptimizersStateIsTheOneGiven) {
  const ClusterProfile selene = ClusterProfile::load(profiles("a100-selene.json"));
  const AccelerateOptions o = plan_options(64, 2048);
  const trace::ModelRef gpt = trace::ModelRef::registry("gpt", gpt_config(24, 24, 2304, 2048));
  auto plan = [&](const optim::OptimizerFactory& f) {
    return plan_for_cluster(gpt, 16, o, selene, published_plan(24, 2, 1, 1, 4), f)
        .at("candidates")
        .at(0)
        .at("predicted");
  };
  const nlohmann::json adamw = plan(optim::AdamW::factory({}));
  const nlohmann::json fallback = plan({});
  const nlohmann::json momentum = plan(optim::SGD::factory({.momentum = 0.9}));
  const nlohmann::json sgd = plan(optim::SGD::factory({}));
  auto state = [](const nlohmann::json& p) {
    return p.at("memory").at("optimizer_state").get<int64_t>();
  };
  auto params = [](const nlohmann::json& p) {
    return p.at("memory").at("parameters").get<int64_t>();
  };
  EXPECT_EQ(state(adamw), state(fallback));
  EXPECT_EQ(state(adamw), 2 * params(adamw));  // f32 parameters, tp 2's shard on each device
  EXPECT_EQ(state(momentum), params(momentum));
  EXPECT_EQ(state(sgd), 0);
  EXPECT_EQ(adamw.at("memory").at("peak").get<int64_t>() -
                momentum.at("memory").at("peak").get<int64_t>(),
            params(adamw));
  EXPECT_LT(momentum.at("time").at("optimizer_s").get<double>(),
            adamw.at("time").at("optimizer_s").get<double>());
}

// Told the candidates (expect), the cost model prices each rank trace's micro-batches and dp
// sizes from its traces at 2 and 3 samples: on a cluster profile (GEMM efficiency by shape, each
// group placed by the mesh), every candidate of the space at 8 devices (dp methods, amp,
// recomputation, accumulation, tp, sp, pp) is predicted exactly as without it, from fewer traces.
TEST(CostModel, ExpectedMicroBatchesGiveTheSameTimesFromFewerTraces) {
  const nlohmann::json config = {
      {"n_layer", 4}, {"n_head", 4}, {"n_embd", 64}, {"vocab_size", 256}, {"block_size", 64}};
  const int64_t T = 32;
  const auto model = trace::ModelRef::registry("gpt", config);
  const ClusterProfile selene = ClusterProfile::load(profiles("a100-selene.json"));
  const SpaceOptions so = space_of(8, 32, T, true);
  MemoryModel memory(model, T);
  const auto cands = enumerate_candidates(so, memory.num_blocks());
  CostModel direct(model, T, selene), told(model, T, selene);
  told.expect(cands);
  size_t priced = 0;
  for (const Candidate& c : cands) {
    if (memory.layout_refusal(c)) continue;
    ASSERT_EQ(told.predict(c).to_json(), direct.predict(c).to_json())
        << c.describe() << " micro-batch " << c.micro_batch;
    ++priced;
  }
  EXPECT_GT(priced, 500u);
  EXPECT_LT(2 * told.passes_priced(), direct.passes_priced())
      << "told " << told.passes_priced() << ", direct " << direct.passes_priced();
}

// The pp ranks of pipelines of every depth that run alike share their traces (one cache for the
// memory and the time model, as the search keeps): every prediction equals the one from traces
// made afresh for each candidate's ranks.
TEST(TraceCache, SharedTracesGiveThePredictionsOfFreshOnes) {
  const int64_t T = 16;
  const auto model = trace::ModelRef::registry("gpt", eight_block_gpt());
  const ClusterProfile selene = ClusterProfile::load(profiles("a100-selene.json"));
  const SpaceOptions so = space_of(8, 8, T, false);
  MemoryModel fresh_memory(model, T), memory(model, T);
  CostModel fresh_cost(model, T, selene), cost(model, T, selene);
  fresh_memory.share_traces(nullptr);
  fresh_cost.share_traces(nullptr);
  cost.share_traces(memory.traces());
  const auto cands = enumerate_candidates(so, memory.num_blocks());
  std::set<int> depths;
  size_t predicted = 0;
  for (const Candidate& c : cands) {
    if (fresh_memory.layout_refusal(c)) continue;
    ASSERT_FALSE(memory.layout_refusal(c).has_value()) << c.describe();
    ASSERT_EQ(memory.predict(c).to_json(), fresh_memory.predict(c).to_json())
        << c.describe() << " micro-batch " << c.micro_batch;
    ASSERT_EQ(cost.predict(c).to_json(), fresh_cost.predict(c).to_json())
        << c.describe() << " micro-batch " << c.micro_batch;
    depths.insert(c.mesh.pp);
    ++predicted;
  }
  EXPECT_EQ(depths, (std::set<int>{1, 2, 4, 8}));
  EXPECT_GT(predicted, 200u);
  // Each trace made was asked for again at least as often (by another depth's ranks, by the
  // other model): the traces of 1 and 2 blocks as their digests and figures, the deeper ones'
  // figures.
  const trace::TraceCache& traces = *memory.traces();
  EXPECT_GT(traces.traced(), 0u);
  EXPECT_GT(traces.digests_made(), 0u);
  EXPECT_GE(traces.digests_served() + traces.figures_served(), traces.traced())
      << traces.traced() << " made, " << traces.digests_served() << " digests and "
      << traces.figures_served() << " figures served";
}

// The time model prices a rank's traces of 1 and 2 blocks from their digests
// (search/ops_digest.hpp), which the search's trace cache keeps instead of the traces: the digest
// at any batch from the pair at 2 and 3 samples is, field for field, the digest of the trace made
// at that batch, and its GEMMs are that trace's, for every rank of each tp, sp and pipeline
// layout of a 4-rank space, of GPT and a GQA Llama: plain, with its first block recomputed (and
// bf16 activations), and recomputed selectively.
TEST(OpsDigest, AtAnyBatchIsTheDigestOfTheTraceMadeThere) {
  const int64_t T = 16;
  const nlohmann::json llama = {{"hidden_size", 32},
                                {"intermediate_size", 88},
                                {"num_hidden_layers", 4},
                                {"num_attention_heads", 4},
                                {"num_key_value_heads", 2},
                                {"vocab_size", 128},
                                {"max_position_embeddings", 32}};
  std::set<std::string> layouts;
  size_t compared = 0;
  for (const auto& model : {trace::ModelRef::registry("gpt", eight_block_gpt()),
                            trace::ModelRef::registry("llama", llama)}) {
    MemoryModel memory(model, T);
    const std::vector<trace::TraceOptions> options = {
        {},
        {.recompute = trace::Recompute::kBlock, .recompute_blocks = 1, .bf16_activations = true},
        {.recompute = trace::Recompute::kSelective, .recompute_blocks = 1}};
    for (const Candidate& c : enumerate_candidates(space_of(4, 16, T, true), memory.num_blocks())) {
      if (memory.layout_refusal(c) || !layouts.insert(model.type() + c.layout_key()).second) {
        continue;
      }
      for (const RankModel& r : rank_models(model, c, T)) {
        for (const trace::TraceOptions& o : options) {
          for (const int64_t depth : {1, 2}) {
            auto digest_at = [&](int64_t b) {
              return detail::digest_ops(r.model.trace(depth, b, T, o).trace);
            };
            detail::OpsDigestPair pair(digest_at(2), digest_at(3));
            ASSERT_TRUE(pair.affine()) << c.describe() << ", " << depth << " blocks";
            for (const int64_t b : {3, 7}) {
              const trace::Trace made = r.model.trace(depth, b, T, o).trace;
              const auto fresh = detail::digest_ops(made);
              const detail::OpsDigest& want = detail::ops_of(fresh);
              const detail::OpsDigest& got = pair.at(b);
              const std::string what =
                  c.describe() + ", " + std::to_string(depth) + " blocks at " + std::to_string(b);
              ASSERT_TRUE(got.same_as(want)) << what;
              const auto got_gemms = detail::gemm_counts(got);
              const auto want_gemms = gemm_counts(made);
              ASSERT_EQ(got_gemms.size(), want_gemms.size()) << what;
              for (size_t i = 0; i < got_gemms.size(); ++i) {
                EXPECT_EQ(got_gemms[i].shape, want_gemms[i].shape) << what;
                EXPECT_EQ(got_gemms[i].forward, want_gemms[i].forward) << what;
                EXPECT_EQ(got_gemms[i].backward, want_gemms[i].backward) << what;
              }
              ++compared;
            }
          }
        }
      }
    }
  }
  // Layouts of tp 2 and 4, sp, and pipelines of 2 and 4 (their first, middle and last ranks).
  EXPECT_GE(layouts.size(), 70u) << layouts.size() << " layouts";
  EXPECT_GE(compared, 1800u) << compared << " digests compared";
}

// MemoryModel::expect makes the candidates' needs ahead, on two threads here (the trace keys'
// pairs split between them, the traces shared through one cache): every prediction is the one a
// model that made each need when first asked gives, on one thread, over a space of tp, sp,
// pipelines of every depth and the data-parallel methods (fsdp's blockwise needs too); and the
// needs were all made by expect, none by the predictions.
TEST(MemoryModel, NeedsMadeAheadOnTwoThreadsGiveThePredictionsOfOne) {
  const int64_t T = 16;
  const auto model = trace::ModelRef::registry("gpt", eight_block_gpt());
  MemoryModel asked(model, T), ahead(model, T);
  const auto cands = enumerate_candidates(space_of(8, 8, T, true), asked.num_blocks());
  on_threads(2, [&] { ahead.expect(cands); });
  const size_t made_ahead = ahead.needs_traced();
  EXPECT_GT(made_ahead, 50u);
  std::set<int> depths;
  size_t predicted = 0, sharded = 0;
  for (const Candidate& c : cands) {
    if (asked.layout_refusal(c)) continue;
    ASSERT_FALSE(ahead.layout_refusal(c).has_value()) << c.describe();
    ASSERT_EQ(ahead.predict(c).to_json(), asked.predict(c).to_json())
        << c.describe() << " micro-batch " << c.micro_batch;
    depths.insert(c.mesh.pp);
    ++predicted;
    sharded += c.effects.shard_parameters ? 1 : 0;
  }
  EXPECT_EQ(depths, (std::set<int>{1, 2, 4, 8}));
  EXPECT_GT(predicted, 200u);
  EXPECT_GT(sharded, 20u);
  // The predictions made no need: expect made them all, the blockwise ones of sharded
  // parameters too.
  EXPECT_EQ(ahead.needs_traced(), made_ahead)
      << made_ahead << " made ahead, " << ahead.needs_traced() << " in all";
}

// MemoryModel::predict_all gives predict's figures in the candidates' order. After expect every
// prediction only reads what it made (none is left to the calling thread, no need is made), on two
// threads; without expect each is made as predict makes it.
TEST(MemoryModel, PredictAllOnTwoThreadsGivesPredictOfEach) {
  const int64_t T = 16;
  const auto model = trace::ModelRef::registry("gpt", eight_block_gpt());
  MemoryModel asked(model, T), ahead(model, T), told_nothing(model, T);
  const auto cands = enumerate_candidates(space_of(8, 8, T, true), asked.num_blocks());
  std::vector<const Candidate*> runnable;
  for (const Candidate& c : cands) {
    if (!asked.layout_refusal(c)) runnable.push_back(&c);
  }
  std::vector<MemoryPrediction> all, fresh;
  on_threads(2, [&] {
    ahead.expect(cands);
    const size_t made_ahead = ahead.needs_traced();
    for (const Candidate& c : cands) (void)ahead.layout_refusal(c);
    all = ahead.predict_all(runnable);
    EXPECT_EQ(ahead.needs_traced(), made_ahead);
    fresh = told_nothing.predict_all(runnable);
  });
  ASSERT_EQ(all.size(), runnable.size());
  ASSERT_EQ(fresh.size(), runnable.size());
  EXPECT_GT(runnable.size(), 200u);
  std::set<int> depths;
  for (size_t i = 0; i < runnable.size(); ++i) {
    const std::string want = asked.predict(*runnable[i]).to_json().dump();
    ASSERT_EQ(all[i].to_json().dump(), want) << runnable[i]->describe();
    ASSERT_EQ(fresh[i].to_json().dump(), want) << runnable[i]->describe();
    depths.insert(runnable[i]->mesh.pp);
  }
  EXPECT_EQ(depths, (std::set<int>{1, 2, 4, 8}));
  EXPECT_EQ(ahead.predictions_left(), 0u);
  EXPECT_EQ(told_nothing.predictions_left(), runnable.size());
}

// CostModel::expect makes the passes of the candidates it is told of on the configured threads:
// each prediction (and each pipeline's stage ends, which a re-cut reads) is the one of a model
// told nothing (each pass made as it is asked), on a cluster (a pass per dp) and sharing the
// memory model's rank models and traces, as a plan-only search does; the predictions then make
// no pass.
TEST(CostModel, PassesMadeAheadOnTwoThreadsGiveThePredictionsOfOne) {
  const int64_t T = 16;
  const auto model = trace::ModelRef::registry("gpt", eight_block_gpt());
  const ClusterProfile selene = ClusterProfile::load(profiles("a100-selene.json"));
  MemoryModel memory(model, T);
  CostModel asked(model, T, selene), ahead(model, T, selene);
  ahead.share_rank_models(memory.rank_models());
  const auto cands = enumerate_candidates(space_of(8, 16, T, true), memory.num_blocks());
  std::vector<const Candidate*> runnable;
  for (const Candidate& c : cands) {
    if (!memory.layout_refusal(c)) runnable.push_back(&c);
  }
  on_threads(2, [&] { ahead.expect(runnable); });
  const size_t made_ahead = ahead.passes_priced();
  EXPECT_GT(made_ahead, 50u);
  std::set<int> depths;
  for (const Candidate* c : runnable) {
    ASSERT_EQ(ahead.predict(*c).to_json(), asked.predict(*c).to_json())
        << c->describe() << " micro-batch " << c->micro_batch;
    depths.insert(c->mesh.pp);
    // A pipeline's stage ends (its first and last ranks without recomputation: a re-cut's).
    if (c->mesh.pp == 1) continue;
    const auto ends = ahead.stage_ends(*c), fresh = asked.stage_ends(*c);
    ASSERT_TRUE(ends && fresh) << c->describe();
    EXPECT_EQ(ends->first, fresh->first) << c->describe();
    EXPECT_EQ(ends->last, fresh->last) << c->describe();
  }
  EXPECT_EQ(depths, (std::set<int>{1, 2, 4, 8}));
  EXPECT_GT(runnable.size(), 200u);
  EXPECT_EQ(ahead.passes_priced(), made_ahead)
      << made_ahead << " made ahead, " << ahead.passes_priced() << " in all";
  // Rank models of another model are refused.
  EXPECT_THROW(CostModel(trace::ModelRef::registry("gpt", eight_block_gpt()), T + 1, selene)
                   .share_rank_models(memory.rank_models()),
               InternalError);
}

// A module of the user's is traced in place (its parameters swapped to meta storage and back, its
// Linear pairs replaced by tensor-parallel shards and put back): expect makes all of its needs on
// one thread, whatever the threads configured. Over a space of tensor parallel and the
// data-parallel methods: every prediction is the one made without expect, and the module's
// parameters end where they began (on the CPU, their values unchanged).
TEST(MemoryModel, AModuleOfTheUsersNeedsAreMadeOnOneThread) {
  struct Block : nn::Module {
    Block() : nn::Module("Block") {
      fc1 = register_module("fc1", std::make_shared<nn::Linear>(16, 32));
      fc2 = register_module("fc2", std::make_shared<nn::Linear>(32, 16));
    }
    Tensor forward(const Tensor& x) override { return add(x, (*fc2)(gelu((*fc1)(x)))); }
    std::shared_ptr<nn::Linear> fc1, fc2;
  };
  struct Net : nn::Module {
    Net() : nn::Module("Net") {
      a = register_module("a", std::make_shared<Block>());
      b = register_module("b", std::make_shared<Block>());
    }
    Tensor forward(const Tensor& x) override { return (*b)((*a)(x)); }
    std::shared_ptr<Block> a, b;
  };
  auto net = std::make_shared<Net>();
  std::map<std::string, std::vector<float>> before;
  for (const auto& [name, p] : net->named_parameters()) before[name] = p.to_vector<float>();
  const auto model = trace::ModelRef::module(
      net, data::Batch(std::vector<data::Batch::Entry>{{"x", randn({4, 16})}}),
      [](nn::Module& m, const data::Batch& b) { return mean(m.forward(b.at("x"))); });
  SpaceOptions so = space_of(4, 16, 1, false);
  so.has_attention = false;
  so.language_model = false;
  MemoryModel asked(model, 1), ahead(model, 1);
  const auto cands = enumerate_candidates(so, asked.num_blocks());
  on_threads(2, [&] { ahead.expect(cands); });
  EXPECT_GT(ahead.needs_traced(), 0u);
  std::set<int> tp;
  for (const Candidate& c : cands) {
    if (asked.layout_refusal(c)) continue;
    ASSERT_FALSE(ahead.layout_refusal(c).has_value()) << c.describe();
    ASSERT_EQ(ahead.predict(c).to_json(), asked.predict(c).to_json())
        << c.describe() << " micro-batch " << c.micro_batch;
    tp.insert(c.mesh.tp);
  }
  EXPECT_TRUE(tp.count(2) != 0 && tp.count(1) != 0) << "tensor-parallel candidates predicted";
  for (const auto& [name, p] : net->named_parameters()) {
    EXPECT_FALSE(p.is_meta()) << name;
    EXPECT_EQ(p.to_vector<float>(), before.at(name)) << name;
  }
}

}  // namespace
}  // namespace acc::search
