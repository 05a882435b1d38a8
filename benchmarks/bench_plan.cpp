// bench_plan: how fast the plan-only search prices candidates for a cluster not at hand (issue
// 34's target: >= 1e5 candidate evaluations per second per core; GPT-3 175B on 1024 devices end
// to end in < 10 s). One process, --threads threads (default 1). Prints one JSON object:
//
//   enumerate_s        the space (search::enumerate_candidates)
//   cold.memory_s      every candidate's memory (search::MemoryModel::predict_all, layouts
//                      checked first), its needs made ahead on the threads (MemoryModel::expect)
//   cold.time_s        every candidate that can run priced (search::CostModel::predict), its
//                      passes made ahead likewise (CostModel::expect of those candidates)
//   cold.evals_per_s   candidates / (memory_s + time_s): what a first search sees
//   warm.evals_per_s   the same pricing again with every trace cached (median of --repeat passes):
//                      what an evaluation costs beyond its traces
//   traces             memory needs and time passes the cold pass traced (told the candidates,
//                      as the search tells them: each rank trace's micro-batches from 2 up come
//                      from one pair of traces, trace::BatchTraces; micro-batch 1 is its own),
//                      and the memory predictions predict_all left to one thread (0: expect made
//                      everything they read); the traces of 1 and 2 blocks are kept as the time
//                      model's digests of them (digests_kept, digests_served)
//
//   bench_plan --config C.json --world 64 --global-batch 1536 --seq-len 2048
//       --cluster search/profiles/a100-selene.json   (one command line)

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "acc/search/cluster.hpp"
#include "acc/search/cost.hpp"
#include "acc/search/space.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/json.hpp"
#include "bench_util.hpp"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace acc;
  std::string model_type = "gpt", config_path, cluster_path;
  int world = 0, repeat = 3, threads = 1;
  int64_t global_batch = 0, seq_len = 0;
  CLI::App app{"bench_plan: plan-only candidate evaluations per second (JSON)"};
  app.add_option("--model", model_type, "registry model type")->capture_default_str();
  app.add_option("--config", config_path, "model config JSON")->required();
  app.add_option("--cluster", cluster_path, "cluster profile JSON")->required();
  app.add_option("--world", world, "devices")->required()->check(CLI::Range(1, 1 << 20));
  app.add_option("--global-batch", global_batch, "samples a step")
      ->required()
      ->check(CLI::PositiveNumber);
  app.add_option("--seq-len", seq_len, "tokens a sample")->required()->check(CLI::PositiveNumber);
  app.add_option("--repeat", repeat, "warm passes")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--threads", threads,
                 "threads (1: the per-core figures; the cold memory pass makes its needs on all)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    set_num_threads(threads);
    const trace::ModelRef model =
        trace::ModelRef::registry(model_type, read_json_file(config_path, "--config"));
    const search::ClusterProfile cluster = search::ClusterProfile::load(cluster_path);
    search::MemoryModel memory(model, seq_len);
    search::CostModel cost(model, seq_len, cluster);
    cost.share_rank_models(memory.rank_models());  // as auto_accelerate's search does

    auto t0 = std::chrono::steady_clock::now();
    search::SpaceOptions so;
    so.world = world;
    so.global_batch = global_batch;
    so.seq_len = seq_len;
    so.allow_bf16 = true;
    so.has_attention = model.has_attention();
    so.language_model = model.is_registry();
    const std::vector<search::Candidate> candidates =
        search::enumerate_candidates(so, memory.num_blocks());
    const double enumerate_s = seconds_since(t0);

    // Cold: layouts checked, memory predicted, and the candidates that can run priced.
    t0 = std::chrono::steady_clock::now();
    std::vector<const search::Candidate*> runnable;
    int64_t checksum = 0;       // keeps the predictions from being optimised away
    memory.expect(candidates);  // as auto_accelerate's search does
    for (const auto& c : candidates) {
      if (!memory.layout_refusal(c)) runnable.push_back(&c);
    }
    for (const auto& m : memory.predict_all(runnable)) checksum += m.peak % 1000;
    const double memory_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    // The passes of the candidates it prices made ahead, as a search does for those that fit.
    cost.expect(runnable);
    double step_sum = 0;
    for (const auto* c : runnable) step_sum += cost.predict(*c).step_s;
    const double time_s = seconds_since(t0);

    // Warm: the same again, every trace cached.
    std::vector<double> warm;
    for (int r = 0; r < repeat; ++r) {
      t0 = std::chrono::steady_clock::now();
      for (const auto* c : runnable) {
        checksum += memory.predict(*c).peak % 1000;
        step_sum += cost.predict(*c).step_s;
      }
      warm.push_back(static_cast<double>(runnable.size()) / seconds_since(t0));
    }
    const double n = static_cast<double>(candidates.size());
    const nlohmann::json out = {
        {"model", config_path},
        {"cluster", cluster.name},
        {"world", world},
        {"threads", threads},
        {"global_batch", global_batch},
        {"seq_len", seq_len},
        {"candidates", candidates.size()},
        {"runnable", runnable.size()},
        {"enumerate_s", enumerate_s},
        {"cold",
         {{"memory_s", memory_s},
          {"time_s", time_s},
          {"evals_per_s", n / (memory_s + time_s)},
          {"end_to_end_s", enumerate_s + memory_s + time_s}}},
        {"warm", {{"evals_per_s", bench::median(warm)}, {"passes", repeat}}},
        {"traces",
         {{"memory_needs", memory.needs_traced()},
          {"memory_predictions_left", memory.predictions_left()},
          {"time_passes", cost.passes_priced()},
          {"made", memory.traces()->traced()},
          {"made_not_kept", memory.traces()->dropped()},
          {"refused", memory.traces()->refused()},
          {"served_again", memory.traces()->served()},
          {"samples_evaluated", memory.traces()->figures_made()},
          {"samples_served_again", memory.traces()->figures_served()},
          {"digests_kept", memory.traces()->digests_made()},
          {"digests_served", memory.traces()->digests_served()}}},
        {"checksum", static_cast<double>(checksum) + step_sum}};
    std::printf("%s\n", out.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_plan: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
