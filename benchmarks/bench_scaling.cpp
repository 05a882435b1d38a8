// bench_scaling: data-parallel throughput under mpirun, one JSON line per strategy (rank 0).
//
//   mpirun -np 2 build/benchmarks/bench_scaling --config gpt17m --strategies ddp,zero1,zero2,fsdp
//
// Every rank trains the same model on its own batch of --batch-size sequences (the global batch
// grows with the ranks), one thread per rank unless --threads says otherwise. Every step starts
// from a barrier; a step of the job ends when its slowest rank ends, so the job's step time is,
// step by step, the maximum over ranks.
//
// Exposed communication is measured from outside the strategies: acc::dist::wait_seconds() read
// before and after each step gives the time that rank spent blocked in Work::wait, i.e. the
// communication that did not overlap its computation. exposed_comm is the median over steps of
// the slowest rank's wait time over its step time (the slowest rank sets the job's pace; a faster
// one also waits for it, which is imbalance, not communication). benchmarks/scaling.sh compares
// with PyTorch DDP.

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
#include "bench_util.hpp"

namespace {

using acc::bench::median;

nlohmann::json config_for(const std::string& name) {
  return acc::bench::named_config(name, ACC_SOURCE_DIR "/examples/configs/");
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "gpt17m", strategies_arg = "ddp,zero1,zero2,fsdp", model_type = "gpt";
  int64_t batch = 8, seq = 256, warmup = 2, steps = 6;
  int threads = 1;
  double bucket_mb = 0;
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
  app.add_option("--bucket-mb", bucket_mb,
                 "gradient bucket size of ddp, zero1 and zero2 (default: the strategy's own)");
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
      nlohmann::json entry = {{"name", name}};
      if (bucket_mb > 0 && name != "fsdp") entry["config"] = {{"bucket_mb", bucket_mb}};
      const auto strategy = strategies::parse_strategy(nlohmann::json::array({entry}));
      memory::reset_peak();
      manual_seed(1);
      auto model = models::create_model(model_type, config_for(config));
      auto trainer = strategies::apply(
          model, optim::AdamW::factory({.lr = 1e-4, .betas = {0.9, 0.95}, .weight_decay = 0.1}),
          strategy, {.group = world, .grad_clip = 1.0});
      Generator gen = Generator(7).for_rank(world->rank());
      // This rank's timed steps, in order: (step ms, ms blocked in Work::wait) pairs.
      std::vector<float> mine;
      for (int64_t s = 0; s < warmup + steps; ++s) {
        data::Batch b{randint(0, model->vocab_size(), {batch, seq}, gen),
                      randint(0, model->vocab_size(), {batch, seq}, gen)};
        world->barrier()->wait();  // every step starts together (its wait is not the step's)
        const double wait0 = dist::wait_seconds();
        const auto t0 = std::chrono::steady_clock::now();
        trainer->train_step(b);
        const double t =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        const double waited = (dist::wait_seconds() - wait0) * 1e3;
        if (s >= warmup) {
          mine.push_back(static_cast<float>(t));
          mine.push_back(static_cast<float>(waited));
        }
      }
      const int64_t n = static_cast<int64_t>(mine.size());
      Tensor all = empty({world->size() * n});
      world->allgather(all, from_vector(mine, {n}))->wait();
      const std::vector<float> v = all.to_vector<float>();
      std::vector<double> job_ms, wait_ms, exposed;  // per step, of its slowest rank
      for (int64_t i = 0; i < steps; ++i) {
        int slowest = 0;
        auto at = [&](int r, int k) { return v[static_cast<size_t>(r * n + 2 * i + k)]; };
        for (int r = 1; r < world->size(); ++r) {
          if (at(r, 0) > at(slowest, 0)) slowest = r;
        }
        job_ms.push_back(at(slowest, 0));
        wait_ms.push_back(at(slowest, 1));
        exposed.push_back(at(slowest, 1) / at(slowest, 0));
      }
      if (world->rank() == 0) {
        const double tokens = static_cast<double>(batch * seq * world->size());
        const double step_ms = median(job_ms);
        nlohmann::json out = {{"strategy", name},
                              {"config", config},
                              {"world", world->size()},
                              {"threads_per_rank", threads},
                              {"batch_per_rank", batch},
                              {"seq_len", seq},
                              {"steps", steps},
                              {"median_step_ms", step_ms},
                              {"tokens_per_s", tokens / (step_ms / 1e3)},
                              {"median_wait_ms", median(wait_ms)},
                              {"exposed_comm", median(exposed)},
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
