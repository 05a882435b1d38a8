// bench_search: how good is auto_accelerate's choice, how good are its models, and how long does
// the search take? One JSON line (rank 0) per run:
//
//   mpirun -np 2 build/benchmarks/bench_search --model gpt --global-batch 8 --seq-len 64
//
// 1. The machine calibration cache is warmed first (rank 0 measures the GEMM shapes of every
//    layout's ranks at every micro-batch of the space that the cache lacks; all ranks the
//    contention factor for this many local ranks if it lacks that), so the search runs as a user's
//    second run does; the JSON says whether the search's machine figures came from the cache.
// 2. auto_accelerate runs on a copy of the model, with the options given: its report and wall
//    time (calibration, dry-runs, the rest).
// 3. The exhaustive pass dry-runs every candidate the search did not reject by memory, as the
//    search dry-runs one (dry_run: warm-up, measured steps, the slowest rank's median), --rounds
//    times, every other round in reverse order; the median of the rounds per candidate, and the
//    largest measured peak.
// 4. The chosen candidate and the fastest few of the exhaustive pass are re-timed side by side:
//    one trainer each, in turns (A B C A B C ...): a warm-up step (after another model's step the
//    caches hold that model; a step alternating with another would time a cold cache that
//    training never has), then two timed steps, each starting from a barrier and taking its
//    slowest rank's time; medians per candidate.
//
// Figures: regret = the best re-timed median / the chosen one's (1: the choice was the fastest);
// Spearman's rank correlation of predicted against measured step time over the exhaustive pass,
// and of the pass's second round against its first (the measurement's own repeatability);
// each candidate's memory error (predicted peak / measured peak - 1); search wall time, its
// shares, and over the chosen strategy's re-timed step time (the search in training steps).

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <regex>
#include <set>

#include "acc/accelerate.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/dist/dist.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/search/calibration.hpp"
#include "acc/search/cost.hpp"
#include "acc/search/dry_run.hpp"
#include "acc/search/space.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"
#include "acc/util/timer.hpp"
#include "bench_util.hpp"

namespace {

using acc::bench::median;

nlohmann::json config_for(const std::string& model, const std::string& file) {
  const std::string dir = ACC_SOURCE_DIR "/examples/configs/";
  if (!file.empty()) return acc::models::read_json_file(file);
  return acc::models::read_json_file(dir +
                                     (model == "llama" ? "llama_small.json" : "gpt_small.json"));
}

// Ranks 1..n of v, ties sharing their mean rank.
std::vector<double> ranks(const std::vector<double>& v) {
  std::vector<size_t> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
  std::vector<double> r(v.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && v[order[j + 1]] == v[order[i]]) ++j;
    for (size_t k = i; k <= j; ++k) r[order[k]] = 0.5 * static_cast<double>(i + j) + 1;
    i = j + 1;
  }
  return r;
}

double spearman(const std::vector<double>& x, const std::vector<double>& y) {
  const std::vector<double> rx = ranks(x), ry = ranks(y);
  const double n = static_cast<double>(x.size());
  const double mx = std::accumulate(rx.begin(), rx.end(), 0.0) / n;
  const double my = std::accumulate(ry.begin(), ry.end(), 0.0) / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (rx[i] - mx) * (ry[i] - my);
    sxx += (rx[i] - mx) * (rx[i] - mx);
    syy += (ry[i] - my) * (ry[i] - my);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0.0;
}

// The least-squares line y = a + b x: {a, b} ({mean y, 0} when x does not vary).
std::pair<double, double> line_fit(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = static_cast<double>(x.size());
  if (x.empty()) return {0.0, 0.0};
  const double mx = std::accumulate(x.begin(), x.end(), 0.0) / n;
  const double my = std::accumulate(y.begin(), y.end(), 0.0) / n;
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
  }
  const double b = sxx > 0 ? sxy / sxx : 0.0;
  return {my - b * mx, b};
}

struct Row {
  const acc::search::Candidate* candidate = nullptr;
  std::string name;
  double predicted_s = 0;
  int64_t predicted_peak = 0;
  nlohmann::json predicted_time;  // the report's breakdown (compute, exposed comm, bubble, ...)
  acc::search::DryRunResult measured;
  // The largest rank's peak over the measured steps alone, the most of the rounds: what the
  // memory model predicts (measured.peak_bytes also holds the setup, the warm-up step and the
  // teardown: the model cloned whole, then cut or sharded).
  int64_t step_peak = 0;
  // Each round's measured step (round 0 first), in the order the pass ran them: the time each
  // round's dry-run started into the pass is its position (k, or rows - 1 - k in odd rounds).
  std::vector<double> round_step_seconds;
};

}  // namespace

int main(int argc, char** argv) {
  std::string model_type = "gpt", config_file, cache_dir;
  int64_t global_batch = 8, seq = 64;
  int threads = 1, top_k = 3, warmup = 1, steps = 3, rounds = 2, retime_turns = 6,
      retime_others = 2, every = 1;
  bool no_bf16 = false;
  std::vector<std::string> excluded;
  std::string only;
  CLI::App app{"auto_accelerate's choice and models against an exhaustive dry-run"};
  app.add_option("--model", model_type, "gpt | llama")->capture_default_str();
  app.add_option("--config", config_file,
                 "model config JSON (default examples/configs/{gpt,llama}_small.json)");
  app.add_option("--global-batch", global_batch, "samples per step over all ranks")
      ->capture_default_str();
  app.add_option("--seq-len", seq, "tokens per sample")->capture_default_str();
  app.add_option("--threads", threads, "threads per rank")->capture_default_str();
  app.add_option("--top-k", top_k, "candidates the search dry-runs")->capture_default_str();
  app.add_option("--warmup", warmup, "warm-up steps of every dry-run")->capture_default_str();
  app.add_option("--steps", steps, "measured steps of every dry-run")->capture_default_str();
  app.add_option("--rounds", rounds,
                 "exhaustive passes (every other one in reverse order; the median per candidate)")
      ->capture_default_str();
  app.add_option("--retime-turns", retime_turns,
                 "turns per re-timed candidate (each: a warm-up step, then 2 timed steps)")
      ->capture_default_str();
  app.add_option("--retime-others", retime_others,
                 "fastest candidates of the exhaustive pass re-timed beside the chosen one")
      ->capture_default_str();
  app.add_flag("--no-bf16", no_bf16, "leave amp out of the space");
  app.add_option("--only", only,
                 "dry-run only the candidates whose name matches this regular expression (and "
                 "the chosen one) in the exhaustive pass");
  app.add_option(
         "--every", every,
         "dry-run every k-th of the candidates --only leaves (and the chosen one): a sample "
         "of the space measured with more steps in the time of a whole pass")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--exclude", excluded, "methods never tried")->delimiter(',');
  app.add_option("--cache-dir", cache_dir, "machine calibration cache (default: the library's)");
  CLI11_PARSE(app, argc, argv);
  int rc = 0;
  try {
    using namespace acc;
    dist::init(argc, argv);
    set_num_threads(threads);
    auto world = dist::ProcessGroup::world();
    const int W = world->size();
    const bool leader = world->rank() == 0;
    std::regex only_re;
    try {
      only_re = std::regex(only);
    } catch (const std::regex_error& e) {
      throw ValueError("bench_search: --only '" + only + "' is no regular expression: " + e.what());
    }
    const nlohmann::json config = config_for(model_type, config_file);
    manual_seed(1);
    auto model = models::create_model(model_type, config);
    const auto factory = optim::AdamW::factory({.lr = 1e-4, .betas = {0.9, 0.95}});
    const int64_t b = global_batch / W;
    Generator gen = Generator(7).for_rank(world->rank());
    const data::Batch batch{randint(0, model->vocab_size(), {b, seq}, gen),
                            randint(0, model->vocab_size(), {b, seq}, gen)};
    // A candidate's batch: global / its dp samples (its tp and cp ranks read the same ones), the
    // rank's batch repeated.
    auto batch_of = [&batch, b](int64_t n) {
      if (n == b) return batch;
      std::vector<data::Batch::Entry> entries;
      for (const auto& [name, t] : batch.tensors()) {
        entries.emplace_back(name, cat(std::vector<Tensor>(static_cast<size_t>(n / b), t), 0));
      }
      return data::Batch(std::move(entries));
    };

    search::SpaceOptions so;
    so.world = W;
    so.global_batch = global_batch;
    so.seq_len = seq;
    so.allow_bf16 = !no_bf16;
    so.excluded = excluded;
    search::MemoryModel memory(model_type, config, seq);
    const auto candidates = search::enumerate_candidates(so, memory.num_blocks());

    // 1. Warm the machine cache with every micro-batch of the space.
    search::CalibrationOptions co;
    co.threads = threads;
    co.cache_dir = cache_dir;
    nlohmann::json warm;
    {
      // Every layout's ranks' shapes, as the search asks (tensor-parallel shards, the head's
      // stage): the whole model's alone left the sharded ones to the search's own calibration
      // (69 % of a Llama search at 2 ranks on 2026-11-29).
      std::vector<const search::Candidate*> all;
      for (const auto& c : candidates) {
        // A layout the model refuses (tp not dividing the heads) has no ranks to trace.
        if (!memory.layout_refusal(c)) all.push_back(&c);
      }
      const auto shapes = search::CostModel::shapes_to_measure_for(
          trace::ModelRef::registry(model_type, config), all, seq);
      search::MachineCalibration m;
      if (leader) m = search::load_or_calibrate_machine(shapes, co);
      m = search::broadcast_calibration(*world, m);
      bool contention_cached = false;
      (void)search::contention_for_job(*world, m, shapes, co, &contention_cached);
      warm = {{"gemm_from_cache", m.source.gemm_from_cache},
              {"gemm_measured", m.source.gemm_measured},
              {"contention_from_cache", contention_cached},
              {"seconds", m.source.seconds},
              {"file", m.source.cache_file}};
    }
    world->barrier()->wait();

    // 2. The search, on a copy of the model.
    AccelerateOptions ao;
    ao.global_batch = global_batch;
    ao.seq_len = seq;
    ao.sample_batch = batch;
    ao.allow_bf16 = !no_bf16;
    ao.excluded = excluded;
    ao.top_k = top_k;
    ao.warmup_steps = warmup;
    ao.measured_steps = steps;
    ao.verbose = false;
    ao.group = world;
    ao.cache_dir = cache_dir;
    nlohmann::json report;
    double search_s = 0;
    {
      auto copy = models::clone_model(*model);
      world->barrier()->wait();
      Timer t;
      AccelerateResult r = auto_accelerate(copy, factory, ao);
      search_s = t.elapsed_s();
      report = r.report;
    }  // the trainer goes (fsdp gathers the copy back: collective, on every rank)
    const std::string chosen = report.at("chosen_name");

    // 3. Every candidate the search did not reject, dry-run as the search does.
    std::map<std::string, const nlohmann::json*> by_name;
    for (const auto& row : report.at("candidates")) by_name[row.at("name")] = &row;
    std::vector<Row> rows;
    int64_t kept = 0;  // candidates --only keeps, for --every
    for (const auto& c : candidates) {
      // A layout the model cannot run is one row (its layout alone) for all its combinations.
      const auto found = by_name.find(c.describe());
      if (found == by_name.end()) continue;
      const nlohmann::json& row = *found->second;
      if (row.at("status") == "rejected" || row.at("status") == "excluded") continue;
      if (!only.empty() && c.describe() != chosen && !std::regex_search(c.describe(), only_re)) {
        continue;
      }
      if (kept++ % every != 0 && c.describe() != chosen) continue;
      Row r;
      r.candidate = &c;
      r.name = c.describe();
      r.predicted_s = row.at("predicted").at("time").at("step_s");
      r.predicted_peak = row.at("predicted").at("memory").at("peak");
      r.predicted_time = row.at("predicted").at("time");
      rows.push_back(std::move(r));
    }
    // Rounds alternate the order, so that a drift of the machine's load over a pass (other jobs
    // starting or ending) weighs on every candidate alike.
    Timer exhaustive;
    std::vector<std::vector<double>> times(rows.size());
    for (int round = 0; round < rounds; ++round) {
      for (size_t k = 0; k < rows.size(); ++k) {
        Row& r = rows[round % 2 == 0 ? k : rows.size() - 1 - k];
        const auto m =
            search::dry_run(*model, factory, *r.candidate, batch_of(r.candidate->per_rank_batch),
                            world, {.warmup_steps = warmup, .measured_steps = steps});
        const size_t i = static_cast<size_t>(&r - rows.data());
        if (m.status == search::Status::kOk) times[i].push_back(m.step_seconds);
        r.round_step_seconds.push_back(m.step_seconds);
        if (round == 0 || m.status != search::Status::kOk) r.measured = m;
        r.measured.peak_bytes = std::max(r.measured.peak_bytes, m.peak_bytes);
        for (const int64_t p : m.rank_step_peak_bytes) r.step_peak = std::max(r.step_peak, p);
      }
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i].measured.status == search::Status::kOk)
        rows[i].measured.step_seconds = median(times[i]);
    }
    const double exhaustive_s = exhaustive.elapsed_s();
    // The measurement's own repeatability: round 1 against round 0, the ceiling of any
    // prediction's rank correlation with one round of this noise.
    std::vector<double> first_round, second_round;
    for (const auto& t : times) {
      if (t.size() < 2) continue;
      first_round.push_back(t[0]);
      second_round.push_back(t[1]);
    }

    // 4. The chosen one and the fastest others, re-timed side by side.
    std::vector<const Row*> ok;
    for (const auto& r : rows) {
      if (r.measured.status == search::Status::kOk) ok.push_back(&r);
    }
    std::sort(ok.begin(), ok.end(), [](const Row* x, const Row* y) {
      return x->measured.step_seconds < y->measured.step_seconds;
    });
    std::vector<const search::Candidate*> retimed;
    for (const auto& r : rows) {
      if (r.name == chosen) retimed.push_back(r.candidate);
    }
    ACC_CHECK(retimed.size() == 1, "bench_search: chosen '", chosen, "' not found");
    for (const Row* r : ok) {
      if (static_cast<int>(retimed.size()) > retime_others) break;
      if (r->name != chosen) retimed.push_back(r->candidate);
    }
    std::vector<models::LanguageModelPtr> copies;
    std::vector<std::unique_ptr<strategies::Trainer>> trainers;
    for (const auto* c : retimed) {
      copies.push_back(models::clone_model(*model));
      trainers.push_back(
          strategies::apply(copies.back(), factory, c->strategy(), {.group = world}));
    }
    // Turns: each trainer in turn runs a warm-up step (its weights and state back in cache after
    // the others') and two timed steps; every step starts from a barrier.
    std::vector<float> mine;  // [turn][candidate][2] seconds of this rank
    for (int turn = 0; turn < retime_turns; ++turn) {
      for (size_t k = 0; k < trainers.size(); ++k) {
        const data::Batch mine_batch = batch_of(retimed[k]->per_rank_batch);
        for (int s = 0; s < 3; ++s) {
          world->barrier()->wait();
          Timer t;
          trainers[k]->train_step(mine_batch);
          if (s > 0) mine.push_back(static_cast<float>(t.elapsed_s()));
        }
      }
    }
    trainers.clear();
    copies.clear();
    Tensor slowest = from_vector(mine, {static_cast<int64_t>(mine.size())});
    world->allreduce(slowest, dist::ReduceOp::kMax)->wait();
    const std::vector<float> v = slowest.to_vector<float>();
    std::vector<double> retimed_s(retimed.size());
    for (size_t k = 0; k < retimed.size(); ++k) {
      std::vector<double> xs;
      for (size_t i = 2 * k; i + 1 < v.size(); i += 2 * retimed.size()) {
        xs.push_back(v[i]);
        xs.push_back(v[i + 1]);
      }
      retimed_s[k] = median(xs);
    }
    const size_t best = static_cast<size_t>(std::min_element(retimed_s.begin(), retimed_s.end()) -
                                            retimed_s.begin());

    if (leader) {
      std::vector<double> pred, meas, waits, beyond;
      double worst_mem = 0;
      std::string worst_mem_name;
      nlohmann::json list = nlohmann::json::array();
      for (const auto& r : rows) {
        nlohmann::json j = {{"name", r.name},
                            {"predicted_s", r.predicted_s},
                            {"predicted_peak", r.predicted_peak},
                            {"predicted_time", r.predicted_time},
                            {"measured", r.measured.to_json()}};
        j["measured"]["step_peak_bytes"] = r.step_peak;
        j["measured"]["round_step_seconds"] = r.round_step_seconds;
        if (r.measured.status == search::Status::kOk) {
          pred.push_back(r.predicted_s);
          meas.push_back(r.measured.step_seconds);
          waits.push_back(r.predicted_time.value("waits", 0.0));
          beyond.push_back(r.measured.step_seconds - r.predicted_s);
          const double err = static_cast<double>(r.predicted_peak) /
                                 static_cast<double>(std::max<int64_t>(1, r.step_peak)) -
                             1;
          j["memory_error"] = err;
          // The whole run's peak against the prediction: above it when building the model whole
          // and cutting it needs more than a step.
          j["run_peak_over_predicted"] =
              static_cast<double>(r.measured.peak_bytes) /
              static_cast<double>(std::max<int64_t>(1, r.predicted_peak));
          j["time_error"] = r.predicted_s / r.measured.step_seconds - 1;
          if (std::abs(err) > std::abs(worst_mem)) {
            worst_mem = err;
            worst_mem_name = r.name;
          }
        }
        list.push_back(std::move(j));
      }
      std::vector<double> time_ratio;
      for (size_t i = 0; i < pred.size(); ++i) time_ratio.push_back(pred[i] / meas[i]);
      nlohmann::json re = nlohmann::json::array();
      for (size_t k = 0; k < retimed.size(); ++k) {
        re.push_back({{"name", retimed[k]->describe()}, {"median_step_s", retimed_s[k]}});
      }
      // What the measured steps take beyond their prediction, as a line in the collectives and
      // messages each waits for: the slope is what a waited-for collective costs that the
      // calibration's wait (collective_wait in the report) does not price.
      const auto [beyond_fixed, beyond_per_wait] = line_fit(waits, beyond);
      const auto& timing = report.at("timing");
      const double total = timing.at("total_s");
      const double calib = timing.at("calibration_s"), dry = timing.at("dry_run_s");
      nlohmann::json out = {
          {"model", model_type},
          {"world", W},
          {"threads_per_rank", threads},
          {"global_batch", global_batch},
          {"seq_len", seq},
          {"allow_bf16", !no_bf16},
          {"candidates", candidates.size()},
          {"runnable", rows.size()},
          {"chosen", chosen},
          {"best_retimed", retimed[best]->describe()},
          {"regret", retimed_s[best] / retimed_s[0]},
          {"retimed", re},
          {"spearman", spearman(pred, meas)},
          {"spearman_between_rounds",
           first_round.size() >= 2 ? spearman(first_round, second_round) : 0.0},
          {"predicted_over_measured_median", median(time_ratio)},
          {"predicted_over_measured_min",
           time_ratio.empty() ? 0 : *std::min_element(time_ratio.begin(), time_ratio.end())},
          {"predicted_over_measured_max",
           time_ratio.empty() ? 0 : *std::max_element(time_ratio.begin(), time_ratio.end())},
          {"measured_beyond_predicted",
           {{"fixed_s", beyond_fixed}, {"per_wait_s", beyond_per_wait}}},
          {"collective_wait", report.value("collective_wait", nlohmann::json::array())},
          {"worst_memory_error", worst_mem},
          {"worst_memory_error_candidate", worst_mem_name},
          {"cache_warmup", warm},
          {"machine_calibration_from_cache", timing.at("machine_calibration_from_cache")},
          {"search_s", search_s},
          {"search_calibration_s", calib},
          {"search_dry_run_s", dry},
          {"search_share_calibration", calib / total},
          {"search_share_dry_run", dry / total},
          {"chosen_step_s", retimed_s[0]},
          {"search_in_chosen_steps", search_s / retimed_s[0]},
          {"exhaustive_s", exhaustive_s},
          {"rounds", rounds},
          // With --only, every figure above is of the matching candidates (and the chosen one).
          {"only", only},
          {"every", every},
          {"rows", list}};
      std::printf("%s\n", out.dump().c_str());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_search: error: %s\n", e.what());
    rc = 1;
  }
  acc::dist::finalize();
  return rc;
}
