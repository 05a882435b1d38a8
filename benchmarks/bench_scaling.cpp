// bench_scaling: data-parallel throughput under mpirun, one JSON line per strategy (rank 0).
//
//   mpirun -np 2 build/benchmarks/bench_scaling --config gpt17m --strategies ddp,zero1,zero2,fsdp
//   mpirun -np 2 build/benchmarks/bench_scaling ... --sync alternate
//
// Every rank trains the same model on its own batch of --batch-size sequences (the global batch
// grows with the ranks), one thread per rank unless --threads says otherwise. --sync off is the
// benchmark-only switch that skips gradient synchronisation (and fsdp's parameter gathers):
// compute alone. --sync alternate interleaves synchronised and skipped steps in one run, so the
// machine's noise (this machine is shared) hits both alike, and reports the exposed communication
// 1 - t(skipped) / t(sync) from the two medians, and the median over adjacent (synchronised,
// skipped) pairs of the same ratio. A step's time is its slowest rank's (the maximum over ranks,
// step by step), in both kinds of step. benchmarks/scaling.sh compares with PyTorch DDP.

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
  const std::string dir = ACC_SOURCE_DIR "/examples/configs/";
  if (name == "gpt17m") return acc::models::read_json_file(dir + "gpt_17m.json");
  if (name == "gpt90m") return acc::models::read_json_file(dir + "gpt_90m.json");
  if (name == "llama17m") return acc::models::read_json_file(dir + "llama_d512.json");
  return acc::models::read_json_file(name);
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "gpt17m", strategies_arg = "ddp,zero1,zero2,fsdp", model_type = "gpt";
  int64_t batch = 8, seq = 256, warmup = 2, steps = 6;
  int threads = 1;
  double bucket_mb = 0;
  std::string sync = "on";
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
  app.add_option("--sync", sync,
                 "on | off (benchmark-only: no gradient synchronisation) | alternate (both, "
                 "step by step)")
      ->check(CLI::IsMember({"on", "off", "alternate"}))
      ->capture_default_str();
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
      // Step s synchronises unless --sync off, or --sync alternate and s is odd; the warm-up
      // covers both kinds.
      auto skipped = [&](int64_t s) { return sync == "off" || (sync == "alternate" && s % 2); };
      std::vector<float> step_ms;  // this rank's timed steps, in order
      for (int64_t s = 0; s < warmup + steps; ++s) {
        data::Batch b{randint(0, model->vocab_size(), {batch, seq}, gen),
                      randint(0, model->vocab_size(), {batch, seq}, gen)};
        trainer->set_benchmark_skip_gradient_sync(skipped(s));
        world->barrier()->wait();  // every step starts together
        const auto t0 = std::chrono::steady_clock::now();
        trainer->train_step(b);
        const double t =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        if (s >= warmup) step_ms.push_back(static_cast<float>(t));
      }
      // A step of the job ends when its slowest rank ends (the next one starts from a barrier),
      // in synchronised and skipped steps alike: per step, the maximum over ranks.
      Tensor job = from_vector(step_ms, {static_cast<int64_t>(step_ms.size())});
      world->allreduce(job, dist::ReduceOp::kMax)->wait();
      const std::vector<float> job_ms = job.to_vector<float>();
      std::vector<double> ms[2];   // [0] synchronised steps, [1] skipped ones
      std::vector<double> paired;  // --sync alternate: 1 - skipped / the synchronised step before
      for (int64_t i = 0; i < steps; ++i) {
        ms[skipped(warmup + i) ? 1 : 0].push_back(job_ms[static_cast<size_t>(i)]);
        if (i > 0 && skipped(warmup + i) && !skipped(warmup + i - 1)) {
          paired.push_back(1.0 -
                           job_ms[static_cast<size_t>(i)] / job_ms[static_cast<size_t>(i - 1)]);
        }
      }
      const double sync_ms = median(ms[0]), skip_ms = median(ms[1]);
      if (world->rank() == 0) {
        const double tokens = static_cast<double>(batch * seq * world->size());
        // The headline figures are those of synchronised steps (of skipped ones under --sync off).
        const double step_ms = sync == "off" ? skip_ms : sync_ms;
        nlohmann::json out = {{"strategy", name},
                              {"config", config},
                              {"world", world->size()},
                              {"threads_per_rank", threads},
                              {"sync", sync},
                              {"batch_per_rank", batch},
                              {"seq_len", seq},
                              {"steps", steps},
                              {"median_step_ms", step_ms},
                              {"tokens_per_s", tokens / (step_ms / 1e3)},
                              {"peak_tracked_bytes", memory::peak_bytes()}};
        if (sync == "alternate") {
          out["median_step_ms_sync_skipped"] = skip_ms;
          out["tokens_per_s_sync_skipped"] = tokens / (skip_ms / 1e3);
          out["exposed_comm"] = 1.0 - skip_ms / sync_ms;
          out["exposed_comm_paired"] = median(paired);
        }
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
