#include "acc/accelerate.hpp"

#include <algorithm>
#include <set>

#include "acc/accelerate/calibration.hpp"
#include "acc/accelerate/cost.hpp"
#include "acc/accelerate/dry_run.hpp"
#include "acc/accelerate/space.hpp"
#include "acc/dist/dist.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/system.hpp"
#include "acc/util/timer.hpp"

namespace acc {
namespace {

using accelerate::Candidate;

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

struct Row {
  const Candidate* candidate;
  accelerate::MemoryPrediction memory;
  accelerate::TimePrediction time;
  std::string status = "ranked";  // "rejected: memory" | "ranked" | "ok" | "oom" | "error" | ...
  std::string reason;
  std::optional<accelerate::DryRunResult> measured;
};

}  // namespace

std::string report_table(const nlohmann::json& report, size_t max_rows) {
  struct Line {
    bool measured;
    double order;
    std::string text;
  };
  std::vector<Line> lines;
  char buf[512];
  size_t rejected = 0;
  for (const auto& row : report.at("candidates")) {
    const auto& pred = row.at("predicted");
    const double mem = static_cast<double>(pred.at("memory").at("peak").get<int64_t>());
    const double t = pred.contains("time") ? pred.at("time").at("step_s").get<double>() : -1;
    if (t < 0) ++rejected;
    char predicted[32] = "-";
    if (t >= 0) std::snprintf(predicted, sizeof(predicted), "%.1f ms", 1e3 * t);
    std::string measured = "-";
    if (row.contains("measured") && row["measured"].at("status") == "ok") {
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
    lines.push_back({row.contains("measured"), t < 0 ? 1e30 : t, buf});
  }
  // Best predicted first; every dry-run row is shown, then the best others up to max_rows.
  std::stable_sort(lines.begin(), lines.end(),
                   [](const Line& a, const Line& b) { return a.order < b.order; });
  std::snprintf(buf, sizeof(buf), "  %-76s %10s %12s  %-22s %s\n", "candidate", "predicted",
                "pred. memory", "measured", "status");
  std::string out = buf;
  size_t shown = 0;
  for (const auto& l : lines) {
    if (l.measured || shown < max_rows) {
      out += l.text + "\n";
      ++shown;
    }
  }
  if (shown < lines.size()) {
    out += "  ... " + std::to_string(lines.size() - shown) + " more (" + std::to_string(rejected) +
           " rejected by memory in all); the report has every row\n";
  }
  return out;
}

AccelerateResult auto_accelerate(models::LanguageModelPtr model, optim::OptimizerFactory factory,
                                 const AccelerateOptions& o) {
  ACC_CHECK(model != nullptr, "auto_accelerate: model is null");
  ACC_CHECK(o.global_batch >= 1, "auto_accelerate: global_batch must be >= 1, got ",
            o.global_batch);
  ACC_CHECK(o.seq_len >= 1 && o.seq_len <= model->max_seq_len(),
            "auto_accelerate: seq_len must be in [1, ", model->max_seq_len(), "], got ", o.seq_len);
  ACC_CHECK(o.mem_per_rank >= 0, "auto_accelerate: mem_per_rank must be >= 0 bytes, got ",
            o.mem_per_rank);
  ACC_CHECK(o.time_budget_s >= 0, "auto_accelerate: time_budget_s must be >= 0, got ",
            o.time_budget_s);
  ACC_CHECK(o.top_k >= 1, "auto_accelerate: top_k must be >= 1, got ", o.top_k);
  ACC_CHECK(o.warmup_steps >= 0 && o.measured_steps >= 1,
            "auto_accelerate: needs warmup_steps >= 0 and measured_steps >= 1, got ",
            o.warmup_steps, " and ", o.measured_steps);
  Timer total;
  dist::ProcessGroupPtr group =
      o.group ? o.group : (dist::is_initialized() ? dist::ProcessGroup::world() : nullptr);
  const int world = group ? group->size() : 1;
  const bool leader = !group || group->rank() == 0;
  const int64_t budget =
      o.mem_per_rank > 0 ? o.mem_per_rank
                         : static_cast<int64_t>(0.9 * static_cast<double>(physical_memory_bytes()) /
                                                std::max(1, dist::local_world_size()));

  // The space and each candidate's memory: rejected ones are never run.
  const std::string type = model->model_type();
  const nlohmann::json config = model->config_json();
  accelerate::MemoryModel memory(type, config, o.seq_len);
  accelerate::SpaceOptions so;
  so.world = world;
  so.global_batch = o.global_batch;
  so.seq_len = o.seq_len;
  so.allow_bf16 = o.allow_bf16;
  so.excluded = o.excluded;
  so.included = o.included;
  const std::vector<Candidate> candidates =
      accelerate::enumerate_candidates(so, memory.num_blocks());
  std::vector<Row> rows;
  int64_t smallest = -1;
  for (const auto& c : candidates) {
    Row r{&c, memory.predict(c), {}, "ranked", "", std::nullopt};
    smallest = smallest < 0 ? r.memory.peak : std::min(smallest, r.memory.peak);
    if (r.memory.peak > budget) {
      r.status = "rejected";
      r.reason = "predicted peak " + trace::human_bytes(static_cast<double>(r.memory.peak)) +
                 " over the budget of " + trace::human_bytes(static_cast<double>(budget));
    }
    rows.push_back(std::move(r));
  }
  const bool any_fits =
      std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.status == "ranked"; });
  ACC_CHECK(any_fits, "auto_accelerate: no candidate fits the memory budget of ",
            trace::human_bytes(static_cast<double>(budget)), " per rank (", budget,
            " bytes); the smallest predicted need is ",
            trace::human_bytes(static_cast<double>(smallest)), " (", smallest, " bytes), over ",
            candidates.size(), " candidates");

  // Calibrate (the machine on rank 0, cached, shared; the collectives on this group) and rank.
  Timer calib;
  std::set<int64_t> micro;
  for (const auto& r : rows) {
    if (r.status == "ranked") micro.insert(r.candidate->micro_batch);
  }
  accelerate::CalibrationOptions co;
  co.cache_dir = o.cache_dir;
  accelerate::MachineCalibration machine;
  if (leader) {
    machine = accelerate::load_or_calibrate_machine(
        accelerate::CostModel::shapes_to_measure(type, config, {micro.begin(), micro.end()},
                                                 o.seq_len),
        co);
  }
  if (group && world > 1) machine = accelerate::broadcast_calibration(*group, machine);
  accelerate::CommCalibration comm;
  comm.world = 1;
  if (group && world > 1) {
    comm = accelerate::calibrate_collectives(*group, accelerate::default_collective_sizes(), 0.02);
  }
  const double calibration_s = calib.elapsed_s();
  accelerate::CostModel cost(type, config, o.seq_len, machine, comm);
  for (auto& r : rows) {
    if (r.status == "ranked") r.time = cost.predict(*r.candidate);
  }
  std::vector<Row*> ranked;
  for (auto& r : rows) {
    if (r.status == "ranked") ranked.push_back(&r);
  }
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const Row* a, const Row* b) { return a->time.step_s < b->time.step_s; });

  // Dry-run the best predicted, in that order, under the budget and the time limit.
  const int64_t per_rank = o.global_batch / world;
  const data::Batch batch =
      o.sample_batch ? *o.sample_batch : random_batch(per_rank, o.seq_len, model->vocab_size());
  ACC_CHECK(batch.idx.size(0) == per_rank, "auto_accelerate: sample_batch has ", batch.idx.size(0),
            " samples, this rank's share of global_batch ", o.global_batch, " over ", world,
            " rank(s) is ", per_rank);
  Timer dry;
  bool out_of_time = false;
  int tried = 0;
  for (Row* r : ranked) {
    if (tried == o.top_k) break;
    if (o.time_budget_s > 0 && dry.elapsed_s() > o.time_budget_s && tried > 0) {
      out_of_time = true;
      break;
    }
    r->measured = accelerate::dry_run(*model, factory, *r->candidate, batch, group,
                                      {.warmup_steps = o.warmup_steps,
                                       .measured_steps = o.measured_steps,
                                       .memory_budget = budget,
                                       .grad_clip = o.grad_clip});
    r->status = r->measured->status;
    r->reason = r->measured->error;
    ++tried;
  }
  const double dry_run_s = dry.elapsed_s();
  const Row* best = nullptr;
  for (const Row* r : ranked) {
    if (r->measured && r->status == "ok" &&
        (!best || r->measured->step_seconds < best->measured->step_seconds)) {
      best = r;
    }
  }
  ACC_CHECK(best != nullptr, "auto_accelerate: every dry-run candidate failed (", tried,
            " tried; the first: ", ranked.empty() ? "" : ranked.front()->reason, ")");
  if (group && world > 1) {
    dist::check_agreement(*group, strategies::to_json(best->candidate->strategy),
                          "auto_accelerate: ranks chose different strategies");
  }

  AccelerateResult result;
  result.model = model;
  result.strategy = best->candidate->strategy;
  nlohmann::json table = nlohmann::json::array();
  for (const auto& r : rows) {
    nlohmann::json row = {{"strategy", strategies::to_json(r.candidate->strategy)},
                          {"name", r.candidate->describe()},
                          {"micro_batch", r.candidate->micro_batch},
                          {"predicted", {{"memory", r.memory.to_json()}}},
                          {"status", r.status}};
    if (r.status != "rejected") row["predicted"]["time"] = r.time.to_json();
    if (r.measured) row["measured"] = r.measured->to_json();
    if (!r.reason.empty()) row["reason"] = r.reason;
    if (&r == best) row["chosen"] = true;
    table.push_back(std::move(row));
  }
  result.report = {{"chosen", strategies::to_json(result.strategy)},
                   {"chosen_name", best->candidate->describe()},
                   {"world", world},
                   {"global_batch", o.global_batch},
                   {"seq_len", o.seq_len},
                   {"budget_bytes", budget},
                   {"dry_runs", tried},
                   {"out_of_time", out_of_time},
                   {"candidates", table},
                   {"timing",
                    {{"calibration_s", calibration_s},
                     {"dry_run_s", dry_run_s},
                     {"total_s", total.elapsed_s()},
                     {"machine_calibration_from_cache", machine.source.gemm_measured == 0}}}};
  if (leader && o.verbose) {
    logging::info(
        "auto_accelerate: {} candidates, {} rejected by memory, {} dry-run{}; chose {} "
        "({:.1f} ms/step measured, {:.1f} predicted)",
        rows.size(),
        std::count_if(rows.begin(), rows.end(),
                      [](const Row& r) { return r.status == "rejected"; }),
        tried, out_of_time ? " (time budget ran out)" : "", best->candidate->describe(),
        1e3 * best->measured->step_seconds, 1e3 * best->time.step_s);
  }
  result.trainer =
      strategies::apply(model, std::move(factory), result.strategy,
                        {.group = group, .grad_clip = o.grad_clip, .agreement = o.agreement});
  return result;
}

}  // namespace acc
