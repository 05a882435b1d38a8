// bench_prefetch: does data::PrefetchLoader hide a slow loader? One JSON line, one process:
//
//   OPENBLAS_NUM_THREADS=1 ACC_NUM_THREADS=1 build/benchmarks/bench_prefetch --reps 7
//
// A small GPT (--config, default a d128 L4 GPT, B 4 x T 128) trains with no strategy; a step is
// next() on the loader then train_step(). The loader is a BatchLoader made slow on purpose: it
// works --cost-share of a free step's time per batch (a CPU spin by default, as decoding or
// augmenting would; --cost sleep waits instead). Three configurations run in turns, --reps times
// (A B C, A B C, ...: a change of the machine's load weighs on all three alike):
//   free      the BatchLoader alone (building a batch costs ~microseconds)
//   slow      the slow loader on the training thread
//   prefetch  the slow loader inside a PrefetchLoader (--depth)
// each --steps timed steps after --warmup untimed ones. Figures: the median step time of each
// configuration over all its timed steps, each turn's median, and prefetch ÷ free (the target is
// at most 1.05) and slow ÷ free. The prefetch thread needs a core of its own: run with one
// training thread (ACC_NUM_THREADS=1) on a machine with two.

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "acc/acc.hpp"
#include "acc/data/prefetch.hpp"
#include "acc/util/json.hpp"
#include "bench_util.hpp"

namespace {

using acc::bench::median;

enum class Cost { kSpin, kSleep };

// A loader whose every batch costs `cost_ms` more than its inner loader's.
class SlowLoader : public acc::data::Loader {
 public:
  SlowLoader(std::unique_ptr<acc::data::Loader> inner, double cost_ms, Cost cost)
      : inner_(std::move(inner)),
        cost_(std::chrono::duration<double, std::milli>(cost_ms)),
        kind_(cost) {}

  acc::data::Batch next() override {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(cost_);
    if (kind_ == Cost::kSleep) {
      std::this_thread::sleep_until(until);
    } else {
      // Work the CPU, as a loader that decodes does, until the time is up.
      volatile uint64_t x = 1;
      while (std::chrono::steady_clock::now() < until) {
        for (int i = 0; i < 1000; ++i) x = x * 6364136223846793005u + 1442695040888963407u;
      }
    }
    return inner_->next();
  }
  nlohmann::json state() const override { return inner_->state(); }
  void load_state(const nlohmann::json& state) override { inner_->load_state(state); }

 private:
  std::unique_ptr<acc::data::Loader> inner_;
  std::chrono::duration<double, std::milli> cost_;
  Cost kind_;
};

}  // namespace

int main(int argc, char** argv) {
  std::string config_file, cost_name = "spin";
  int64_t batch = 4, seq = 128, steps = 20, warmup = 3, depth = 2;
  int reps = 5;
  double cost_share = 0.5;
  CLI::App app{"Step time with a slow loader, without and with PrefetchLoader, against a free one"};
  app.add_option("--config", config_file, "GPT config JSON (default: d128 L4 H4, V 256)");
  app.add_option("--batch-size", batch)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seq-len", seq)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--steps", steps, "timed steps per configuration and turn")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps before them")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--reps", reps, "turns of the three configurations")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--cost-share", cost_share, "a slow batch's cost, in free steps")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str();
  app.add_option("--cost", cost_name, "how the slow loader spends it")
      ->check(CLI::IsMember({"spin", "sleep"}))
      ->capture_default_str();
  app.add_option("--depth", depth, "PrefetchLoader's queue")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    using namespace acc;
    const Cost cost = cost_name == "sleep" ? Cost::kSleep : Cost::kSpin;
    const nlohmann::json config = config_file.empty() ? nlohmann::json{{"n_layer", 4},
                                                                       {"n_head", 4},
                                                                       {"n_embd", 128},
                                                                       {"vocab_size", 256},
                                                                       {"block_size", seq}}
                                                      : read_json_file(config_file, "--config");
    manual_seed(1);
    auto model = models::create_model("gpt", config);
    auto trainer = strategies::apply(model, optim::AdamW::factory({}), strategies::Strategy{});
    Generator gen(7);
    std::vector<uint32_t> ids(size_t{1} << 20);
    for (auto& id : ids)
      id = static_cast<uint32_t>(gen.next_u64() % static_cast<uint64_t>(model->vocab_size()));
    auto tokens = std::make_shared<const data::TokenFile>(std::move(ids), "random");
    const data::LoaderOptions loader_options{.batch_size = batch, .seq_len = seq, .seed = 3};
    auto batches = [&] { return std::make_unique<data::BatchLoader>(tokens, loader_options); };

    // Timed steps of one configuration; the loader is built before the clock starts.
    auto run = [&](data::Loader& loader) {
      for (int64_t i = 0; i < warmup; ++i) trainer->train_step(loader.next());
      std::vector<double> ms;
      for (int64_t i = 0; i < steps; ++i) {
        Timer t;
        trainer->train_step(loader.next());
        ms.push_back(t.elapsed_ms());
      }
      return ms;
    };

    // The cost of a slow batch, from the free step's time.
    std::vector<double> calibration;
    {
      auto free = batches();
      calibration = run(*free);
    }
    const double cost_ms = cost_share * median(calibration);

    const char* names[] = {"free", "slow", "prefetch"};
    std::vector<double> all[3], turns[3];
    for (int r = 0; r < reps; ++r) {
      for (int c = 0; c < 3; ++c) {
        std::vector<double> ms;
        if (c == 0) {
          auto loader = batches();
          ms = run(*loader);
        } else if (c == 1) {
          SlowLoader loader(batches(), cost_ms, cost);
          ms = run(loader);
        } else {
          data::PrefetchLoader loader(std::make_unique<SlowLoader>(batches(), cost_ms, cost),
                                      {.depth = depth});
          ms = run(loader);
        }
        turns[c].push_back(median(ms));
        all[c].insert(all[c].end(), ms.begin(), ms.end());
      }
    }
    nlohmann::json out = {{"benchmark", "prefetch"},
                          {"model", config},
                          {"batch_size", batch},
                          {"seq_len", seq},
                          {"threads", get_num_threads()},
                          {"depth", depth},
                          {"cost", cost_name},
                          {"cost_share", cost_share},
                          {"loader_cost_ms", cost_ms},
                          {"reps", reps},
                          {"steps", steps}};
    for (int c = 0; c < 3; ++c) {
      out[std::string(names[c]) + "_median_step_ms"] = median(all[c]);
      out[std::string(names[c]) + "_turn_medians_ms"] = turns[c];
    }
    out["prefetch_over_free"] = median(all[2]) / median(all[0]);
    out["slow_over_free"] = median(all[1]) / median(all[0]);
    std::printf("%s\n", out.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_prefetch: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
