#include "acc/accelerate/dry_run.hpp"

#include <algorithm>

#include "acc/tensor/allocator.hpp"
#include "acc/util/error.hpp"
#include "acc/util/timer.hpp"

namespace acc::accelerate {

nlohmann::json DryRunResult::to_json() const {
  nlohmann::json j = {
      {"status", status}, {"step_seconds", step_seconds}, {"peak_bytes", peak_bytes}};
  if (!error.empty()) j["error"] = error;
  return j;
}

DryRunResult dry_run(const models::LanguageModel& model, const optim::OptimizerFactory& factory,
                     const Candidate& candidate, const data::Batch& batch,
                     const dist::ProcessGroupPtr& group, const DryRunOptions& options) {
  ACC_CHECK(options.warmup_steps >= 0 && options.measured_steps >= 1,
            "dry_run: needs warm-up >= 0 and measured steps >= 1, got ", options.warmup_steps,
            " and ", options.measured_steps);
  ACC_CHECK(options.memory_budget >= 0, "dry_run: memory budget must be >= 0, got ",
            options.memory_budget);
  DryRunResult r;
  const int64_t base = memory::current_bytes();
  memory::reset_peak();
  std::vector<double> times;
  {
    memory::LimitGuard budget(options.memory_budget > 0 ? base + options.memory_budget : 0);
    try {
      auto copy = models::clone_model(model);
      auto trainer = strategies::apply(copy, factory, candidate.strategy,
                                       {.group = group, .grad_clip = options.grad_clip});
      for (int i = 0; i < options.warmup_steps + options.measured_steps; ++i) {
        Timer t;
        r.losses.push_back(trainer->train_step(batch));
        if (i >= options.warmup_steps) times.push_back(t.elapsed_s());
      }
    } catch (const OutOfMemoryError& e) {
      r.status = "oom";
      r.error = e.what();
    } catch (const Error& e) {
      r.status = "error";
      r.error = e.what();
    }
  }
  r.peak_bytes = memory::peak_bytes() - base;
  if (!times.empty()) {
    std::sort(times.begin(), times.end());
    r.step_seconds = times[times.size() / 2];
  }
  // The slowest rank's time and the largest rank's peak; a failure anywhere fails the candidate
  // everywhere. (A rank that fails mid-step leaves its peers waiting in a collective until its
  // timeout: failing fast there is still to do.)
  if (group && group->size() > 1) {
    Tensor flags = from_vector(std::vector<int64_t>{r.status == "ok" ? 0 : 1, r.peak_bytes}, {2});
    Tensor time = from_vector(std::vector<float>{static_cast<float>(r.step_seconds)}, {1});
    auto w1 = group->allreduce(flags, dist::ReduceOp::kMax);
    auto w2 = group->allreduce(time, dist::ReduceOp::kMax);
    w1->wait();
    w2->wait();
    const auto v = flags.to_vector<int64_t>();
    if (v[0] > 0 && r.status == "ok") {
      r.status = "error";
      r.error = "failed on another rank";
    }
    r.peak_bytes = v[1];
    r.step_seconds = time.to_vector<float>()[0];
  }
  return r;
}

}  // namespace acc::accelerate
