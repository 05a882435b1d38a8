#include "acc/accelerate.hpp"

#include <tbb/task_group.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <optional>
#include <set>

#include "acc/autograd/ops.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/dist/dist.hpp"
#include "acc/search/cost.hpp"
#include "acc/search/dry_run.hpp"
#include "acc/search/report.hpp"
#include "acc/search/space.hpp"
#include "acc/search/status.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/trace/estimate.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/parse.hpp"
#include "acc/util/system.hpp"
#include "acc/util/timer.hpp"

namespace acc {
namespace {

using search::Candidate;

// Random tokens for this rank's dry-run batch (a generator of its own: the user's RNG stays).
data::Batch random_batch(int64_t b, int64_t t, int64_t vocab) {
  Generator g(1234);
  std::vector<int64_t> idx(static_cast<size_t>(b * t)), tgt(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = static_cast<int64_t>(g.next_u64() % static_cast<uint64_t>(vocab));
    tgt[i] = static_cast<int64_t>(g.next_u64() % static_cast<uint64_t>(vocab));
  }
  return {from_vector(idx, {b, t}), from_vector(tgt, {b, t})};
}

// `n` samples from `batch`, repeated (a candidate whose tp or cp ranks read the same samples
// reads global / dp of them, a multiple of the job's share).
data::Batch batch_for(const data::Batch& batch, int64_t n) {
  const int64_t have = batch.size();
  if (n == have) return batch;
  ACC_CHECK(n > 0 && n % have == 0, "auto_accelerate: a candidate's batch of ", n,
            " samples is no multiple of this rank's ", have);
  NoGradGuard no_grad;
  std::vector<data::Batch::Entry> entries;
  for (const auto& [name, t] : batch.tensors()) {
    entries.emplace_back(name, cat(std::vector<Tensor>(static_cast<size_t>(n / have), t), 0));
  }
  return data::Batch(std::move(entries));
}

struct Row {
  const Candidate* candidate;
  search::MemoryPrediction memory;
  std::optional<search::TimePrediction> time;
  /// kExcluded (its layout cannot run the model) | kRejected (memory) | kFits (not costed: a cache
  /// was used) | kRanked | kOk | kOom | kError (the last three after a dry-run)
  search::Status status = search::Status::kFits;
  std::string reason;
  std::optional<search::DryRunResult> measured;
};

// The memory model's stated accuracy (within 5% of the measured peak on every dry-run candidate,
// tests/search/space_*_test.cpp): a candidate fits when its prediction plus this margin does,
// so that one predicted just under the budget does not run out of memory in its dry-run.
constexpr double kMemoryMargin = 0.05;

// Every candidate of the run with its predicted memory; those over the budget rejected.
struct Space {
  std::vector<Candidate> candidates;
  std::deque<Candidate> excluded;  // one per layout that cannot run the model (rows point here)
  std::deque<Candidate> recut;     // pipelines cut where the cost model balances them (rows too)
  std::vector<Row> rows;
  int64_t budget = 0;
  int64_t smallest = -1;  // the least predicted peak of any candidate
  // The optimizer's parameter-sized state buffers (optim::optimizer_state_buffers of the user's
  // factory; a plan assumes AdamW's 2): the memory model's state bytes, the cost model's update.
  int optimizer_buffers = 2;
  std::string optimizer() const { return trace::optimizer_with_state_buffers(optimizer_buffers); }
  // The memory model the rows were predicted by (build_space's), its traces kept for the
  // pipelines' re-cuts.
  std::shared_ptr<search::MemoryModel> memory;
  bool any_fits() const {
    return std::any_of(rows.begin(), rows.end(),
                       [](const Row& r) { return !search::is_refused(r.status); });
  }
};

// The state buffers the factory's optimizer keeps per parameter, found on two probe parameters.
// A factory of one's own that cannot build over them (it may look for its model's names) is
// priced as AdamW, the most state of the three, and says so.
int state_buffers_of(const optim::OptimizerFactory& factory) {
  try {
    return optim::optimizer_state_buffers(factory);
  } catch (const Error& e) {
    logging::warn(
        "auto_accelerate: the optimizer factory did not build over probe parameters ({}); its "
        "state is priced as AdamW's (2 buffers a parameter)",
        e.what());
    return 2;
  }
}

// A plan's optimizer: the factory's state buffers, AdamW's 2 when none is given.
int plan_state_buffers(const optim::OptimizerFactory& factory) {
  return factory ? state_buffers_of(factory) : 2;
}

// max_seq_len 0: a module whose sample batch fixes the shapes (seq_len is not used).
void check_options(const AccelerateOptions& o, int64_t max_seq_len) {
  ACC_CHECK(o.global_batch >= 1, "auto_accelerate: global_batch must be >= 1, got ",
            o.global_batch);
  ACC_CHECK(max_seq_len == 0 || (o.seq_len >= 1 && o.seq_len <= max_seq_len),
            "auto_accelerate: seq_len must be in [1, ", max_seq_len, "], got ", o.seq_len);
  ACC_CHECK(o.mem_per_rank >= 0, "auto_accelerate: mem_per_rank must be >= 0 bytes, got ",
            o.mem_per_rank);
  check_duration_seconds(o.time_budget_s, "auto_accelerate: time_budget_s", ZeroSeconds::kAllowed);
  ACC_CHECK(o.top_k >= 1, "auto_accelerate: top_k must be >= 1, got ", o.top_k);
  ACC_CHECK(o.warmup_steps >= 0 && o.measured_steps >= 1,
            "auto_accelerate: needs warmup_steps >= 0 and measured_steps >= 1, got ",
            o.warmup_steps, " and ", o.measured_steps);
}

int64_t budget_of(const AccelerateOptions& o) {
  // Default: physical memory shared by the ranks of this host, 10% kept for what the tracking
  // allocator does not see (the program, MPI's buffers, the OS).
  return o.mem_per_rank > 0
             ? o.mem_per_rank
             : static_cast<int64_t>(0.9 * static_cast<double>(physical_memory_bytes()) /
                                    std::max(1, dist::local_world_size()));
}

Space build_space(const trace::ModelRef& model, int world, const AccelerateOptions& o,
                  int optimizer_buffers = 2) {
  Space s;
  s.budget = budget_of(o);
  s.optimizer_buffers = optimizer_buffers;
  s.memory = std::make_shared<search::MemoryModel>(model, o.seq_len, s.optimizer());
  search::MemoryModel& memory = *s.memory;
  search::SpaceOptions so;
  so.world = world;
  so.global_batch = o.global_batch;
  so.seq_len = o.seq_len;
  so.allow_bf16 = o.allow_bf16;
  so.excluded = o.excluded;
  so.included = o.included;
  so.has_attention = model.has_attention();
  so.language_model = model.is_registry();
  s.candidates = search::enumerate_candidates(so, memory.num_blocks());
  memory.expect(s.candidates);  // each layout's micro-batches from one pair of traces
  // The predictions on the threads (the needs are made: expect), in the candidates' order.
  std::vector<const Candidate*> runnable;
  for (const auto& c : s.candidates) {
    if (!memory.layout_refusal(c)) runnable.push_back(&c);
  }
  std::vector<search::MemoryPrediction> predicted = memory.predict_all(runnable);
  std::set<std::string> excluded_layouts;
  size_t next = 0;  // predicted[next] is the next runnable candidate's
  for (const auto& c : s.candidates) {
    // A layout (tensor_parallel, sequence_parallel) that cannot run the model is listed once,
    // with its transform's reason; its other combinations are left out.
    if (const auto refusal = memory.layout_refusal(c)) {  // kept from the loop above: a lookup
      if (!excluded_layouts.insert(c.layout_key()).second) continue;
      Candidate& shown = s.excluded.emplace_back(c);  // the row names the layout alone
      shown.set_strategy(strategies::layout_of(c.strategy()));
      s.rows.push_back({&shown,
                        {},
                        std::nullopt,
                        search::Status::kExcluded,
                        *refusal,  // the row's name is the layout
                        std::nullopt});
      continue;
    }
    Row r{&c, std::move(predicted[next++]), std::nullopt, search::Status::kFits, "", std::nullopt};
    s.smallest = s.smallest < 0 ? r.memory.peak : std::min(s.smallest, r.memory.peak);
    if (static_cast<double>(r.memory.peak) * (1 + kMemoryMargin) > static_cast<double>(s.budget)) {
      r.status = search::Status::kRejected;
      r.reason = "predicted peak " + trace::human_bytes(static_cast<double>(r.memory.peak)) +
                 " (+5% margin) over the budget of " +
                 trace::human_bytes(static_cast<double>(s.budget));
    }
    s.rows.push_back(std::move(r));
  }
  ACC_CHECK(s.any_fits(), "auto_accelerate: no candidate fits the memory budget of ",
            trace::human_bytes(static_cast<double>(s.budget)), " per rank (", s.budget,
            " bytes); the smallest predicted need is ",
            trace::human_bytes(static_cast<double>(s.smallest)), " (", s.smallest,
            " bytes; a candidate needs 5% more than its prediction to fit), over ",
            s.candidates.size(), " candidates");
  return s;
}

// The α-β fits of the groups the candidates communicate over besides the whole job (a tp or cp
// group, and dp x cp beside them), one per size (search::calibrate_contiguous_groups).
std::vector<search::CommCalibration> calibrate_groups(const Space& s, dist::ProcessGroup& world) {
  std::set<int> sizes;
  for (const auto& r : s.rows) {
    if (search::is_refused(r.status)) continue;
    const dist::DeviceMesh& m = r.candidate->mesh;
    for (const int size : {m.tp, m.cp, m.dp * m.cp}) {
      if (size > 1 && size < world.size()) sizes.insert(size);
    }
  }
  std::vector<search::CommCalibration> out;
  for (const int size : sizes) out.push_back(search::calibrate_contiguous_groups(world, size));
  return out;
}

// The candidates of the rows that fit the budget: those the time model prices.
std::vector<const Candidate*> fitting(const Space& s) {
  std::vector<const Candidate*> out;
  for (const auto& r : s.rows) {
    if (!search::is_refused(r.status)) out.push_back(r.candidate);
  }
  return out;
}

// Each pipeline candidate cut where the cost model balances its stages' time, the first stage's
// memory respected (search::rebalanced_pipeline). A row for which no such cut differs from its own
// and fits the budget keeps the method's cut (its memory was checked when the space was built).
void recut_pipelines(Space& s, search::CostModel& cost) {
  ACC_CHECK_INTERNAL(s.memory != nullptr, "recut_pipelines: a space without its memory model");
  for (auto& r : s.rows) {
    if (search::is_refused(r.status) || r.candidate->mesh.pp == 1) continue;
    std::optional<search::Recut> recut =
        search::rebalanced_pipeline(*r.candidate, cost, *s.memory, s.budget, kMemoryMargin);
    if (!recut) continue;
    s.recut.push_back(std::move(recut->candidate));
    r.candidate = &s.recut.back();
    r.memory = std::move(recut->memory);
  }
}

// Each candidate that fits priced by `cost`; returns them best first.
std::vector<Row*> rank_rows(Space& s, search::CostModel& cost) {
  std::vector<Row*> ranked;
  for (auto& r : s.rows) {
    if (search::is_refused(r.status)) continue;
    r.time = cost.predict(*r.candidate);
    r.status = search::Status::kRanked;
    ranked.push_back(&r);
  }
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const Row* a, const Row* b) { return a->time->step_s < b->time->step_s; });
  return ranked;
}

// The machine's calibration for the micro-batches of the candidates that fit (rank 0 measures or
// reads its cache, the others get it), then each such candidate's predicted time; returns them
// best first.
std::vector<Row*> rank_by_time(Space& s, const trace::ModelRef& model, const AccelerateOptions& o,
                               dist::ProcessGroup* group, const search::CommCalibration& comm,
                               const std::vector<search::CommCalibration>& group_comm,
                               search::MachineCalibration& machine, double& contention,
                               bool& contention_cached,
                               std::map<int, nlohmann::json>* waits = nullptr) {
  // The GEMM shapes of each layout's ranks (tensor-parallel shards multiply smaller matrices).
  const std::vector<const Candidate*> fit = fitting(s);
  const std::vector<search::GemmShape> shapes =
      search::CostModel::shapes_to_measure_for(model, fit, o.seq_len);
  search::CalibrationOptions co;
  co.cache_dir = o.cache_dir;
  if (!group || group->rank() == 0) machine = search::load_or_calibrate_machine(shapes, co);
  contention = 1.0;
  contention_cached = true;  // nothing to measure on one rank
  search::JobCores cores;    // the job's local ranks and their share of a machine's cores
  if (group && group->size() > 1) {
    machine = search::broadcast_calibration(*group, machine);
    contention =
        search::contention_for_job(*group, machine, shapes, co, &contention_cached, &cores);
  }
  // More ranks x threads than a machine's cores: each collective of a step also waits for peers
  // the kernel descheduled, measured for each group size the fits are of (calibrate_groups: as
  // a tp group's, every rank at once) between GEMMs of the space's median shape.
  search::CommCalibration job_comm = comm;
  std::vector<search::CommCalibration> groups_comm = group_comm;
  double sliced = 1.0;  // the job's ranks x threads over a machine's cores
  if (group && group->size() > 1 && !shapes.empty()) {
    sliced = cores.share;
    if (sliced > 1) {
      const search::WaitProbe probe = search::collective_wait_probe(shapes, machine);
      std::vector<search::CommCalibration*> fits{&job_comm};
      for (auto& g : groups_comm) fits.push_back(&g);
      for (search::CommCalibration* c : fits) {
        c->wait_s = search::measure_collective_wait(*group, c->world, probe.shape, probe.calls, *c);
        c->wait_bulk_s = search::measure_collective_wait(*group, c->world, probe.shape,
                                                         probe.bulk_calls, *c, probe.bulk_bytes);
        c->wait_bulk_bytes = c->world > 1 ? probe.bulk_bytes : 0;
        const double gap = machine.gemm_seconds(probe.shape),
                     long_gap = machine.gemm_seconds(probe.long_shape);
        if (c->world > 1 && long_gap > gap) {  // every rank: the same machine figures
          c->wait_gap_s = gap;
          c->wait_long_gap_s = long_gap;
          c->wait_long_s = search::measure_collective_wait(*group, c->world, probe.long_shape,
                                                           probe.long_calls, *c);
        }
        if (waits) {
          (*waits)[c->world] = {{"ranks", c->world},
                                {"wait_s", c->wait_s},
                                {"wait_bulk_s", c->wait_bulk_s},
                                {"wait_gap_s", c->wait_gap_s},
                                {"wait_long_s", c->wait_long_s},
                                {"wait_long_gap_s", c->wait_long_gap_s}};
        }
        if (group->rank() == 0) {
          logging::info(
              "calibration: a collective over {} of {} ranks waits {:.0f} us beyond its fit "
              "({:.0f} us after {:.0f} us of compute, {:.0f} us at {} KiB; {} ranks x {} "
              "thread(s) on a machine, {:.2f} of them a core)",
              c->world, group->size(), 1e6 * c->wait_s, 1e6 * c->wait_long_s,
              1e6 * c->wait_long_gap_s, 1e6 * c->wait_bulk_s, probe.bulk_bytes >> 10,
              cores.local_ranks, co.threads, cores.share);
        }
      }
    }
  }
  search::CostModel cost(model, o.seq_len, machine, job_comm, contention);
  if (sliced > 1) cost.set_time_slicing(std::min(sliced, contention));
  cost.share_rank_models(s.memory->rank_models());  // the space's ranks and traces, priced again
  cost.set_optimizer_state_buffers(s.optimizer_buffers);
  for (const auto& g : groups_comm) cost.add_group_calibration(g);
  cost.expect(fit);  // each rank trace's micro-batches from one pair of traces, made ahead
  recut_pipelines(s, cost);
  return rank_rows(s, cost);
}

// One row of a report: the candidate, its predictions and measurements, its status.
nlohmann::json row_json(const Row& r, const Row* chosen) {
  nlohmann::json row = {{"strategy", strategies::to_json(r.candidate->strategy())},
                        {"name", r.candidate->describe()},
                        {"micro_batch", r.candidate->micro_batch},
                        {"mesh", r.candidate->mesh.to_string()},
                        {"predicted", {{"memory", r.memory.to_json()}}},
                        {"status", search::status_name(r.status)}};
  if (r.time) row["predicted"]["time"] = r.time->to_json();
  if (r.measured) row["measured"] = r.measured->to_json();
  if (!r.reason.empty()) row["reason"] = r.reason;
  if (&r == chosen) row["chosen"] = true;
  return row;
}

nlohmann::json rows_json(const Space& s, const Row* chosen) {
  // The rows made on the configured threads: 10^5 of them at GPT-3 175B on 1024 devices took
  // 1.3 s of a plan-only search on one.
  std::vector<nlohmann::json> rows(s.rows.size());
  parallel_for(static_cast<int64_t>(s.rows.size()), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      rows[static_cast<size_t>(i)] = row_json(s.rows[static_cast<size_t>(i)], chosen);
    }
  });
  nlohmann::json table = nlohmann::json::array();
  for (nlohmann::json& row : rows) table.push_back(std::move(row));
  return table;
}

// A plan's report (nothing dry-run): the chosen row, the run's sizes and every row; the caller
// adds what priced it ("comm" or "cluster") and its "timing".
nlohmann::json plan_report(const Space& s, const Row* best, int world, const AccelerateOptions& o) {
  return {{"source", search::source_name(search::Source::kPlan)},
          {"chosen", strategies::to_json(best->candidate->strategy())},
          {"chosen_name", best->candidate->describe()},
          {"world", world},
          {"global_batch", o.global_batch},
          {"seq_len", o.seq_len},
          {"budget_bytes", s.budget},
          {"dry_runs", 0},
          {"out_of_time", false},
          {"candidates", rows_json(s, best)}};
}

// Progress of the dry-runs on rank 0: a bar redrawn in place on a terminal, plain lines otherwise
// (a log file or a pipe gets one line per candidate, nothing to strip).
class Progress {
 public:
  Progress(bool on, int total) : on_(on), total_(total), tty_(on && isatty(STDERR_FILENO) == 1) {}
  void start(int i, const std::string& name) {
    if (!on_) return;
    total_ = std::max(total_, i + 1);  // past top_k while every dry-run so far failed
    const double done = timer_.elapsed_s();
    const double eta = i == 0 ? -1 : done / i * (total_ - i);
    char eta_text[32] = "ETA -";
    if (eta >= 0) std::snprintf(eta_text, sizeof(eta_text), "ETA %.1f s", eta);
    if (tty_) {
      std::string bar(20, ' ');
      std::fill_n(bar.begin(), 20 * i / std::max(1, total_), '#');
      std::fprintf(stderr, "\r\033[K[%s] dry-run %d/%d, %s: %s", bar.c_str(), i + 1, total_,
                   eta_text, name.c_str());
    } else {
      std::fprintf(stderr, "auto_accelerate: dry-run %d/%d (%s): %s\n", i + 1, total_, eta_text,
                   name.c_str());
    }
    std::fflush(stderr);
  }
  void finish(const std::string& outcome) {
    if (!on_) return;
    if (tty_) {
      std::fprintf(stderr, "\r\033[K[%s] %d dry-run(s) in %.1f s%s\n", std::string(20, '#').c_str(),
                   total_, timer_.elapsed_s(), outcome.c_str());
    }
    std::fflush(stderr);
  }

 private:
  bool on_;
  int total_;
  bool tty_;
  Timer timer_;
};

// ---- loading a strategy (AccelerateOptions::load_strategy) ----

// What rank 0 decided about the strategy it was given; every rank acts on it.
struct LoadDecision {
  enum class Action { kSearch, kUse /* a row of the space */, kGiven /* a plain strategy */ };
  Action action = Action::kSearch;
  int row = -1;                                     // with kUse
  search::Source source = search::Source::kSearch;  // kCache | kReplanned | kGiven
  std::string note;         // for the log and the report (a stale key's field, a re-plan)
  nlohmann::json strategy;  // with kGiven
  nlohmann::json key = nullptr;
  nlohmann::json to_json() const {
    return {{"action", static_cast<int>(action)},
            {"row", row},
            {"source", search::source_name(source)},
            {"note", note},
            {"strategy", strategy},
            {"key", key}};
  }
  static LoadDecision from_json(const nlohmann::json& j) {
    LoadDecision d;
    // Rank 0's own decision, broadcast: the values are this build's.
    d.action = static_cast<Action>(j.at("action").get<int>());
    d.row = j.at("row");
    d.source = search::parse_source(j.at("source"), "load decision");
    d.note = j.at("note");
    d.strategy = j.at("strategy");
    d.key = j.at("key");
    return d;
  }
};

int find_row(const Space& s, const strategies::Strategy& strategy) {
  const nlohmann::json want = strategies::to_json(strategy);
  for (size_t i = 0; i < s.rows.size(); ++i) {
    if (strategies::to_json(s.rows[i].candidate->strategy()) == want) return static_cast<int>(i);
  }
  return -1;
}

// A cache made for another world size, re-planned for this one: among the candidates that fit,
// the one with most of the cache's methods (by name), then the micro-batch nearest the cache's
// (activation memory and GEMM shapes stay), then most methods with the cache's exact config.
int replan(const Space& s, const search::StrategyCache& cache) {
  int best = -1;
  std::tuple<int, double, int> best_score;
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const Row& r = s.rows[i];
    if (search::is_refused(r.status)) continue;
    int names = 0, exact = 0;
    for (const auto& m : cache.strategy) {
      for (const auto& n : r.candidate->strategy()) {
        if (n.name != m.name) continue;
        ++names;
        exact += n.config == m.config;
      }
    }
    const double distance = std::abs(std::log2(static_cast<double>(r.candidate->micro_batch) /
                                               static_cast<double>(cache.micro_batch)));
    const std::tuple<int, double, int> score{names, -distance, exact};
    if (best < 0 || score > best_score) {
      best = static_cast<int>(i);
      best_score = score;
    }
  }
  return best;
}

// Rank 0: reads the strategy and decides. Throws what reading it throws, and acc::ValueError for
// a stale cache under OnStale::kRefuse.
LoadDecision decide_from_load(const AccelerateOptions& o, const Space& s,
                              const search::StrategyKey& run) {
  const nlohmann::json j = strategies::read_strategy_arg(o.load_strategy);
  LoadDecision d;
  if (!search::is_strategy_cache(j)) {
    d.action = LoadDecision::Action::kGiven;
    d.source = search::Source::kGiven;
    const strategies::Strategy given = strategies::parse_strategy(j);
    d.strategy = strategies::to_json(given);
    d.row = find_row(s, given);
    return d;
  }
  const std::string what = strategies::is_inline_json(o.load_strategy)
                               ? std::string("strategy cache")
                               : "strategy cache '" + o.load_strategy + "'";
  const search::StrategyCache cache = search::StrategyCache::from_json(j, what);
  d.key = cache.key.to_json();
  std::string stale = cache.key.difference(run);
  if (stale.empty()) {
    d.row = find_row(s, cache.strategy);
    if (d.row < 0) {
      stale = "its strategy " + cache.name + " is not in this run's candidate space";
    } else if (search::is_refused(s.rows[static_cast<size_t>(d.row)].status)) {
      stale = "its strategy " + cache.name + ": " + s.rows[static_cast<size_t>(d.row)].reason;
    } else {
      d.action = LoadDecision::Action::kUse;
      d.source = search::Source::kCache;
      d.note = "strategy from " + what + ": " + cache.name;
      return d;
    }
  } else if (cache.key.differs_only_in_world(run)) {
    d.row = replan(s, cache);
    if (d.row >= 0) {
      d.action = LoadDecision::Action::kUse;
      d.source = search::Source::kReplanned;
      d.note = what + " was chosen for " + std::to_string(cache.key.world) +
               " rank(s); re-planned for " + std::to_string(run.world) + ": " + cache.name +
               " -> " + s.rows[static_cast<size_t>(d.row)].candidate->describe();
      return d;
    }
    stale += " and no candidate of this world fits the memory budget";
  }
  ACC_CHECK(o.on_stale != AccelerateOptions::OnStale::kRefuse, what, " does not match this run (",
            stale, "); refusing it as asked (on_stale = refuse)");
  d.action = LoadDecision::Action::kSearch;
  d.note = what + " does not match this run (" + stale + "): searching again";
  return d;
}

// Rank 0 runs `fn` (reading or writing files only it touches); its result, or its error, reaches
// every rank, so a failure there is the same error everywhere instead of a hang elsewhere.
nlohmann::json on_rank0(dist::ProcessGroup* group, const std::function<nlohmann::json()>& fn) {
  nlohmann::json message;
  if (!group || group->rank() == 0) {
    try {
      message = {{"result", fn()}};
    } catch (const IoError& e) {
      if (!group || group->size() == 1) throw;
      message = {{"error", e.what()}, {"kind", "io"}};
    } catch (const Error& e) {
      if (!group || group->size() == 1) throw;
      message = {{"error", e.what()}, {"kind", "value"}};
    }
  }
  if (group && group->size() > 1) {
    message = nlohmann::json::parse(dist::broadcast_text(*group, message.dump()));
  }
  if (message.contains("error")) {
    const std::string text = "(on rank 0) " + message["error"].get<std::string>();
    if (message["kind"] == "io") ACC_THROW(IoError, text);
    ACC_THROW(ValueError, text);
  }
  return message.at("result");
}

// Output paths are checked before any work (rank 0 writes them); a bad one fails every rank.
void check_outputs(const AccelerateOptions& o, dist::ProcessGroup* group) {
  if (o.save_strategy_to.empty() && o.report_dir.empty()) return;
  on_rank0(group, [&] {
    if (!o.save_strategy_to.empty()) check_output_path(o.save_strategy_to, "save_strategy_to");
    if (!o.report_dir.empty()) search::check_report_dir(o.report_dir);
    return nlohmann::json();
  });
}

}  // namespace

std::string report_table(const nlohmann::json& report, size_t max_rows) {
  // Chosen first, then best predicted (rejected last, by memory); only the lines shown are
  // formatted (a plan for a thousand devices has 10^5 rows).
  struct Line {
    bool measured;
    double order;
    const nlohmann::json* row;
  };
  std::vector<Line> lines;
  size_t rejected = 0;
  for (const auto& row : report.at("candidates")) {
    const auto& pred = row.at("predicted");
    const double mem = static_cast<double>(pred.at("memory").at("peak").get<int64_t>());
    const double t = pred.contains("time") ? pred.at("time").at("step_s").get<double>() : -1;
    if (search::parse_status(row.at("status"), "report") == search::Status::kRejected) ++rejected;
    const double order = row.contains("chosen") ? -1 : t >= 0 ? t : 1e30 + mem;
    lines.push_back({row.contains("measured") || row.contains("chosen"), order, &row});
  }
  std::stable_sort(lines.begin(), lines.end(),
                   [](const Line& a, const Line& b) { return a.order < b.order; });
  char buf[512];
  auto text = [&buf](const nlohmann::json& row) {
    const auto& pred = row.at("predicted");
    const double mem = static_cast<double>(pred.at("memory").at("peak").get<int64_t>());
    const double t = pred.contains("time") ? pred.at("time").at("step_s").get<double>() : -1;
    char predicted[32] = "-";
    if (t >= 0) std::snprintf(predicted, sizeof(predicted), "%.1f ms", 1e3 * t);
    std::string measured = "-";
    if (row.contains("measured") &&
        search::parse_status(row["measured"].at("status"), "report") == search::Status::kOk) {
      std::snprintf(
          buf, sizeof(buf), "%.1f ms, %s", 1e3 * row["measured"].at("step_seconds").get<double>(),
          trace::human_bytes(static_cast<double>(row["measured"].at("peak_bytes").get<int64_t>()))
              .c_str());
      measured = buf;
    }
    std::snprintf(buf, sizeof(buf), "%s %-76s %10s %12s  %-22s %s",
                  row.contains("chosen") ? "*" : " ", row.at("name").get<std::string>().c_str(),
                  predicted, trace::human_bytes(mem).c_str(), measured.c_str(),
                  row.at("status").get<std::string>().c_str());
    return std::string(buf);
  };
  std::snprintf(buf, sizeof(buf), "  %-76s %10s %12s  %-22s %s\n", "candidate", "predicted",
                "pred. memory", "measured", "status");
  std::string out = buf;
  size_t shown = 0;
  for (const auto& l : lines) {
    if (l.measured || shown < max_rows) {
      out += text(*l.row) + "\n";
      ++shown;
    }
  }
  if (shown < lines.size()) {
    out += "  ... " + std::to_string(lines.size() - shown) + " more (" + std::to_string(rejected) +
           " rejected by memory in all); the report has every row\n";
  }
  return out;
}

search::StrategyCache cache_from_report(const nlohmann::json& report,
                                        const search::StrategyKey& key) {
  for (const auto& row : report.at("candidates")) {
    if (!row.contains("chosen")) continue;
    search::StrategyCache c;
    c.key = key;
    c.strategy = strategies::parse_strategy(row.at("strategy"));
    c.name = row.at("name").get<std::string>();
    c.micro_batch = row.at("micro_batch").get<int64_t>();
    c.predicted = row.at("predicted");
    c.measured = row.contains("measured") ? row.at("measured") : nlohmann::json::object();
    return c;
  }
  ACC_THROW(ValueError, "the report has no chosen candidate among its ",
            report.at("candidates").size(), " rows");
}

double AccelerateResult::train_step(const data::Batch& batch) {
  ACC_CHECK(batch.size() == data.per_rank(), "train_step: a batch of ", batch.size(), " samples (",
            batch.describe(), "), this rank's share of the global batch ", data.global_batch,
            " over ", data.ranks, " data-parallel rank(s) is ", data.per_rank(),
            " (AccelerateResult::data says which samples)");
  return trainer->train_step(batch);
}

nlohmann::json plan_strategy(const std::string& type, const nlohmann::json& config, int world,
                             const AccelerateOptions& o, const search::CommCalibration& comm,
                             const optim::OptimizerFactory& optimizer) {
  return plan_strategy(trace::ModelRef::registry(type, config), world, o, comm, optimizer);
}

nlohmann::json plan_strategy(const trace::ModelRef& model, int world, const AccelerateOptions& o,
                             const search::CommCalibration& comm,
                             const optim::OptimizerFactory& optimizer) {
  check_options(o, model.max_seq_len());
  ACC_CHECK(world == 1 || comm.world == world, "plan_strategy: the collectives were calibrated on ",
            comm.world, " rank(s), the plan is for ", world);
  Timer total;
  Space s = build_space(model, world, o, plan_state_buffers(optimizer));
  search::MachineCalibration machine;
  Timer calib;
  // Ranks that share a machine slow each other down; without them to measure, a plan assumes
  // they do not (one rank per machine, or cores enough for all).
  double contention = 1.0;
  bool contention_cached = true;
  // No groups to measure: a tp or cp group is priced at the job's fits (cost.hpp).
  std::vector<Row*> ranked =
      rank_by_time(s, model, o, nullptr, comm, {}, machine, contention, contention_cached);
  nlohmann::json report = plan_report(s, ranked.front(), world, o);
  report["comm"] = comm.to_json();
  report["timing"] = {{"calibration_s", calib.elapsed_s()},
                      {"dry_run_s", 0.0},
                      {"total_s", total.elapsed_s()},
                      {"machine_calibration_from_cache", machine.source.gemm_measured == 0}};
  return report;
}

namespace {

// FLOPs of one sample's forward and backward through the whole model, nothing recomputed: the
// traced matrix products (the attention core's causal half), at any depth.
double model_flops_per_sample(const trace::ModelRef& model, int64_t seq_len) {
  return static_cast<double>(trace::estimate_training_need(model, 1, seq_len).compute.total());
}

// The pinned strategy's candidate, its sizes checked against the world and the batch.
Candidate pinned_candidate(const strategies::Strategy& s, int world, const trace::ModelRef& model,
                           const AccelerateOptions& o) {
  const strategies::SearchContext ctx{.world = world,
                                      .num_blocks = model.num_layers(),
                                      .per_rank_batch = o.global_batch,
                                      .allow_bf16 = true,
                                      .has_attention = model.has_attention(),
                                      .language_model = model.is_registry()};
  // Its mesh (strategies::mesh_for names one that does not tile the world).
  Candidate c =
      search::candidate_of(s, world, o.global_batch, ctx, strategies::searchable_methods());
  const dist::DeviceMesh& mesh = c.mesh;
  ACC_CHECK(o.global_batch % mesh.dp == 0, "--strategy: global batch ", o.global_batch,
            " does not split evenly over dp ", mesh.dp, " (", mesh.to_string(), ")");
  ACC_CHECK(c.per_rank_batch % c.effects.micro_batches == 0,
            "--strategy: ", c.effects.micro_batches, " micro-batches do not divide the ",
            c.per_rank_batch, " samples of a dp rank (global batch ", o.global_batch, " over dp ",
            mesh.dp, ")");
  return c;
}

}  // namespace

nlohmann::json plan_for_cluster(const trace::ModelRef& model, int world, const AccelerateOptions& o,
                                const search::ClusterProfile& cluster,
                                const std::optional<strategies::Strategy>& pinned,
                                const optim::OptimizerFactory& optimizer) {
  check_options(o, model.max_seq_len());
  ACC_CHECK(world >= 1, "plan_for_cluster: world must be >= 1, got ", world);
  Timer total;
  AccelerateOptions budgeted = o;
  if (budgeted.mem_per_rank == 0) budgeted.mem_per_rank = cluster.budget_bytes();
  const int buffers = plan_state_buffers(optimizer);
  Space s;
  if (pinned) {
    // The pinned strategy alone, priced even when over the budget (its row says so).
    s.budget = budgeted.mem_per_rank;
    s.optimizer_buffers = buffers;
    s.memory = std::make_shared<search::MemoryModel>(model, o.seq_len, s.optimizer());
    search::MemoryModel& memory = *s.memory;
    s.candidates.push_back(pinned_candidate(*pinned, world, model, o));
    const Candidate& c = s.candidates.back();
    if (const auto refusal = memory.layout_refusal(c)) {
      ACC_THROW(ValueError, "--strategy ", c.describe(), " cannot run this model: ", *refusal);
    }
    Row r{&c, memory.predict(c), std::nullopt, search::Status::kFits, "", std::nullopt};
    if (static_cast<double>(r.memory.peak) > static_cast<double>(s.budget)) {
      r.reason = "predicted peak " + trace::human_bytes(static_cast<double>(r.memory.peak)) +
                 " is over the device's " + trace::human_bytes(static_cast<double>(s.budget));
    }
    s.rows.push_back(std::move(r));
  } else {
    s = build_space(model, world, budgeted, buffers);
  }
  const double space_s = total.elapsed_s();
  auto cost = std::make_shared<search::CostModel>(model, o.seq_len, cluster);
  cost->share_rank_models(s.memory->rank_models());  // the space's ranks and traces, priced again
  cost->set_optimizer_state_buffers(s.optimizer_buffers);
  cost->expect(fitting(s));  // each rank trace's micro-batches from one pair of traces, made ahead
  if (!pinned) recut_pipelines(s, *cost);
  const double flops_per_step =
      model_flops_per_sample(model, o.seq_len) * static_cast<double>(o.global_batch);
  const std::vector<Row*> ranked = rank_rows(s, *cost);
  // Nothing below reads the models: they and their traces (small graphs by the thousand, 2 GB
  // and half a second of frees at GPT-3 175B on 1024 devices) are freed by a task of the
  // configured threads while the report is made (waited for on the way out, also when the
  // report throws: frees do not). The task holds the last references.
  struct Freed {  // TBB calls its task const: the references it drops are mutable
    mutable std::shared_ptr<search::MemoryModel> memory;
    mutable std::shared_ptr<search::CostModel> cost;
    void operator()() const {
      cost.reset();
      memory.reset();
    }
  };
  tbb::task_group freeing;
  freeing.run(Freed{std::move(s.memory), std::move(cost)});
  struct Waited {
    tbb::task_group& group;
    ~Waited() { group.wait(); }
  } waited{freeing};
  nlohmann::json report = plan_report(s, ranked.front(), world, o);
  report["cluster"] = cluster.to_json();
  report["timing"] = {{"calibration_s", 0.0},
                      {"dry_run_s", 0.0},
                      {"space_s", space_s},  // the candidates and their memory
                      {"time_model_s", total.elapsed_s() - space_s},
                      {"total_s", total.elapsed_s()},
                      {"machine_calibration_from_cache", true}};
  // The throughput figures of each priced row (rows_json keeps the rows' order).
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const Row& r = s.rows[i];
    if (!r.time) continue;
    const double tflops = flops_per_step / r.time->step_s / world / 1e12;
    nlohmann::json& predicted = report["candidates"][i]["predicted"];
    predicted["model_tflops_per_device"] = tflops;
    predicted["mfu"] = tflops / cluster.peak_tflops(r.candidate->effects.bf16_activations);
  }
  return report;
}

AccelerateResult auto_accelerate(nn::ModulePtr model, optim::OptimizerFactory factory,
                                 const AccelerateOptions& o) {
  ACC_CHECK(model != nullptr, "auto_accelerate: model is null");
  const auto* lm = dynamic_cast<const models::LanguageModel*>(model.get());
  ACC_CHECK(lm != nullptr || (o.sample_batch && o.loss), "auto_accelerate: the model (",
            model->type_name(), ") is not a language model of the registry: give ",
            !o.sample_batch ? "options.sample_batch (this rank's batch, what the search traces "
                              "and dry-runs)"
                            : "",
            !o.sample_batch && !o.loss ? " and " : "",
            !o.loss ? "options.loss (Module&, const Batch&) -> its mean loss" : "");
  check_options(o, lm != nullptr ? lm->max_seq_len() : 0);
  Timer total;
  dist::ProcessGroupPtr group =
      o.group ? o.group : (dist::is_initialized() ? dist::ProcessGroup::world() : nullptr);
  const int world = group ? group->size() : 1;
  const bool leader = !group || group->rank() == 0;
  check_outputs(o, group.get());

  // This rank's batch for the traces of a user's module and the dry-runs.
  const int64_t per_rank = search::per_rank_batch(o.global_batch, world);
  const data::Batch batch =
      o.sample_batch ? *o.sample_batch : random_batch(per_rank, o.seq_len, lm->vocab_size());
  ACC_CHECK(batch.size() == per_rank, "auto_accelerate: sample_batch has ", batch.size(),
            " samples (", batch.describe(), "), this rank's share of global_batch ", o.global_batch,
            " over ", world, " rank(s) is ", per_rank);
  // What the search traces: a registry model by type and config; a user's module itself.
  const trace::ModelRef ref = lm != nullptr
                                  ? trace::ModelRef::registry(lm->model_type(), lm->config_json())
                                  : trace::ModelRef::module(model, batch, o.loss);
  // The space and each candidate's memory (the optimizer state the factory's optimizer keeps):
  // rejected ones are never run.
  Space s = build_space(ref, world, o, state_buffers_of(factory));
  // The key of this run (rank 0's: its machine is the one the figures were measured on).
  std::optional<search::StrategyKey> key;
  if (leader && (!o.load_strategy.empty() || !o.save_strategy_to.empty())) {
    key = search::strategy_key(ref, world, o.global_batch, o.seq_len);
  }

  // A strategy given or cached skips the search (rank 0 reads it and decides for all).
  LoadDecision decision;
  decision.action = LoadDecision::Action::kSearch;
  if (!o.load_strategy.empty()) {
    decision = LoadDecision::from_json(
        on_rank0(group.get(), [&] { return decide_from_load(o, s, *key).to_json(); }));
    if (leader && !decision.note.empty()) logging::info("auto_accelerate: {}", decision.note);
  }

  AccelerateResult result;
  result.model = model;
  result.model_hash = ref.hash();
  nlohmann::json report = {{"world", world},       {"global_batch", o.global_batch},
                           {"seq_len", o.seq_len}, {"budget_bytes", s.budget},
                           {"dry_runs", 0},        {"out_of_time", false}};
  if (!decision.note.empty()) report["note"] = decision.note;
  if (!decision.key.is_null()) report["cache_key"] = decision.key;
  const Row* best = nullptr;
  if (decision.action == LoadDecision::Action::kUse ||
      (decision.action == LoadDecision::Action::kGiven && decision.row >= 0)) {
    best = &s.rows.at(static_cast<size_t>(decision.row));
    ACC_CHECK(!search::is_refused(best->status), "auto_accelerate: the strategy given (",
              best->candidate->describe(), ") does not fit: ", best->reason);
    result.strategy = best->candidate->strategy();
    report["source"] = search::source_name(decision.source);
  } else if (decision.action == LoadDecision::Action::kGiven) {
    ACC_CHECK(o.save_strategy_to.empty(), "auto_accelerate: save_strategy_to: the strategy given (",
              decision.strategy.dump(),
              ") is not a candidate of the search, so there are no figures to cache; save it as a "
              "plain strategy list instead");
    // Outside the search space (a config the search does not try): applied as given, its
    // memory not predicted.
    result.strategy = strategies::parse_strategy(decision.strategy);
    report["source"] = search::source_name(search::Source::kGiven);
    if (leader) {
      logging::warn(
          "auto_accelerate: the strategy given ({}) is not in the search space; applied as given, "
          "its memory not predicted",
          decision.strategy.dump());
    }
  } else {
    report["source"] = search::source_name(search::Source::kSearch);
    // Calibrate (the machine on rank 0, cached, shared; the collectives on this group) and rank.
    Timer calib;
    search::CommCalibration comm;
    comm.world = 1;
    if (group && world > 1) comm = search::calibrate_collectives_for_search(*group);
    const std::vector<search::CommCalibration> group_comm =
        group && world > 1 ? calibrate_groups(s, *group) : std::vector<search::CommCalibration>{};
    const double comm_s = calib.elapsed_s();
    search::MachineCalibration machine;
    double contention = 1.0;
    bool contention_cached = true;
    // By group size, the collective waits measured (CommCalibration): more ranks than cores only.
    std::map<int, nlohmann::json> waits;
    std::vector<Row*> ranked = rank_by_time(s, ref, o, group.get(), comm, group_comm, machine,
                                            contention, contention_cached, &waits);
    const double calibration_s = calib.elapsed_s();
    if (leader) {
      logging::debug(
          "auto_accelerate: calibration {:.3f} s (collectives {:.3f} s), contention {:.2f}",
          calibration_s, comm_s, contention);
    }

    // Dry-run the best predicted, in that order, under the budget and the time limit.
    Timer dry;
    bool out_of_time = false;
    const int to_try = std::min<int>(o.top_k, static_cast<int>(ranked.size()));
    Progress progress(leader && o.verbose, to_try);
    int tried = 0;
    bool any_ok = false;
    for (Row* r : ranked) {
      // top_k, and on while every one tried has failed (the next best may well fit).
      if (tried >= to_try && any_ok) break;
      // Every rank decides alike: the elapsed time is rank 0's.
      bool stop = o.time_budget_s > 0 && dry.elapsed_s() > o.time_budget_s && tried > 0;
      if (group && world > 1) {
        Tensor flag = from_vector(std::vector<int64_t>{stop ? 1 : 0}, {1});
        group->broadcast(flag, 0)->wait();
        stop = flag.to_vector<int64_t>()[0] != 0;
      }
      if (stop) {
        out_of_time = true;
        break;
      }
      progress.start(tried, r->candidate->describe());
      // A collective waits at most 10 predicted steps (10 s at least) for the slowest rank.
      const auto limit = std::chrono::milliseconds(
          static_cast<int64_t>(1e3 * std::max(10.0, 10 * r->time->step_s)));
      r->measured = search::dry_run(*model, factory, *r->candidate,
                                    batch_for(batch, r->candidate->per_rank_batch), group,
                                    {.warmup_steps = o.warmup_steps,
                                     .measured_steps = o.measured_steps,
                                     .memory_budget = s.budget,
                                     .grad_clip = o.grad_clip,
                                     .collective_timeout = limit,
                                     .loss = o.loss});
      r->status = r->measured->status;
      r->reason = r->measured->error;
      any_ok = any_ok || r->status == search::Status::kOk;
      ++tried;
    }
    for (Row* r : ranked) {
      if (r->measured && r->status == search::Status::kOk &&
          (!best || r->measured->step_seconds < best->measured->step_seconds)) {
        best = r;
      }
    }
    // Rank 0 decides (the figures are the same on every rank, reduced over them, but one decision
    // broadcast cannot differ by a rounding).
    if (group && world > 1) {
      Tensor index = from_vector(
          std::vector<int64_t>{best ? static_cast<int64_t>(best - s.rows.data()) : -1}, {1});
      group->broadcast(index, 0)->wait();
      const int64_t i = index.to_vector<int64_t>()[0];
      best = i < 0 ? nullptr : &s.rows.at(static_cast<size_t>(i));
    }
    progress.finish(out_of_time ? " (time budget ran out)" : "");
    ACC_CHECK(best != nullptr, "auto_accelerate: every dry-run candidate failed (", tried,
              " tried; the first: ", ranked.front()->reason, ")");
    result.strategy = best->candidate->strategy();
    report["dry_runs"] = tried;
    report["out_of_time"] = out_of_time;
    report["compute_contention"] = contention;
    if (!waits.empty()) {
      nlohmann::json w = nlohmann::json::array();
      for (const auto& [size, figures] : waits) w.push_back(figures);
      report["collective_wait"] = w;
    }
    report["comm"] = comm.to_json();
    report["timing"] = {
        {"calibration_s", calibration_s},
        {"dry_run_s", dry.elapsed_s()},
        {"total_s", total.elapsed_s()},
        {"machine_calibration_from_cache", machine.source.gemm_measured == 0 && contention_cached},
        {"contention_from_cache", contention_cached}};
    if (leader && o.verbose) {
      logging::info(
          "auto_accelerate: {} candidates, {} rejected by memory, {} dry-run{}; chose {} "
          "({:.1f} ms/step measured, {:.1f} predicted)",
          s.rows.size(),
          std::count_if(s.rows.begin(), s.rows.end(),
                        [](const Row& r) { return r.status == search::Status::kRejected; }),
          tried, out_of_time ? " (time budget ran out)" : "", best->candidate->describe(),
          1e3 * best->measured->step_seconds, 1e3 * best->time->step_s);
    }
  }
  if (group && world > 1) {
    dist::check_agreement(*group, strategies::to_json(result.strategy),
                          "auto_accelerate: ranks chose different strategies");
  }
  report["chosen"] = strategies::to_json(result.strategy);
  report["chosen_name"] = best ? best->candidate->describe() : decision.strategy.dump();
  report["candidates"] = rows_json(s, best);
  if (report.contains("timing")) report["timing"]["total_s"] = total.elapsed_s();
  result.report = std::move(report);

  // The outputs (rank 0), then the strategy applied to the user's model.
  on_rank0(group.get(), [&] {
    if (!o.report_dir.empty()) search::write_report(result.report, o.report_dir);
    if (!o.save_strategy_to.empty()) {
      search::save_strategy_cache(cache_from_report(result.report, *key), o.save_strategy_to);
      logging::info("auto_accelerate: strategy saved to {}", o.save_strategy_to);
    }
    return nlohmann::json();
  });
  result.trainer = strategies::apply(model, std::move(factory), result.strategy,
                                     {.group = group,
                                      .grad_clip = o.grad_clip,
                                      .agreement = o.agreement,
                                      .loss = o.loss,
                                      .sample_batch = o.sample_batch.value_or(data::Batch())});
  const dist::ParallelContextPtr& ctx = result.trainer->context();
  result.data = {.rank = ctx ? ctx->data_rank() : 0,
                 .ranks = ctx ? ctx->data_world() : 1,
                 .global_batch = o.global_batch};
  return result;
}

}  // namespace acc
