// A program a user starts from: a model of their own (not a language model), its own loss and
// data, accelerated at any rank count and trained in a TrainingSession with checkpoints, resumable
// under acc-run. The model, loss and data are examples/custom_model.hpp.
//
//   build/examples/custom_model                       # one process, sensible defaults
//   mpirun -np 2 build/examples/custom_model          # two ranks: auto_accelerate picks the layout
//   # what acc-run restarts after a failure (it resumes from the newest checkpoint):
//   mpirun -np 2 build/examples/custom_model --ckpt-dir ck --save-every 20 --resume auto
//       --log-json log.jsonl
//   # acc-search over this program's model type (a strategy cache for 4 ranks, no MPI):
//   build/examples/custom_model search --model residual_mlp --config net.json
//       --global-batch 64 --seq-len 1 --plan-only --world 4 --out strategy.json
//   mpirun -np 2 build/examples/custom_model --strategy strategy.json   # use the cached strategy
//
// Exit codes: 0 trained (and the loss fell), 1 an error (named on stderr) or a loss that did not
// fall, 2 a bad command line.

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "acc/acc.hpp"
#include "acc/acc_search.hpp"
#include "acc/session.hpp"
#include "acc/util/cli.hpp"
#include "acc/util/system.hpp"
#include "custom_model.hpp"

namespace {

struct Args {
  custom::NetConfig net;
  int64_t steps = 300;
  int64_t global_batch = 64;
  double lr = 3e-3;
  double grad_clip = 1.0;
  uint64_t seed = 1;       // the model's initial values
  uint64_t data_seed = 7;  // the synthetic dataset
  int threads = 0;
  std::string strategy;  // "" : search; else a strategy list or a strategy cache (file or inline)
  bool allow_bf16 = false;
  std::string report;
  std::string ckpt_dir;
  int64_t save_every = 0;
  int keep = 3;
  std::string resume;  // "" | "auto" | a checkpoint directory
  std::string log_json;
  int64_t log_every = 50;
  int prefetch = 2;  // batches built ahead on a background thread (0: none)
};

nlohmann::json config_json(const custom::NetConfig& c) {
  return {{"features", c.features},
          {"width", c.width},
          {"hidden", c.hidden},
          {"layers", c.layers},
          {"classes", c.classes}};
}

custom::NetConfig config_of(const nlohmann::json& j) {
  custom::NetConfig c;
  for (const auto& [key, value] : j.items()) {
    ACC_CHECK(value.is_number_integer(), "residual_mlp config: '", key,
              "' must be an integer, got ", value.dump());
    const auto v = value.get<int64_t>();
    if (key == "features")
      c.features = v;
    else if (key == "width")
      c.width = v;
    else if (key == "hidden")
      c.hidden = v;
    else if (key == "layers")
      c.layers = v;
    else if (key == "classes")
      c.classes = v;
    else
      ACC_THROW(acc::ValueError, "residual_mlp config: unknown field '", key, "'");
  }
  return c;
}

// This program's model type, so that acc-search (the `search` subcommand) can build it by name.
void register_residual_mlp(uint64_t data_seed) {
  acc::models::register_model_type(
      {.name = "residual_mlp",
       .description = "examples/custom_model.hpp's residual-MLP classifier",
       .create = [](const nlohmann::json& j, acc::Generator& gen) -> acc::nn::ModulePtr {
         return std::make_shared<custom::Net>(config_of(j), gen);
       },
       .layers_key = "layers",
       .num_layers = [](const nlohmann::json& j) { return config_of(j).layers; },
       .sample_batch =
           [data_seed](const nlohmann::json& j, int64_t n, int64_t, acc::Generator& gen) {
             std::vector<int64_t> samples(static_cast<size_t>(n));
             const auto first = static_cast<int64_t>(gen.next_u64() >> 24);
             for (int64_t i = 0; i < n; ++i) samples[static_cast<size_t>(i)] = first + i;
             return custom::synthetic_batch(samples, config_of(j), data_seed).tensors();
           },
       .loss =
           [](acc::nn::Module& m, const acc::nn::NamedTensors& batch) {
             return custom::classification_loss(m, acc::data::Batch(batch));
           }});
}

int train(const Args& a) {
  using namespace acc;
  const int world = dist::world_size(), rank = dist::rank();
  set_num_threads(a.threads > 0 ? a.threads
                                : std::max(1, usable_cores() / dist::local_world_size()));
  ACC_CHECK(a.global_batch % world == 0, "--global-batch ", a.global_batch, " does not split over ",
            world, " rank(s)");
  // Checked before the model and the search: bad options cost nothing.
  SessionOptions so;
  so.ckpt_dir = a.ckpt_dir;
  so.save_every = a.save_every;
  so.keep = a.keep;
  so.resume = a.resume.empty() ? Resume::kNone : a.resume == "auto" ? Resume::kAuto : Resume::kPath;
  if (so.resume == Resume::kPath) so.resume_path = a.resume;
  so.log_json = a.log_json;
  so.log_every = a.log_every;
  so.steps = a.steps;
  so.names = OptionNames::command_line();
  TrainingSession::Prepared prepared = TrainingSession::prepare(so);

  manual_seed(a.seed);  // the same initial values on every rank (and every attempt)
  auto model = std::make_shared<custom::Net>(a.net);
  AccelerateOptions opts;
  opts.global_batch = a.global_batch;
  opts.loss = custom::classification_loss;
  // This rank's share of step 0, what the search traces and dry-runs (its data-parallel rank is its
  // world rank for every candidate: data-parallel methods only).
  opts.sample_batch = custom::synthetic_batch(
      data::Shard{.rank = rank, .ranks = world, .global_batch = a.global_batch}.sample_indices(0),
      a.net, a.data_seed);
  opts.allow_bf16 = a.allow_bf16;
  opts.grad_clip = a.grad_clip;
  opts.load_strategy = a.strategy;
  opts.report_dir = a.report;
  opts.verbose = true;
  opts.agreement = {{"config", config_json(a.net)}, {"data_seed", a.data_seed}};
  AccelerateResult acc =
      auto_accelerate(model, optim::AdamW::factory({.lr = a.lr, .weight_decay = 0.01}), opts);

  // The data follows the strategy: the shard auto_accelerate hands back.
  std::unique_ptr<data::Loader> loader =
      std::make_unique<custom::SyntheticLoader>(acc.data, a.net, a.data_seed);
  if (a.prefetch > 0) {
    loader = std::make_unique<data::PrefetchLoader>(std::move(loader),
                                                    data::PrefetchOptions{.depth = a.prefetch});
  }
  TrainingSession run(acc, *loader, std::move(prepared));
  double first = 0, last = 0;
  for (int64_t step = run.first_step(); step < a.steps; ++step) {
    last = run.step().loss;
    if (step == run.first_step()) first = last;
  }
  run.finish();
  if (rank == 0) {
    std::printf("custom_model: %s on %d rank(s), steps %lld..%lld: loss %.4f -> %.4f\n",
                acc.report.value("chosen_name", describe(acc.strategy)).c_str(), world,
                static_cast<long long>(run.first_step()), static_cast<long long>(a.steps), first,
                last);
  }
  return run.first_step() >= a.steps || last < first ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  // `search ...`: acc-search's command line over this program's model type.
  if (argc > 1 && std::string(argv[1]) == "search") {
    register_residual_mlp(a.data_seed);
    return acc::acc_search_main(argc - 1, argv + 1);
  }
  CLI::App app{"custom_model: a residual-MLP classifier of the user's own, accelerated"};
  using acc::cli::integer;
  app.add_option("--steps", a.steps, "optimizer steps")->check(integer(1))->capture_default_str();
  app.add_option("--global-batch", a.global_batch, "samples per step over all ranks")
      ->check(integer(1))
      ->capture_default_str();
  app.add_option("--features", a.net.features, "input features")
      ->check(integer(1, 4096))
      ->capture_default_str();
  app.add_option("--width", a.net.width, "residual width")
      ->check(integer(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--hidden", a.net.hidden, "hidden width of each block")
      ->check(integer(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--layers", a.net.layers, "residual blocks")
      ->check(integer(0, 1024))
      ->capture_default_str();
  app.add_option("--classes", a.net.classes, "classes")
      ->check(integer(2, 1 << 16))
      ->capture_default_str();
  app.add_option("--lr", a.lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--grad-clip", a.grad_clip, "max global gradient norm (0 = off)")
      ->capture_default_str();
  app.add_option("--seed", a.seed, "seed of the initial values")->capture_default_str();
  app.add_option("--data-seed", a.data_seed, "seed of the synthetic dataset")
      ->capture_default_str();
  app.add_option("--threads", a.threads, "threads per rank (default: usable cores / local ranks)")
      ->check(integer(1, 4096));
  app.add_option("--strategy", a.strategy,
                 "a strategy list or an acc-search cache (file or inline JSON); default: search");
  app.add_flag("--allow-bf16", a.allow_bf16, "amp (bf16) may be chosen");
  app.add_option("--search-report", a.report, "directory for the search's report.html");
  app.add_option("--ckpt-dir", a.ckpt_dir, "checkpoint root (sharded, resharded on resume)");
  app.add_option("--save-every", a.save_every,
                 "with --ckpt-dir: save every N steps (0: at the end)")
      ->check(integer(0))
      ->capture_default_str();
  app.add_option("--keep", a.keep, "with --ckpt-dir: committed checkpoints kept")
      ->check(integer(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--resume", a.resume,
                 "auto (the newest step of --ckpt-dir) or a checkpoint "
                 "directory");
  app.add_option("--log-json", a.log_json, "one JSON line per step (appended after a restart)");
  app.add_option("--log-every", a.log_every, "console log interval (0: never)")
      ->check(integer(0))
      ->capture_default_str();
  app.add_option("--prefetch", a.prefetch, "batches built ahead on a background thread (0: none)")
      ->check(integer(0, 64))
      ->capture_default_str();
  if (const auto code = acc::cli::parse(app, argc, argv)) return *code;
  int rc = 0;
  try {
    acc::dist::init(argc, argv);
    rc = train(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_model: error: %s\n", e.what());
    rc = 1;
  }
  acc::dist::finalize();
  return rc;
}
