#pragma once
// auto_accelerate: the one call a user makes. It traces the model, builds every candidate
// strategy the registered methods declare, rejects those whose predicted memory does not fit the
// budget, ranks the rest by the calibrated time model, dry-runs the best few for real (on copies of
// a language model of the registry; a user's own module in place, its state put back after each),
// and applies the fastest measured one to the model. Every candidate trains the same
// global batch, so the choice never changes the training math.
//
//   acc::AccelerateOptions opts;
//   opts.global_batch = 64; opts.seq_len = 256;
//   auto acc = acc::auto_accelerate(model, acc::optim::AdamW::factory({.lr = 3e-4}), opts);
//   for (...) { double loss = acc.train_step(loader.next()); }
//
// Collective over the group: every rank calls it with the same arguments, and every rank gets
// the same decision: rank 0 decides (the dry-run figures are reduced over the ranks; a cache is
// read and judged there) and broadcasts it, and dist::check_agreement confirms the strategy.

#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "acc/data/token_data.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/models/language_model.hpp"
#include "acc/optim/optimizer.hpp"
#include "acc/search/cache.hpp"
#include "acc/search/calibration.hpp"
#include "acc/search/cluster.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc {

struct AccelerateOptions {
  /// Samples per optimizer step over all ranks, and tokens per sample: fixed for every candidate.
  int64_t global_batch = 0;
  int64_t seq_len = 0;
  /// This rank's batch (global_batch / ranks samples) for the dry-runs, and for a module that is
  /// not a language model of the registry what the search traces (required then); random tokens
  /// for a language model when unset. A candidate whose tp or cp ranks read the same samples
  /// (global / dp of them) is dry-run on it repeated.
  std::optional<data::Batch> sample_batch;
  /// The loss of a micro-batch (strategies::LossFn). Required for a module that is not a language
  /// model; a language model's next-token loss when empty.
  strategies::LossFn loss = nullptr;
  std::vector<std::string> excluded;  // methods never tried
  std::vector<std::string> included;  // methods every candidate has
  bool allow_bf16 = false;            // amp is searched only when allowed
  /// Tracked tensor bytes a rank may use (0: physical memory / local ranks, minus 10% headroom).
  int64_t mem_per_rank = 0;
  /// Seconds the dry-runs may take in all (0: no limit); the search stops dry-running when it
  /// runs out and says so in the report. At most 604800 (7 days, acc::kMaxDurationSeconds).
  double time_budget_s = 0;
  int top_k = 3;  // candidates dry-run, best predicted first
  int warmup_steps = 1;
  int measured_steps = 3;
  bool verbose = true;          // rank 0 logs the table
  dist::ProcessGroupPtr group;  // default: the world when acc::dist is initialised
  /// Global gradient-norm clipping (0 = off) for the dry-runs and the applied strategy, and what
  /// else the ranks must agree on (strategies::ApplyOptions).
  double grad_clip = 0.0;
  nlohmann::json agreement = nlohmann::json::object();
  std::string cache_dir;  // machine calibration cache ("" : the default)

  /// Skip the search: a strategy cache (accelerate/cache.hpp; a file, or its JSON inline) or a
  /// plain strategy list (file or inline, applied as given). A cache whose key matches this run
  /// is used after its memory is checked against the budget; one whose key differs only in the
  /// world size is re-planned for this world; any other difference is logged by field and, by
  /// `on_stale`, the search runs or acc::ValueError names the field. Read on rank 0 only.
  std::string load_strategy;
  enum class OnStale { kSearch, kRefuse };
  OnStale on_stale = OnStale::kSearch;
  /// Where rank 0 writes the chosen strategy as a cache ("" : nowhere); checked before the search.
  std::string save_strategy_to;
  /// Where rank 0 writes report.json and report.html ("" : nowhere); checked before the search.
  std::string report_dir;
};

struct AccelerateResult {
  nn::ModulePtr model;
  std::unique_ptr<strategies::Trainer> trainer;
  /// What this rank reads: its data-parallel coordinate among the chosen layout's data-parallel
  /// ranks, and the global batch (data::Shard::sample_indices(step) are its samples of a step).
  data::Shard data;
  /// 16 hex digits naming what the model computes (trace::model_trace_hash for a language model of
  /// the registry; the trace of the module on the sample batch otherwise): the strategy cache's
  /// and checkpoints' model key.
  std::string model_hash;
  strategies::Strategy strategy;
  /// {"source": "search" | "cache" | "replanned" | "given", "chosen": ..., "budget_bytes": ...,
  ///  "candidates": [{"strategy", "name", "predicted": {...}, "measured": {...}, "status",
  ///  "reason"}, ...], "timing": {...}, "key": {...}, "cache": {...}}
  nlohmann::json report;
  /// One optimizer step on this rank's batch (global_batch / ranks samples).
  /// Throws acc::ValueError naming both sizes when the batch is not this rank's share (a global
  /// batch passed whole would train on ranks x the samples), and what Trainer::train_step throws.
  double train_step(const data::Batch& batch);
  /// The plain loop instead of train_step (strategies::Trainer::loss and step): per step,
  /// grad_accum_steps() micro-batches of loss(idx, targets) and backward, then step().
  Tensor loss(const data::Batch& micro_batch) { return trainer->loss(micro_batch); }
  Tensor loss(const Tensor& idx, const Tensor& targets) { return trainer->loss(idx, targets); }
  void step() { trainer->step(); }
  int grad_accum_steps() const { return trainer->grad_accum_steps(); }
  optim::Optimizer& optimizer() { return trainer->optimizer(); }
};

/// The report's candidates as a text table, best predicted first, the chosen one marked with '*':
/// every dry-run candidate and the best others up to `max_rows` lines, then a count of the rest.
std::string report_table(const nlohmann::json& report, size_t max_rows = 12);

/// Throws acc::ValueError for bad options (naming the value), and when no candidate fits the
/// memory budget (naming the smallest predicted need); the model is left untouched then.
///
/// Any nn::Module: a models::LanguageModel of the registry is traced by type and config (meta
/// copies, any depth); any other module is traced itself on options.sample_batch's shapes through
/// options.loss (both required: acc::ValueError naming what is missing), and its dry-runs train
/// the module in place with its state put back after each (search/dry_run.hpp). seq_len is a
/// language model's only.
AccelerateResult auto_accelerate(nn::ModulePtr model, optim::OptimizerFactory factory,
                                 const AccelerateOptions& options);

/// The search without running anything, for acc-search --plan-only: every candidate of a model
/// of `model_type` / `config` on `world` ranks with its predicted memory and time (the machine
/// calibration from the cache, measured when missing; collectives priced by `comm`, which must be
/// for `world` ranks unless world is 1), rejected by the budget, the best predicted that fits as
/// "chosen". Options used: global_batch, seq_len, excluded, included, allow_bf16, mem_per_rank
/// (0: this machine's default), cache_dir, verbose. The optimizer state (memory, and the update's
/// pass over it) is what `optimizer`'s optimizers keep (optim::optimizer_state_buffers); an empty
/// factory is AdamW's. The report is auto_accelerate's with nothing measured ("source": "plan").
/// Throws as auto_accelerate does.
nlohmann::json plan_strategy(const std::string& model_type, const nlohmann::json& config, int world,
                             const AccelerateOptions& options, const search::CommCalibration& comm,
                             const optim::OptimizerFactory& optimizer = {});
/// The same for any model (a module of the registry that is not a language model: traced whole on
/// its sample's shapes).
nlohmann::json plan_strategy(const trace::ModelRef& model, int world,
                             const AccelerateOptions& options, const search::CommCalibration& comm,
                             const optim::OptimizerFactory& optimizer = {});

/// A plan for a cluster not at hand (acc-search --plan-only --cluster): every candidate on `world`
/// devices priced by `cluster`'s figures (search::ClusterProfile: no machine calibration, no
/// collective fits), rejected when over the device's memory (options.mem_per_rank, when given,
/// instead of the profile's budget), the fastest that fits chosen; or, with `pinned`, that
/// strategy alone (the semi-automatic mode: its methods and sizes fixed), predicted as it is even
/// when it does not fit (its row then says why). Each priced row's "predicted" adds
/// "model_tflops_per_device" (the model's FLOPs a step, forward and backward of every sample,
/// nothing recomputed, over the step time and the devices) and "mfu" (that over the device's
/// peak in the candidate's dtype). The report also holds "cluster" (the profile). Throws
/// acc::ValueError naming what is wrong with a pinned strategy (a mesh that does not tile the
/// world, a batch its dp or micro-batches do not divide) and what plan_strategy throws. The
/// optimizer's state as plan_strategy prices it.
nlohmann::json plan_for_cluster(const trace::ModelRef& model, int world,
                                const AccelerateOptions& options,
                                const search::ClusterProfile& cluster,
                                const std::optional<strategies::Strategy>& pinned = std::nullopt,
                                const optim::OptimizerFactory& optimizer = {});

/// The chosen candidate of a report as a strategy cache for `key` (its strategy, description,
/// micro-batch, predicted and measured figures).
search::StrategyCache cache_from_report(const nlohmann::json& report,
                                        const search::StrategyKey& key);

}  // namespace acc
