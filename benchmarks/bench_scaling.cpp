// bench_scaling: data-parallel throughput under mpirun, one JSON line per strategy (rank 0).
//
//   mpirun -np 2 build/benchmarks/bench_scaling --config gpt17m --strategies ddp,zero1,zero2,fsdp
//   mpirun -np 2 build/benchmarks/bench_scaling ... --skip-sync   (compute alone: no gradient sync)
//
// Every rank trains the same model on its own batch of --batch-size sequences (the global batch
// grows with the ranks), one thread per rank unless --threads says otherwise. The exposed
// communication of a strategy is 1 - t(skip-sync) / t(sync) from two runs (benchmarks/scaling.sh
// does both and compares with PyTorch DDP).

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"

namespace {

nlohmann::json config_for(const std::string& name) {
  const std::string dir = ACC_SOURCE_DIR "/examples/configs/";
  if (name == "gpt17m") return acc::models::read_json_file(dir + "gpt_17m.json");
  if (name == "gpt90m") return acc::models::read_json_file(dir + "gpt_90m.json");
  if (name == "llama17m") return acc::models::read_json_file(dir + "llama_d512.json");
  return acc::models::read_json_file(name);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "gpt17m", strategies_arg = "ddp,zero1,zero2,fsdp", model_type = "gpt";
  int64_t batch = 8, seq = 256, warmup = 2, steps = 6;
  int threads = 1;
  bool skip_sync = false;
  CLI::App app{"Data-parallel training throughput per strategy"};
  app.add_option("--config", config, "gpt17m | gpt90m | llama17m | FILE.json")
      ->capture_default_str();
  app.add_option("--model", model_type, "gpt | llama (with a FILE.json config)");
  app.add_option("--strategies", strategies_arg, "comma-separated data-parallel methods")
      ->capture_default_str();
  app.add_option("--batch-size", batch, "sequences per rank")->capture_default_str();
  app.add_option("--seq-len", seq, "tokens per sequence")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--threads", threads, "threads per rank")->capture_default_str();
  app.add_flag("--skip-sync", skip_sync, "benchmark-only: no gradient synchronisation");
  CLI11_PARSE(app, argc, argv);
  int rc = 0;
  try {
    using namespace acc;
    dist::init(argc, argv);
    set_num_threads(threads);
    auto world = dist::ProcessGroup::world();
    if (config == "llama17m") model_type = "llama";
    std::stringstream ss(strategies_arg);
    std::string name;
    while (std::getline(ss, name, ',')) {
      const auto strategy = strategies::parse_strategy(nlohmann::json::array({{{"name", name}}}));
      memory::reset_peak();
      manual_seed(1);
      auto model = models::create_model(model_type, config_for(config));
      auto trainer = strategies::apply(
          model, optim::AdamW::factory({.lr = 1e-4, .betas = {0.9, 0.95}, .weight_decay = 0.1}),
          strategy, {.group = world, .grad_clip = 1.0, .benchmark_skip_gradient_sync = skip_sync});
      Generator gen = Generator(7).for_rank(world->rank());
      std::vector<double> ms;
      for (int64_t s = 0; s < warmup + steps; ++s) {
        data::Batch b{randint(0, model->vocab_size(), {batch, seq}, gen),
                      randint(0, model->vocab_size(), {batch, seq}, gen)};
        world->barrier()->wait();  // every step starts together
        const auto t0 = std::chrono::steady_clock::now();
        trainer->train_step(b);
        const double t =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        if (s >= warmup) ms.push_back(t);
      }
      // The slowest rank's median step is the step.
      Tensor m = from_vector(std::vector<float>{static_cast<float>(median(ms))}, {1});
      world->allreduce(m, dist::ReduceOp::kMax)->wait();
      const double step_ms = m.item();
      if (world->rank() == 0) {
        nlohmann::json out = {
            {"strategy", name},
            {"config", config},
            {"world", world->size()},
            {"threads_per_rank", threads},
            {"skip_sync", skip_sync},
            {"batch_per_rank", batch},
            {"seq_len", seq},
            {"steps", steps},
            {"median_step_ms", step_ms},
            {"tokens_per_s", static_cast<double>(batch * seq * world->size()) / (step_ms / 1e3)},
            {"peak_tracked_bytes", memory::peak_bytes()}};
        std::printf("%s\n", out.dump().c_str());
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_scaling: error: %s\n", e.what());
    rc = 1;
  }
  acc::dist::finalize();
  return rc;
}
