// TrainingSession: the training loop's step with everything around it (include/acc/session.hpp).

#include <algorithm>
#include <cmath>
#include <exception>

#include "acc/checkpoint/layout.hpp"
#include "acc/checkpoint/trainer_state.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/nn/module.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/progress.hpp"
#include "acc/util/timer.hpp"
#include "session_state.hpp"

namespace acc {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The hang detector watches every group the strategy communicates over (the world it was started
// with already).
void watch_groups(elastic::Agent& agent, const dist::ProcessGroupPtr& world,
                  const strategies::Trainer& trainer) {
  const auto& ctx = trainer.context();
  if (!ctx) return;
  std::vector<dist::ProcessGroup*> watched = {world.get()};
  auto watch = [&](const dist::ProcessGroupPtr& g) {
    if (g->size() > 1 && std::find(watched.begin(), watched.end(), g.get()) == watched.end()) {
      watched.push_back(g.get());
      agent.watch(g);
    }
  };
  for (dist::MeshDim d : dist::kMeshDims) watch(ctx->group(d));
  watch(ctx->dp_cp_group());
  for (const auto& g : trainer.method_groups()) watch(g);
}

// Samples (or tokens) per second of a step of `ms` milliseconds.
double throughput(const TrainingSession::State& s, double ms) {
  const double per_step = static_cast<double>(s.acc->data.global_batch) *
                          static_cast<double>(std::max<int64_t>(1, s.o->tokens_per_sample));
  return ms > 0 ? per_step / (ms / 1000.0) : 0.0;
}

// Saves the state after `step` steps: the trainer's, with the model's identity, the loader's
// position and every rank's generator in the checkpoint's extra. Collective over the world.
void save(TrainingSession::State& s, int64_t step) {
  const SessionOptions& o = *s.o;
  dist::ProcessGroup& world = *s.prepared->world;
  const Generator& g = default_generator();
  const nlohmann::json mine = {{"rng", {g.seed(), g.offset()}}, {"loader", s.loader->state()}};
  nlohmann::json rng = nlohmann::json::array(), loaders = nlohmann::json::array();
  for (const std::string& text : dist::allgather_text(world, mine.dump())) {
    const nlohmann::json rank = nlohmann::json::parse(text);
    rng.push_back(rank.at("rng"));
    loaders.push_back(rank.at("loader"));
  }
  nlohmann::json extra = session_detail::model_extra(*s.model);
  extra["loader"] = loaders.at(0);
  extra["rng"] = std::move(rng);
  // A loader whose position differs by rank (a user's, reading a stream of its own per rank) is
  // saved whole; BatchLoader's is the same on every rank (the step), and saved once.
  if (std::any_of(loaders.begin(), loaders.end(),
                  [&](const nlohmann::json& l) { return l != loaders.at(0); })) {
    extra["loader_ranks"] = std::move(loaders);
  }
  s.saved_step = step;
  if (s.saver) {
    s.saver->save(step, *s.trainer, s.acc->model_hash, std::move(extra));
  } else {
    const std::string dir =
        ckpt::save_trainer(o.ckpt_dir, step, *s.trainer, s.acc->model_hash, std::move(extra),
                           {.keep_last = o.keep ? *o.keep : 0});
    if (s.leader) logging::info("saved checkpoint {}", dir);
  }
}

void log_committed(const TrainingSession::State& s, const std::optional<std::string>& dir) {
  if (dir && s.leader) logging::info("saved checkpoint {}", *dir);
}

// What the session needs of the AccelerateResult, checked before anything is prepared or written.
SessionOptions check_accelerated(const AccelerateResult& acc, SessionOptions options) {
  ACC_CHECK(acc.trainer != nullptr,
            "TrainingSession: the AccelerateResult has no trainer (moved out or reset?)");
  ACC_CHECK(
      !acc.model_hash.empty() || (options.ckpt_dir.empty() && options.resume == Resume::kNone),
      "TrainingSession: AccelerateResult::model_hash is empty, and checkpoints name their "
      "model by it: give it (auto_accelerate does) or no ",
      options.names.ckpt_dir, " and ", options.names.resume);
  return options;
}

}  // namespace

TrainingSession::TrainingSession(AccelerateResult& acc, data::Loader& loader,
                                 SessionOptions options)
    : TrainingSession(acc, loader, prepare(check_accelerated(acc, std::move(options)))) {}

TrainingSession::TrainingSession(AccelerateResult& acc, data::Loader& loader, Prepared prepared)
    : s_(std::make_unique<State>()) {
  State& s = *s_;
  ACC_CHECK(prepared.s_ != nullptr, "TrainingSession: the Prepared was used already");
  s.prepared = std::move(prepared.s_);
  s.o = &s.prepared->options;
  const SessionOptions& o = *s.o;
  const dist::ProcessGroupPtr& world = s.prepared->world;
  check_accelerated(acc, o);
  s.acc = &acc;
  s.loader = &loader;
  s.trainer = acc.trainer.get();
  s.model = acc.model ? acc.model : s.trainer->model_ptr();
  s.leader = world->rank() == 0;
  watch_groups(*s.prepared->agent, world, *s.trainer);

  // Sharded checkpoints (checkpoint/README.md): any strategy and world size saves, and a run on
  // any other loads it. The model is named by its hash; the run's own state (data position, every
  // rank's RNG, the model's type and config) goes into the checkpoint's extra.
  if (o.resume != Resume::kNone) {
    if (const auto r =
            session_detail::resume(o, world, *s.trainer, *s.model, acc.model_hash, loader)) {
      s.first_step = r->step;
      s.resumed_from = r->dir;
      // A step of this root needs no saving again at finish() when no step ran.
      if (!o.ckpt_dir.empty() && ckpt::path_within(r->dir, o.ckpt_dir)) s.saved_step = r->step;
    }
  }
  s.next_step = s.first_step;
  // start_over: the root's old steps go once everything before training has worked (a bad option
  // or checkpoint loses nothing); rank 0 holds the lock, every rank learns the outcome.
  if (o.start_over) {
    try {
      session_detail::on_rank0(*world, [&] {
        const std::vector<std::string> removed = ckpt::remove_committed_steps(o.ckpt_dir);
        if (!removed.empty()) {
          logging::info("{}: deleted {} committed step(s) of '{}' ({} to {})", o.names.start_over,
                        removed.size(), o.ckpt_dir, removed.front(), removed.back());
        }
      });
    } catch (const Error& e) {
      ACC_THROW(IoError, o.names.start_over, ": ", e.what());
    }
  }
  // Saves are written in the background by default (the state snapshotted at the step boundary,
  // committed at a later boundary once every rank has written); sync_save waits for each.
  if (!o.ckpt_dir.empty() && !o.sync_save) {
    s.saver = std::make_unique<ckpt::AsyncSaver>(
        o.ckpt_dir, ckpt::SaveOptions{.keep_last = o.keep ? *o.keep : 0});
  }
  // The step log: every step of every attempt. A fresh run starts it anew; a resumed run or a
  // restarted attempt appends (a restart that found no checkpoint yet redoes steps the file holds
  // already: they appear again, with the higher attempt number).
  if (!o.log_json.empty()) {
    const bool append = s.resumed_from.has_value() || s.prepared->attempt > 0;
    session_detail::on_rank0(*world, [&] { s.log.emplace(o.log_json, append, o.names.log_json); });
  }
  memory::reset_peak();
}

TrainingSession::~TrainingSession() {
  if (!s_ || s_->finished) return;
  if (std::uncaught_exceptions() > 0) return;  // no collective while unwinding
  try {
    finish();
  } catch (const std::exception& e) {
    logging::error("TrainingSession: finishing failed: {}", e.what());
  }
}

namespace {

// The trainer the session was made with is still the AccelerateResult's (dropping it hands the
// model back: the program is done training).
void check_trainer(const TrainingSession::State& s, const char* what) {
  ACC_CHECK(s.acc->trainer.get() == s.trainer, "TrainingSession::", what,
            ": the AccelerateResult's trainer was reset or replaced after the session began "
            "(call finish() before dropping it)");
}

}  // namespace

StepResult TrainingSession::step() {
  State& s = *s_;
  const SessionOptions& o = *s.o;
  ACC_CHECK(!s.finished, "TrainingSession::step: the session is finished (after step ", s.next_step,
            ")");
  check_trainer(s, "step");
  const int64_t step = s.next_step;
  progress::step(step);
  data::Batch batch = s.loader->next();
  optim::Optimizer& opt = s.trainer->optimizer();
  Timer timer;
  const double lr = o.lr_schedule ? o.lr_schedule->apply(opt, step) : opt.lr();
  const double loss = s.trainer->train_step(batch);
  const double ms = timer.elapsed_ms();
  if (!std::isfinite(loss)) {
    // Say where it came from: the weights were finite when loaded (checked there).
    const std::string bad = nn::describe_non_finite(s.model->named_parameters());
    const std::string remedy = "lower " + o.names.lr + " or set " + o.names.grad_clip;
    ACC_THROW(ValueError, "loss became ", loss, " at step ", step, "; ",
              !bad.empty() ? "the updates made the parameters non-finite (" + bad + "): " + remedy
              : step == s.first_step
                  ? std::string("every parameter is finite, so the forward pass overflowed on "
                                "this batch (weights or activations too large)")
                  : "every parameter is finite, so the forward pass overflowed: " + remedy);
  }
  if (step == s.first_step) {
    s.first_loss = loss;
  } else {
    s.step_ms.push_back(ms);  // the first step warms caches up
  }
  s.last_loss = loss;
  const StepResult r = {.step = step,
                        .loss = loss,
                        .grad_norm = s.trainer->last_grad_norm(),
                        .lr = lr,
                        .step_ms = ms};
  const double rate = throughput(s, ms);
  const bool tokens = o.tokens_per_sample > 0;
  if (s.log) {
    // Rank 0 alone writes: a failure here (a full disk) must not stop rank 0 while the others go
    // on into the next step's collectives, so it is logged and the step log is closed.
    try {
      s.log->write({{"attempt", s.prepared->attempt},
                    {"step", step},
                    {"loss", loss},
                    {"grad_norm", r.grad_norm},
                    {"lr", lr},
                    {"step_ms", ms},
                    {tokens ? "tokens_per_s" : "samples_per_s", rate}});
    } catch (const std::exception& e) {
      logging::error("step log: {}; no more lines are written to it", e.what());
      s.log.reset();
    }
  }
  if (s.leader && o.log_every > 0 && (step % o.log_every == 0 || step + 1 == o.steps)) {
    std::string of;  // "/steps" when known
    if (o.steps > 0) of.append("/").append(std::to_string(o.steps));
    logging::info("step {:5d}{} | loss {:.4f} | lr {:.2e} | {:7.1f} ms | {:8.0f} {}", step, of,
                  loss, lr, ms, rate, tokens ? "tok/s" : "samples/s");
  }
  s.prepared->agent->report_stragglers();
  if (s.saver) log_committed(s, s.saver->poll());
  s.next_step = step + 1;
  if (o.save_every > 0 && s.next_step % o.save_every == 0) save(s, s.next_step);
  return r;
}

void TrainingSession::finish() {
  State& s = *s_;
  if (s.finished) return;
  s.finished = true;  // a failure below is not retried by the destructor
  check_trainer(s, "finish");
  const SessionOptions& o = *s.o;
  if (!o.ckpt_dir.empty() && s.saved_step != s.next_step) save(s, s.next_step);
  if (s.saver) log_committed(s, s.saver->finish());
  if (s.leader && s.next_step > s.first_step) {
    const double med = median(s.step_ms);
    logging::info(
        "done: loss {:.4f} -> {:.4f}, median step {:.1f} ms, {:.0f} {}, peak memory {:.1f} MB "
        "per rank",
        s.first_loss, s.last_loss, med, throughput(s, med),
        o.tokens_per_sample > 0 ? "tokens/s" : "samples/s", memory::peak_bytes() / 1e6);
  }
}

int64_t TrainingSession::first_step() const {
  return s_->first_step;
}
int64_t TrainingSession::next_step() const {
  return s_->next_step;
}
const std::optional<std::string>& TrainingSession::resumed_from() const {
  return s_->resumed_from;
}
int TrainingSession::attempt() const {
  return s_->prepared->attempt;
}
strategies::Trainer& TrainingSession::trainer() {
  return *s_->trainer;
}
data::Loader& TrainingSession::loader() {
  return *s_->loader;
}
elastic::Agent& TrainingSession::agent() {
  return *s_->prepared->agent;
}
const SessionOptions& TrainingSession::options() const {
  return *s_->o;
}

}  // namespace acc
