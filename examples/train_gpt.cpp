// train_gpt: trains a GPT or Llama language model on a token file, the program a new user starts
// from. One process, or several under mpirun with a --strategy (each rank reads its slice of the
// global batch; rank 0 logs):
//
//   mpirun -np 2 build/examples/train_gpt --strategy '[{"name": "ddp"}]' --data ...
//
//   build/examples/train_gpt --model gpt --config examples/configs/gpt_small.json
//       --data input.txt --data-format text --steps 300 --batch-size 16 --seq-len 128
//
// A thin command line: the flags, the model and its data, the strategy (given, cached or searched:
// acc::auto_accelerate), then an acc::TrainingSession (include/acc/session.hpp) runs the loop with
// resume, checkpoints, the hang detector and the step log, as it would for any program.
//
// Defaults follow torch.optim.AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01,
// every parameter decayed), constant learning rate, no gradient clipping, no dropout.

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <optional>

#include "acc/acc.hpp"
#include "acc/data/prefetch.hpp"
#include "acc/data/token_data.hpp"
#include "acc/dist/dist.hpp"
#include "acc/dist/node.hpp"
#include "acc/io/safetensors.hpp"
#include "acc/models/registry.hpp"
#include "acc/session.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/trace/estimate.hpp"
#include "acc/util/cli.hpp"
#include "acc/util/file.hpp"
#include "acc/util/json.hpp"
#include "acc/util/parse.hpp"
#include "acc/util/system.hpp"

namespace {

struct Args {
  std::string model = "gpt";
  std::string config;
  std::string data;
  std::string data_format = "u16";
  std::string data_order = "random";
  std::string init_from;
  std::string save;
  std::string ckpt_dir;
  int64_t save_every = 0;
  int keep = 3;
  bool sync_save = false;
  bool ckpt_start_over = false;
  std::string resume;
  std::string log_json;
  std::string strategy;
  int64_t steps = 100;
  int64_t batch_size = 8;
  int64_t global_batch = 0;  // > 0: batch_size = global_batch / ranks (acc-run's restarts)
  int64_t seq_len = 256;
  double lr = 1e-3;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  std::string lr_schedule = "constant";
  double weight_decay = 0.01;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double grad_clip = 0.0;
  uint64_t seed = 1337;
  int threads = 1;
  int64_t log_every = 10;
  int prefetch = 2;  // batches built ahead on a background thread (0: on the training thread)
  int64_t sample = 0;
  bool reference_attention = false;
  bool allow_bf16 = false;
  int64_t mem_per_rank = 0;   // with the search: bytes a rank may use (0: the default)
  std::string save_strategy;  // with --strategy auto: write the choice as a strategy cache
  std::string search_report;  // with --strategy auto: report.json and report.html here
  std::string on_stale = "search";
};

// Continues `prompt` by sampling `n` tokens at temperature 1 (byte-level text models).
std::string sample_text(acc::models::LanguageModel& model, int64_t n, uint64_t seed,
                        int64_t context) {
  acc::NoGradGuard ng;
  model.eval();
  acc::Generator gen(seed);
  std::vector<int64_t> tokens = {'\n'};
  std::string out;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - context);
    std::vector<int64_t> window(tokens.begin() + start, tokens.end());
    const int64_t T = static_cast<int64_t>(window.size());
    acc::Tensor logits = model.forward(acc::from_vector(window, {1, T}));
    acc::Tensor probs = acc::softmax(logits.slice(1, T - 1, T).reshape({-1}));
    auto p = probs.to_vector<double>();
    double r = gen.next_double(), acc_p = 0;
    int64_t tok = static_cast<int64_t>(p.size()) - 1;
    for (size_t v = 0; v < p.size(); ++v) {
      acc_p += p[v];
      if (r < acc_p) {
        tok = static_cast<int64_t>(v);
        break;
      }
    }
    tokens.push_back(tok);
    out.push_back(static_cast<char>(tok));
  }
  model.train();
  return out;
}

// The session's options from the flags; its messages name the flags.
acc::SessionOptions session_options(const Args& a) {
  acc::SessionOptions o;
  o.ckpt_dir = a.ckpt_dir;
  o.save_every = a.save_every;
  o.keep = a.keep == 0 ? std::nullopt : std::optional<int>(a.keep);
  o.sync_save = a.sync_save;
  o.start_over = a.ckpt_start_over;
  o.resume = a.resume.empty()     ? acc::Resume::kNone
             : a.resume == "auto" ? acc::Resume::kAuto
                                  : acc::Resume::kPath;
  if (o.resume == acc::Resume::kPath) o.resume_path = a.resume;
  o.log_json = a.log_json;
  o.log_every = a.log_every;
  o.steps = a.steps;
  o.tokens_per_sample = a.seq_len;
  if (a.lr_schedule == "cosine") {
    o.lr_schedule =
        std::make_shared<acc::optim::WarmupCosineLR>(a.lr, a.warmup_steps, a.steps, a.min_lr);
  } else if (a.warmup_steps > 0) {
    o.lr_schedule = std::make_shared<acc::optim::WarmupCosineLR>(
        a.lr, a.warmup_steps, std::numeric_limits<int64_t>::max(), a.lr);
  } else {
    o.lr_schedule = std::make_shared<acc::optim::ConstantLR>(a.lr);
  }
  o.names = acc::OptionNames::command_line();
  return o;
}

int run(const Args& a) {
  using namespace acc;
  set_num_threads(a.threads);
  // Numeric ranges are checked by the flags' validators (main); these are the choices.
  // Any language model of the registry (acc/models/registry.hpp).
  const std::vector<std::string> types = models::model_type_names();
  ACC_CHECK(std::find(types.begin(), types.end(), a.model) != types.end() &&
                models::model_type(a.model).language_model,
            "--model must be ", models::language_model_names(), ", got '", a.model, "'");
  ACC_CHECK(a.lr_schedule == "constant" || a.lr_schedule == "cosine",
            "--lr-schedule must be constant or cosine, got '", a.lr_schedule, "'");
  ACC_CHECK(!a.data.empty(),
            "--data is required (a token file or, with --data-format text, "
            "any text file)");
  if (!a.resume.empty() && a.resume != "auto") {
    std::error_code ec;
    ACC_CHECK_AS(IoError, !std::filesystem::is_regular_file(a.resume, ec), "--resume '", a.resume,
                 "' is a file: single-file checkpoints (the former --save-checkpoint) are not read "
                 "any more; resume from a checkpoint directory written with --ckpt-dir");
  }
  // Output paths before any work, so a typo costs nothing (rank 0 writes them; the session checks
  // --ckpt-dir and --log-json).
  if (dist::rank() == 0 && !a.save.empty()) check_output_path(a.save, "--save");
  // The session's options, --ckpt-dir's lock (one writing job per checkpoint root) and the hang
  // detector (elastic/README.md), before anything is built: a refused job stops on every rank at
  // once, and the agent watches the search's dry-runs too.
  TrainingSession::Prepared prepared = TrainingSession::prepare(session_options(a));

  // More threads than cores time-slice every GEMM: say so (it ran 10x slower without a word). The
  // node's ranks count together (the union of their affinity masks): under mpirun's default
  // binding each rank's own mask is one core, which is no reason to warn at one thread per rank.
  const dist::NodeCores node = dist::node_cores(*dist::ProcessGroup::world());
  if (a.threads * node.ranks > node.cores && dist::rank() == 0) {
    logging::warn(
        "--threads {} x {} rank(s) on this node = {} threads on {} usable core(s): they will "
        "time-slice and run slower than --threads {}",
        a.threads, node.ranks, a.threads * node.ranks, node.cores,
        std::max(1, node.cores / node.ranks));
  }

  // Model.
  nlohmann::json config = a.config.empty() ? models::model_type(a.model).default_config
                                           : read_json_file(a.config, "--config");
  // Before building anything: does a step fit in this rank's share of the memory available now?
  // (n_layer 1e9 or --batch-size 1e6 used to allocate until the OOM killer came.) The need is
  // traced on shallow copies of the config and extrapolated, in milliseconds at any depth. With
  // a strategy on W ranks the parameters, gradients and optimizer state count 1/W: the least any
  // data-parallel layout holds, so a run that a sharding strategy would fit is never refused.
  // The sequence length against the model's maximum first, on a one-block meta copy.
  const int64_t max_seq = models::create_meta_model(a.model, config, 1)->max_seq_len();
  ACC_CHECK(a.seq_len <= max_seq, "--seq-len ", a.seq_len,
            " exceeds the model's maximum sequence length ", max_seq);
  {
    trace::TrainingNeed need =
        trace::estimate_training_need(a.model, config, a.batch_size, a.seq_len);
    const int64_t world = dist::world_size();
    if (world > 1 && !a.strategy.empty()) {
      auto& m = need.memory;
      const int64_t state = m.parameters + m.gradients + m.optimizer_state;
      m.peak -= state - state / world;
      m.parameters /= world;
      m.gradients /= world;
      m.optimizer_state /= world;
    }
    trace::check_fits(need, available_memory_bytes() / dist::local_world_size(),
                      "train_gpt (per rank, " + std::to_string(dist::local_world_size()) +
                          " rank(s) on this node)");
  }
  manual_seed(a.seed);
  models::LanguageModelPtr model = models::create_model(a.model, config);
  model->set_fused_attention(!a.reference_attention);
  if (!a.init_from.empty()) {
    try {
      model->load_pretrained(io::load_safetensors(a.init_from).tensors);
    } catch (const ValueError& e) {
      ACC_THROW(ValueError, "--init-from '", a.init_from, "': ", e.what());
    }
    logging::info("loaded weights from {}", a.init_from);
  }

  // Strategy and the data-parallel group (one rank without mpirun).
  auto group = dist::ProcessGroup::world();
  const bool leader = group->rank() == 0;
  // --strategy: auto (the search), a strategy cache (acc-search's --out: its key checked, then
  // used, re-planned for another world size, or searched again / refused when stale), or a plain
  // strategy list applied as given.
  const bool search = a.strategy == "auto";
  const bool cached = !a.strategy.empty() && !search &&
                      search::is_strategy_cache(strategies::read_strategy_arg(a.strategy));
  strategies::Strategy strategy = a.strategy.empty() || search || cached
                                      ? strategies::Strategy{}
                                      : strategies::parse_strategy_arg(a.strategy);
  ACC_CHECK(search || cached || (a.save_strategy.empty() && a.search_report.empty()),
            "--save-strategy and --search-report go with --strategy auto or a strategy cache");
  // Data: this rank's slice of the global batch (global batch = batch-size x ranks).
  auto tokens = std::make_shared<data::TokenFile>(
      data::TokenFile::load(a.data, data::parse_token_format(a.data_format), model->vocab_size()));
  const data::SampleOrder order = data::parse_sample_order(a.data_order);

  // Optimizer and strategy: given, or chosen by the search (--strategy auto).
  const auto factory = optim::AdamW::factory(
      {.lr = a.lr, .betas = {a.beta1, a.beta2}, .eps = a.eps, .weight_decay = a.weight_decay});
  const nlohmann::json agreement = {{"batch_size", a.batch_size},
                                    {"seq_len", a.seq_len},
                                    {"steps", a.steps},
                                    {"seed", a.seed},
                                    {"optimizer",
                                     {{"lr", a.lr},
                                      {"betas", {a.beta1, a.beta2}},
                                      {"eps", a.eps},
                                      {"weight_decay", a.weight_decay},
                                      {"schedule", a.lr_schedule},
                                      {"warmup_steps", a.warmup_steps},
                                      {"min_lr", a.min_lr}}},
                                    {"data", {{"tokens", tokens->size()}, {"order", a.data_order}}},
                                    {"init_from", a.init_from},
                                    {"resume", a.resume}};
  AccelerateResult acc;
  if (search || cached) {
    AccelerateOptions ao;
    if (cached) ao.load_strategy = a.strategy;
    ao.on_stale = a.on_stale == "refuse" ? AccelerateOptions::OnStale::kRefuse
                                         : AccelerateOptions::OnStale::kSearch;
    ao.mem_per_rank = a.mem_per_rank;
    ao.save_strategy_to = a.save_strategy;
    ao.report_dir = a.search_report;
    ao.global_batch = a.batch_size * group->size();
    ao.seq_len = a.seq_len;
    ao.allow_bf16 = a.allow_bf16;
    ao.group = group;
    ao.grad_clip = a.grad_clip;
    ao.agreement = agreement;
    acc = auto_accelerate(model, factory, ao);
    if (leader && acc.report.at("source") == "search") {
      std::cout << report_table(acc.report) << std::flush;
    }
    strategy = acc.strategy;
  } else {
    acc.model = model;
    acc.trainer =
        strategies::apply(model, factory, strategy,
                          {.group = group, .grad_clip = a.grad_clip, .agreement = agreement});
    const dist::ParallelContextPtr& ctx = acc.trainer->context();
    acc.data = {.rank = ctx ? ctx->data_rank() : 0,
                .ranks = ctx ? ctx->data_world() : 1,
                .global_batch = a.batch_size * group->size()};
    acc.model_hash = trace::model_trace_hash(a.model, config);
    acc.strategy = strategy;
  }

  // The data follows the strategy: this rank's data-parallel coordinate (acc.data), its batches
  // built ahead on a background thread (--prefetch; the same batches, the same saved position).
  std::unique_ptr<data::Loader> loader = std::make_unique<data::BatchLoader>(
      tokens, data::LoaderOptions{.batch_size = acc.data.per_rank(),
                                  .seq_len = a.seq_len,
                                  .order = order,
                                  .seed = a.seed,
                                  .rank = acc.data.rank,
                                  .world = acc.data.ranks});
  if (a.prefetch > 0) {
    loader = std::make_unique<data::PrefetchLoader>(std::move(loader),
                                                    data::PrefetchOptions{.depth = a.prefetch});
  }

  // Resume (--resume), checkpoints (--ckpt-dir, --save-every, --keep), the step log (--log-json),
  // the hang detector's progress marks and straggler report: the session.
  TrainingSession session(acc, *loader, std::move(prepared));
  if (leader) {
    logging::info(
        "{} with {:.2f}M parameters, {} tokens in {}, batch {}x{} per rank x {} rank(s), "
        "strategy {}, {} step(s), {} thread(s) per rank",
        a.model, model->num_parameters() / 1e6, tokens->size(), a.data, a.batch_size, a.seq_len,
        group->size(), strategies::to_json(strategy).dump(), a.steps, a.threads);
  }
  for (int64_t step = session.first_step(); step < a.steps; ++step) session.step();
  session.finish();

  const io::Metadata meta = {{"model_type", a.model}, {"config", model->config_json().dump()}};
  if (!a.save.empty()) {
    auto params = acc.trainer->full_parameters();  // collective for sharded strategies
    if (leader) {
      io::save_safetensors(a.save, params, meta);
      logging::info("saved weights to {}", a.save);
    }
  }
  // Dropping the Trainer hands the model back whole on every rank (fsdp gathers it: all ranks
  // take part), so any strategy can sample.
  acc.trainer.reset();
  if (a.sample > 0 && leader) {
    std::string text = sample_text(*model, a.sample, a.seed, a.seq_len);
    std::cout << "----- sample -----\n" << text << "\n------------------\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Train a GPT or Llama language model with AutoAcc"};
  // A flag given twice takes its last value, so scripts can append overrides.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--model", a.model, acc::models::model_type_choices())->capture_default_str();
  app.add_option("--config", a.config, "model config JSON (default: a small byte-level model)");
  app.add_option("--data", a.data, "token file (u16/u32) or text file")->required();
  app.add_option("--data-format", a.data_format, "u16 | u32 | text")->capture_default_str();
  app.add_option("--data-order", a.data_order, "random | sequential")->capture_default_str();
  app.add_option("--init-from", a.init_from, "initial weights (safetensors, model names)");
  app.add_option("--save", a.save, "write the final weights (safetensors)");
  app.add_option("--ckpt-dir", a.ckpt_dir,
                 "sharded checkpoints of the training state (weights, optimizer, data position, "
                 "RNG), one step-N directory each, written at the end and every --save-every "
                 "steps; any rank count and strategy loads them; one job writes a root at a time "
                 "(rank 0 holds its lock, ROOT/.lock, for the job's life)");
  app.add_option("--resume", a.resume,
                 "auto: continue from --ckpt-dir's newest loadable step (falling back past a "
                 "damaged one; none yet: start at 0); or a step directory; or a checkpoint root "
                 "(its newest step: when that does not load, refused naming the older step that "
                 "does)");
  app.add_flag("--ckpt-start-over", a.ckpt_start_over,
               "with --ckpt-dir: delete the root's committed steps (another run's) before "
               "training, and start over; without it a run that does not resume from --ckpt-dir "
               "refuses a root that holds any");
  // Every number is checked whole and in range before anything runs (acc::cli): no clamping,
  // no inf or nan, no negative counts.
  using acc::cli::integer;
  using acc::cli::kOpen;
  using acc::cli::number;
  app.add_option("--steps", a.steps, "total optimizer steps")
      ->check(integer(1))
      ->capture_default_str();
  auto* per_rank = app.add_option("--batch-size", a.batch_size, "sequences per step per rank")
                       ->check(integer(1))
                       ->capture_default_str();
  app.add_option("--global-batch", a.global_batch,
                 "sequences per step over all ranks (each rank takes its share; the same global "
                 "batch on any number of ranks, as after acc-run restarts on fewer nodes)")
      ->check(integer(1))
      ->excludes(per_rank);
  app.add_option("--seq-len", a.seq_len, "tokens per sequence")
      ->check(integer(1))
      ->capture_default_str();
  app.add_option("--lr", a.lr, "peak learning rate")
      ->check(number(0, kOpen))
      ->capture_default_str();
  app.add_option("--lr-schedule", a.lr_schedule, "constant | cosine")->capture_default_str();
  app.add_option("--warmup-steps", a.warmup_steps, "linear warmup steps")
      ->check(integer(0))
      ->capture_default_str();
  app.add_option("--min-lr", a.min_lr, "final lr of the cosine schedule")
      ->check(number(0))
      ->capture_default_str();
  app.add_option("--weight-decay", a.weight_decay, "AdamW decoupled weight decay")
      ->check(number(0))
      ->capture_default_str();
  app.add_option("--beta1", a.beta1, "AdamW beta1")
      ->check(number(0, acc::cli::kClosed, 1, kOpen))
      ->capture_default_str();
  app.add_option("--beta2", a.beta2, "AdamW beta2")
      ->check(number(0, acc::cli::kClosed, 1, kOpen))
      ->capture_default_str();
  app.add_option("--eps", a.eps, "AdamW eps")->check(number(0, kOpen))->capture_default_str();
  app.add_option("--grad-clip", a.grad_clip, "max global gradient norm (0 = off)")
      ->check(number(0))
      ->capture_default_str();
  app.add_option("--seed", a.seed, "seed for init and data order")
      ->check(integer(0))
      ->capture_default_str();
  app.add_option("--threads", a.threads, "threads for OpenBLAS and TBB together")
      ->check(integer(1, 4096))
      ->capture_default_str();
  app.add_option("--save-every", a.save_every,
                 "with --ckpt-dir: also save every N steps (0: at the end only)")
      ->check(integer(0))
      ->capture_default_str();
  app.add_flag("--sync-save", a.sync_save,
               "with --ckpt-dir: wait for each save (default: written in the background while "
               "training goes on, committed at a later step)");
  app.add_option("--keep", a.keep, "with --ckpt-dir: committed checkpoints kept (0: all)")
      ->check(integer(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--log-json", a.log_json, "one JSON line per step");
  app.add_option("--log-every", a.log_every, "console log interval")
      ->check(integer(1))
      ->capture_default_str();
  app.add_option("--prefetch", a.prefetch,
                 "batches built ahead on a background thread (0: on the training thread)")
      ->check(integer(0, 64))
      ->capture_default_str();
  app.add_option("--sample", a.sample, "print this many sampled bytes at the end (text models)")
      ->check(integer(0));
  app.add_option("--strategy", a.strategy,
                 "strategy JSON (file or inline), e.g. '[{\"name\": \"ddp\"}]', a strategy cache "
                 "(acc-search --out, --save-strategy), or auto (the search chooses: "
                 "acc::auto_accelerate); run under mpirun -np N");
  app.add_flag("--allow-bf16", a.allow_bf16, "with --strategy auto: amp may be chosen");
  app.add_option("--mem-per-rank", a.mem_per_rank,
                 "with --strategy auto: tracked memory a rank may use, with a unit (512MiB, 2GiB; "
                 "default: physical memory / local ranks, less 10%)")
      ->transform(acc::cli::bytes(1));
  app.add_option("--save-strategy", a.save_strategy,
                 "with --strategy auto: write the chosen strategy as a cache file (as acc-search "
                 "--out) for later runs' --strategy");
  app.add_option("--search-report", a.search_report,
                 "with --strategy auto: write report.json and report.html into this directory");
  app.add_option("--on-stale", a.on_stale,
                 "a --strategy cache made for another run (model, batch, machine): search again "
                 "or refuse")
      ->check(CLI::IsMember({"search", "refuse"}))
      ->capture_default_str();
  app.add_flag("--reference-attention", a.reference_attention,
               "use the unfused matmul/softmax attention (to find regressions)");
  if (const auto code = acc::cli::parse(app, argc, argv)) return *code;  // bad: 2
  int rc = 0;
  try {
    acc::dist::init(argc, argv);
    if (a.global_batch > 0) {
      const int64_t world = acc::dist::world_size();
      ACC_CHECK(a.global_batch % world == 0, "--global-batch ", a.global_batch,
                " does not split evenly over ", world, " rank(s)");
      a.batch_size = a.global_batch / world;
    }
    rc = run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    rc = 1;
  }
  acc::dist::finalize();
  return rc;
}
