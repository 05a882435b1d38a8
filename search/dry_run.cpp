#include "acc/search/dry_run.hpp"

#include <optional>

#include <algorithm>
#include <atomic>

#include "acc/dist/agreement.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "acc/util/timer.hpp"

namespace acc::search {

nlohmann::json DryRunResult::to_json() const {
  nlohmann::json j = {
      {"status", status_name(status)}, {"step_seconds", step_seconds}, {"peak_bytes", peak_bytes}};
  if (wait_seconds_max > 0) j["wait_seconds"] = {wait_seconds_min, wait_seconds_max};
  if (!error.empty()) j["error"] = error;
  return j;
}

namespace {

// What a candidate trained in place changes, and its undo (see the header).
class Snapshot {
 public:
  explicit Snapshot(nn::Module& model) : model_(model), training_(model.is_training()) {
    NoGradGuard ng;
    for (auto& [name, t] : model.named_parameters()) saved_.push_back({t, t.clone()});
    for (auto& [name, t] : model.named_buffers()) saved_.push_back({t, t.clone()});
    rng_seed_ = default_generator().seed();
    rng_offset_ = default_generator().offset();
  }
  ~Snapshot() {
    NoGradGuard ng;
    for (auto& [live, copy] : saved_) {
      // Storage of its own holding the saved values, whatever the strategy did to the handle.
      TensorImpl* impl = live.impl();
      impl->storage = copy.storage();
      impl->offset = copy.offset();
      impl->strides = copy.strides();
      live.set_grad(Tensor());
    }
    model_.train(training_);
    default_generator().set_state(rng_seed_, rng_offset_);
  }
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;

 private:
  nn::Module& model_;
  bool training_;
  std::vector<std::pair<Tensor, Tensor>> saved_;
  uint64_t rng_seed_ = 0, rng_offset_ = 0;
};

}  // namespace

DryRunResult dry_run(nn::Module& model, const optim::OptimizerFactory& factory,
                     const Candidate& candidate, const data::Batch& batch,
                     const dist::ProcessGroupPtr& group, const DryRunOptions& options) {
  ACC_CHECK(options.warmup_steps >= 0 && options.measured_steps >= 1,
            "dry_run: needs warm-up >= 0 and measured steps >= 1, got ", options.warmup_steps,
            " and ", options.measured_steps);
  ACC_CHECK(options.memory_budget >= 0, "dry_run: memory budget must be >= 0, got ",
            options.memory_budget);
  ACC_CHECK(options.collective_timeout.count() > 0,
            "dry_run: collective timeout must be > 0 ms, got ", options.collective_timeout.count());
  const bool distributed = group && group->size() > 1;
  // A communicator of the candidate's own (see the header). Named apart per candidate so that a
  // timeout's message and the flight recorder say which dry-run it was.
  static std::atomic<int> runs{0};
  dist::ProcessGroupPtr own =
      distributed
          ? group->split(0, group->rank(), group->name() + ".dry_run." + std::to_string(runs++),
                         options.collective_timeout)
          : group;
  DryRunResult r;
  bool timed_out = false;  // a peer's failure seen from here: not this rank's own
  const int64_t base = memory::current_bytes();
  memory::reset_peak();
  std::vector<double> times, waits;
  std::optional<int64_t> setup_peak, measured_peak;
  {
    memory::LimitGuard budget(options.memory_budget > 0 ? base + options.memory_budget : 0);
    try {
      const auto* lm = dynamic_cast<const models::LanguageModel*>(&model);
      std::optional<Snapshot> snapshot;
      nn::ModulePtr target;
      if (lm != nullptr) {
        target = models::clone_model(*lm);
      } else {
        target = model.weak_from_this().lock();
        ACC_CHECK(target != nullptr, "dry_run: the module (", model.type_name(),
                  ") is not owned by a std::shared_ptr (build it with std::make_shared): a "
                  "candidate trains it in place");
        snapshot.emplace(model);
      }
      auto trainer = strategies::apply(target, factory, candidate.strategy(),
                                       {.group = own,
                                        .grad_clip = options.grad_clip,
                                        .loss = options.loss,
                                        .sample_batch = batch});
      // The setup's and the warm-up's peak (the model built whole, then cut or sharded; work
      // some strategies do on their first step) apart from the measured steps'.
      auto setup_done = [&] {
        setup_peak = memory::peak_bytes() - base;
        memory::reset_peak();
      };
      for (int i = 0; i < options.warmup_steps + options.measured_steps; ++i) {
        if (i == options.warmup_steps) setup_done();
        Timer t;
        const double wait0 = dist::wait_seconds();
        r.losses.push_back(trainer->train_step(batch));
        if (i >= options.warmup_steps) {
          times.push_back(t.elapsed_s());
          waits.push_back(dist::wait_seconds() - wait0);
        }
      }
      // The measured steps' peak, before the Trainer goes: its teardown (a pipeline broadcasting
      // the other stages' tensors back, every rank then holding the whole model) is no step's.
      measured_peak = memory::peak_bytes() - base;
      memory::reset_peak();
    } catch (const OutOfMemoryError& e) {
      r.status = Status::kOom;
      r.error = std::string("out of memory: ") + e.what();
    } catch (const TimeoutError& e) {
      r.status = Status::kError;
      r.error = e.what();
      timed_out = true;
    } catch (const Error& e) {
      r.status = Status::kError;
      r.error = e.what();
    } catch (const std::exception& e) {  // the user's loss or model code: fails the candidate too
      r.status = Status::kError;
      r.error = std::string("exception: ") + e.what();
    }
  }
  // A failed run's peak is up to its failure (the teardown included).
  const int64_t teardown_peak = memory::peak_bytes() - base;
  const int64_t step_peak = measured_peak.value_or(teardown_peak);
  r.peak_bytes = std::max({step_peak, setup_peak.value_or(0), teardown_peak});
  if (!times.empty()) {
    std::sort(times.begin(), times.end());
    r.step_seconds = times[times.size() / 2];
    std::sort(waits.begin(), waits.end());
    r.wait_seconds_min = r.wait_seconds_max = waits[waits.size() / 2];
  }
  r.rank_step_peak_bytes = {step_peak};
  if (!distributed) return r;
  // The slowest rank's time and the largest rank's peak, over the parent group (healthy: the
  // candidate's own communicator may hold what the failure left in flight). A failure anywhere
  // fails the candidate everywhere, with the first-hand messages of the ranks that failed.
  const int first_hand = r.status != Status::kOk && !timed_out ? 1 : 0;
  Tensor flags = from_vector(std::vector<int64_t>{r.status == Status::kOk ? 0 : 1, first_hand,
                                                  r.peak_bytes, r.status == Status::kOom},
                             {4});
  // The slowest step, the most and (negated) the least any rank waited.
  Tensor time = from_vector(
      std::vector<float>{static_cast<float>(r.step_seconds), static_cast<float>(r.wait_seconds_max),
                         -static_cast<float>(r.wait_seconds_min)},
      {3});
  std::vector<int64_t> own_peak(static_cast<size_t>(group->size()), 0);
  own_peak[static_cast<size_t>(group->rank())] = step_peak;
  Tensor peaks = from_vector(own_peak, {group->size()});
  auto w1 = group->allreduce(flags, dist::ReduceOp::kMax);
  auto w2 = group->allreduce(time, dist::ReduceOp::kMax);
  auto w3 = group->allreduce(peaks, dist::ReduceOp::kSum);
  w1->wait();
  w2->wait();
  w3->wait();
  const auto v = flags.to_vector<int64_t>();
  r.peak_bytes = v[2];
  r.rank_step_peak_bytes = peaks.to_vector<int64_t>();
  const std::vector<float> times_of_ranks = time.to_vector<float>();
  r.step_seconds = times_of_ranks[0];
  r.wait_seconds_max = times_of_ranks[1];
  r.wait_seconds_min = -times_of_ranks[2];
  if (v[0] == 0) return r;
  // Every rank is past the candidate: what its failure left in flight on the candidate's own
  // communicator (a collective the failed rank never joined) is left there for good.
  own->abandon();
  // Each rank that failed first-hand tells its message (the others only timed out waiting).
  const std::string messages =
      dist::rank_messages(dist::allgather_text(*group, first_hand ? r.error : std::string()));
  r.status = v[3] ? Status::kOom : Status::kError;
  r.error = messages.empty() ? r.error : messages;
  r.step_seconds = r.wait_seconds_min = r.wait_seconds_max = 0;
  r.losses.clear();
  return r;
}

}  // namespace acc::search
