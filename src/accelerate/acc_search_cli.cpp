// acc-search: the strategy search offline. Writes the chosen strategy as a cache file that
// auto_accelerate (AccelerateOptions::load_strategy) and train_gpt --strategy FILE use without
// searching again.
//
//   # dry-runs on the job's own ranks:
//   mpirun -np 2 acc-search --model gpt --config gpt_small.json --global-batch 8 --seq-len 64
//       --out strategy.json --report search-report
//   # predictions only, no MPI, no model built:
//   acc-search --plan-only --world 8 --model gpt --config gpt_small.json --global-batch 64
//       --seq-len 256 --out strategy.json
//
// Exit codes: 0 done, 1 an error (named on stderr), 2 a bad command line.
//
// Any type of the model registry (acc/models/registry.hpp): a language model is searched on
// random token batches with its next-token loss; another type on its own sample_batch through its
// own loss (the sample of each rank drawn from --seed and the rank).

#include "acc/acc_search.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "acc/accelerate.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/language_model.hpp"
#include "acc/models/registry.hpp"
#include "acc/optim/adam.hpp"
#include "acc/optim/sgd.hpp"
#include "acc/search/report.hpp"
#include "acc/search/space.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/cli.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/json.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/system.hpp"

namespace {

struct Args {
  std::string model = "gpt";
  std::string config;
  int64_t global_batch = 0;
  int64_t seq_len = 0;
  int64_t mem_per_rank = 0;
  int top_k = 3;
  std::vector<std::string> exclude, include;
  bool allow_bf16 = false;
  std::string out;
  std::string report;
  bool plan_only = false;
  int world = 0;
  std::string comm;
  std::string cluster;
  std::string strategy;
  double time_budget = 0;
  int warmup_steps = 1;
  int measured_steps = 3;
  std::string cache_dir;
  int threads = 0;
  int64_t seed = 1337;
  std::string optimizer = "adamw";
};

// The optimizer the job will train with (--optimizer), at its default hyper-parameters: what the
// memory model charges as state and the time model as the update's pass over it. sgd_momentum is
// SGD with momentum 0.9 (one buffer); the command line checks the name.
acc::optim::OptimizerFactory optimizer_of(const Args& a) {
  using namespace acc::optim;
  if (a.optimizer == "adam") return Adam::factory({});
  if (a.optimizer == "sgd") return SGD::factory({});
  if (a.optimizer == "sgd_momentum") {
    SGD::Options o;
    o.momentum = 0.9;
    return SGD::factory(o);
  }
  return AdamW::factory({});
}

// Collectives for a plan without MPI: --comm (a "comm" object as a search report holds it, or a
// report.json with one), else a stated default: a ring over shared memory with 20 us per hop and
// 5 GB/s, roughly what OpenMPI's shared-memory transport gives on a current x86 server; a plan
// for real nodes should pass --comm from a search run on them.
acc::search::CommCalibration plan_comm(const Args& a) {
  using acc::search::CommCalibration;
  if (!a.comm.empty()) {
    nlohmann::json j = acc::read_json_file(a.comm, "--comm");
    if (j.is_object() && j.contains("comm")) j = j["comm"];
    CommCalibration c = CommCalibration::from_json(j);
    ACC_CHECK(c.world == a.world, "--comm '", a.comm, "' was measured on ", c.world,
              " rank(s), the plan is for --world ", a.world);
    return c;
  }
  CommCalibration c;
  c.world = a.world;
  const double hops = a.world - 1, share = hops / a.world;
  const double alpha = 20e-6, beta = 1.0 / 5e9;
  c.ops["allreduce"] = {2 * hops * alpha, 2 * share * beta};
  c.ops["reduce_scatter"] = {hops * alpha, share * beta};
  c.ops["allgather"] = {hops * alpha, share * beta};
  c.ops["broadcast"] = {hops * alpha, share * beta};
  return c;
}

acc::AccelerateOptions options_of(const Args& a) {
  acc::AccelerateOptions o;
  o.global_batch = a.global_batch;
  o.seq_len = a.seq_len;
  o.mem_per_rank = a.mem_per_rank;
  o.top_k = a.top_k;
  o.excluded = a.exclude;
  o.included = a.include;
  o.allow_bf16 = a.allow_bf16;
  o.time_budget_s = a.time_budget;
  o.warmup_steps = a.warmup_steps;
  o.measured_steps = a.measured_steps;
  o.cache_dir = a.cache_dir;
  o.save_strategy_to = a.out;
  o.report_dir = a.report;
  return o;
}

// A type that is not a language model: `n` samples of this rank (from --seed and the rank), and its
// loss over data::Batch.
acc::data::Batch sample_of(const acc::models::ModelType& t, const Args& a,
                           const nlohmann::json& config, int64_t n) {
  acc::Generator gen(static_cast<uint64_t>(a.seed) * 1000003ULL +
                     static_cast<uint64_t>(acc::dist::is_initialized() ? acc::dist::rank() : 0));
  return acc::data::Batch(t.sample_batch(config, n, a.seq_len, gen));
}

acc::strategies::LossFn loss_of(const acc::models::ModelType& t) {
  return [loss = t.loss](acc::nn::Module& m, const acc::data::Batch& b) {
    return loss(m, b.tensors());
  };
}

// What --plan-only prices: a language model by type and config; another type built on the meta
// device (no memory) and traced whole on its sample's shapes.
acc::trace::ModelRef model_ref(const Args& a, const nlohmann::json& config) {
  using namespace acc;
  const models::ModelType& t = models::model_type(a.model);
  if (t.language_model) return trace::ModelRef::registry(a.model, config);
  const int64_t per_rank = search::per_rank_batch(a.global_batch, a.world);
  nn::ModulePtr module;
  {
    DefaultDeviceGuard meta(Device::kMeta);
    Generator scratch(0);
    module = t.create(config, scratch);
  }
  return trace::ModelRef::module(module, sample_of(t, a, config, per_rank), loss_of(t));
}

// The chosen plan's figures on the cluster, one line each.
void print_cluster_plan(const nlohmann::json& report, const acc::search::ClusterProfile& cluster) {
  for (const auto& row : report.at("candidates")) {
    if (!row.contains("chosen")) continue;
    const nlohmann::json& p = row.at("predicted");
    std::printf(
        "on %s: %s (micro-batch %lld, %s)\n  step %.3f s, peak memory %.1f GiB of %.1f GiB, "
        "%.1f model TFLOP/s per device, MFU %.1f%%\n",
        cluster.name.c_str(), row.at("name").get<std::string>().c_str(),
        static_cast<long long>(row.at("micro_batch").get<int64_t>()),
        row.at("mesh").get<std::string>().c_str(), p.at("time").at("step_s").get<double>(),
        p.at("memory").at("peak").get<double>() / (1 << 30),
        static_cast<double>(cluster.budget_bytes()) / (1 << 30),
        p.at("model_tflops_per_device").get<double>(), 100 * p.at("mfu").get<double>());
    if (row.contains("reason")) {
      std::printf("  does not fit: %s\n", row.at("reason").get<std::string>().c_str());
    }
  }
}

int plan(const Args& a, const nlohmann::json& config) {
  using namespace acc;
  check_output_path(a.out, "--out");
  if (!a.report.empty()) search::check_report_dir(a.report);
  const AccelerateOptions o = options_of(a);
  const trace::ModelRef model = model_ref(a, config);
  nlohmann::json report;
  ACC_CHECK(a.comm.empty() || a.cluster.empty(),
            "--comm is this machine's collective figures; --cluster '", a.cluster,
            "' has its own: give one of them");
  if (!a.cluster.empty()) {
    const search::ClusterProfile cluster = search::ClusterProfile::load(a.cluster);
    std::optional<strategies::Strategy> pinned;
    if (!a.strategy.empty()) pinned = strategies::parse_strategy_arg(a.strategy);
    report = plan_for_cluster(model, a.world, o, cluster, pinned, optimizer_of(a));
    print_cluster_plan(report, cluster);
  } else {
    report = plan_strategy(model, a.world, o, plan_comm(a), optimizer_of(a));
  }
  std::cout << report_table(report) << std::flush;
  const auto key = search::strategy_key(model, a.world, a.global_batch, a.seq_len);
  search::save_strategy_cache(cache_from_report(report, key), a.out);
  if (!a.report.empty()) search::write_report(report, a.report);
  std::printf("acc-search: planned for %d rank(s) (predictions only%s): %s -> %s\n", a.world,
              !a.cluster.empty() ? ", cluster profile"
              : a.comm.empty()   ? ", default collective figures"
                                 : "",
              report.at("chosen_name").get<std::string>().c_str(), a.out.c_str());
  return 0;
}

int run_search(const Args& a, const nlohmann::json& config) {
  using namespace acc;
  ACC_CHECK(a.world == 0 || a.world == dist::world_size(), "--world ", a.world,
            " is for --plan-only; under mpirun the world is the job's (", dist::world_size(), ")");
  ACC_CHECK(a.comm.empty(), "--comm is for --plan-only; a search measures the job's collectives");
  // The model the dry-runs copy: built as the training run builds it (seeded alike on every rank).
  manual_seed(static_cast<uint64_t>(a.seed));
  const models::ModelType& t = models::model_type(a.model);
  nn::ModulePtr model = models::create_module(a.model, config);
  AccelerateOptions o = options_of(a);
  o.verbose = true;
  if (!t.language_model) {
    o.sample_batch =
        sample_of(t, a, config, search::per_rank_batch(a.global_batch, dist::world_size()));
    o.loss = loss_of(t);
  }
  AccelerateResult r = auto_accelerate(model, optimizer_of(a), o);
  if (dist::rank() == 0) {
    std::cout << report_table(r.report) << std::flush;
    std::printf("acc-search: chose %s on %d rank(s) -> %s\n",
                r.report.at("chosen_name").get<std::string>().c_str(), dist::world_size(),
                a.out.c_str());
  }
  return 0;
}

}  // namespace

namespace acc {

int acc_search_main(int argc, char** argv) {
  Args a;
  CLI::App app{"acc-search: find the fastest strategy that fits and cache it"};
  using acc::cli::integer;
  // The model and --plan-only's --world are checked with the command line (exit 2), not after.
  app.add_option("--model", a.model, acc::models::model_type_choices())
      ->check(CLI::IsMember(acc::models::model_type_names()))
      ->capture_default_str();
  app.add_option("--config", a.config, "model config JSON")->required();
  app.add_option("--global-batch", a.global_batch, "samples per optimizer step over all ranks")
      ->required()
      ->check(integer(1));
  app.add_option("--seq-len", a.seq_len,
                 "tokens per sample (required for a language model; another type's sample_batch "
                 "gets it, and its strategy key holds it: give what the program's "
                 "AccelerateOptions::seq_len is, 0 by default)")
      ->check(integer(0));
  app.add_option("--mem-per-rank", a.mem_per_rank,
                 "tracked memory a rank may use, with a unit (512MiB, 2GiB; default: physical "
                 "memory / local ranks, less 10%)")
      ->transform(acc::cli::bytes(1));
  app.add_option("--top-k", a.top_k, "candidates dry-run, best predicted first")
      ->check(integer(1, 1000))
      ->capture_default_str();
  app.add_option("--exclude", a.exclude, "methods never tried (e.g. --exclude fsdp amp)");
  app.add_option("--include", a.include, "methods every candidate has");
  app.add_flag("--allow-bf16", a.allow_bf16, "amp (bf16) may be chosen");
  app.add_option("--out", a.out, "the strategy cache to write")->required();
  app.add_option("--report", a.report, "directory for report.json and report.html");
  auto* plan_only = app.add_flag("--plan-only", a.plan_only,
                                 "predictions only: no MPI, no dry-runs (needs --world)");
  auto* world = app.add_option("--world", a.world, "with --plan-only: the ranks to plan for")
                    ->check(integer(1, 1 << 20));
  plan_only->needs(world);
  app.add_option("--comm", a.comm,
                 "with --plan-only: collective figures (a search report.json, or its 'comm')");
  auto* cluster = app.add_option(
      "--cluster", a.cluster,
      "with --plan-only: a cluster profile JSON (search/profiles/*.json) to plan for "
      "instead of this machine");
  cluster->needs(plan_only);
  app.add_option("--strategy", a.strategy,
                 "with --cluster: predict this strategy alone (JSON inline or a file), its methods "
                 "and sizes fixed")
      ->needs(cluster);
  app.add_option("--time-budget", a.time_budget, "seconds the dry-runs may take (0: no limit)")
      ->check(acc::cli::seconds(0, acc::cli::kClosed));
  app.add_option("--warmup-steps", a.warmup_steps, "dry-run warm-up steps")
      ->check(integer(0, 1000))
      ->capture_default_str();
  app.add_option("--measured-steps", a.measured_steps, "dry-run measured steps")
      ->check(integer(1, 1000))
      ->capture_default_str();
  app.add_option("--optimizer", a.optimizer,
                 "the optimizer the job trains with (its state is priced): adamw | adam | "
                 "sgd_momentum (momentum 0.9) | sgd")
      ->check(CLI::IsMember({"adamw", "adam", "sgd_momentum", "sgd"}))
      ->capture_default_str();
  app.add_option("--cache-dir", a.cache_dir,
                 "machine calibration cache (default ~/.cache/autoacc)");
  app.add_option("--threads", a.threads,
                 "threads per rank (default: usable cores / local ranks; --plan-only: "
                 "ACC_NUM_THREADS if set, else usable cores)")
      ->check(integer(1, 4096));
  app.add_option("--seed", a.seed, "seed of the model the dry-runs copy")
      ->check(integer(0))
      ->capture_default_str();
  if (const auto code = acc::cli::parse(app, argc, argv)) return *code;  // bad: 2
  if (acc::models::model_type(a.model).language_model && a.seq_len < 1) {
    std::fprintf(stderr, "acc-search: --seq-len is required for a language model (--model %s)\n",
                 a.model.c_str());
    return 2;
  }
  int rc = 0;
  try {
    const nlohmann::json config = acc::read_json_file(a.config, "--config");
    if (a.plan_only) {
      // One process: the memory model makes its traces on every usable core, unless
      // --threads or ACC_NUM_THREADS says otherwise.
      if (a.threads > 0) {
        acc::set_num_threads(a.threads);
      } else if (std::getenv("ACC_NUM_THREADS") != nullptr) {
        acc::init_threads_from_env();
      } else {
        acc::set_num_threads(acc::usable_cores());
      }
      rc = plan(a, config);
    } else {
      acc::dist::init(argc, argv);
      acc::set_num_threads(a.threads > 0
                               ? a.threads
                               : std::max(1, acc::usable_cores() / acc::dist::local_world_size()));
      rc = run_search(a, config);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "acc-search: error: %s\n", e.what());
    rc = 1;
  }
  if (!a.plan_only) acc::dist::finalize();
  return rc;
}

}  // namespace acc
