#pragma once
// TrainingSession: what every training program needs around auto_accelerate's train_step, as a
// library. It owns
//   - resume: from the newest loadable step of a checkpoint root (falling back past a damaged
//     one) or from a step directory, the model (its hash, and a language model's type and config,
//     or another module's type) checked first, the state resharded into this run's layout;
//   - checkpoints every N steps and at finish(), written in the background (or synchronously),
//     the newest K kept, with every rank's RNG and the loader's position beside the training
//     state, so a resumed run continues bitwise as if it had never stopped;
//   - the hang detector's agent (elastic/README.md): progress marks for acc-run, the straggler
//     report every step, ACC_FAULT's fault injection;
//   - a JSON step log that a restarted attempt appends to, each line naming its attempt.
//
//   acc::AccelerateResult acc = acc::auto_accelerate(model, optim, opts);
//   acc::data::BatchLoader loader(tokens, {...});
//   acc::TrainingSession run(acc, loader, {.ckpt_dir = "ck", .save_every = 100, .keep = 3,
//                                          .resume = acc::Resume::kAuto, .log_json = "log.jsonl"});
//   for (int64_t step = run.first_step(); step < steps; ++step) run.step();
//   run.finish();   // the last save committed (the destructor does it too, logging errors)
//
// A program under acc-run (elastic/README.md) with .resume = kAuto recovers from a lost rank or
// node exactly: the next attempt loads the newest committed step into whatever layout it now has.
//
// A strategy cache made for another world size is re-planned by auto_accelerate
// (AccelerateOptions::load_strategy), before the session starts.
//
// Collective: every rank of the world constructs the session with the same options, and calls
// step(), finish() (and the destructor) in the same order.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "acc/accelerate.hpp"
#include "acc/data/loader.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/elastic/agent.hpp"
#include "acc/optim/lr_scheduler.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc {

/// Where a session's state comes from.
///   kNone  a fresh run from step 0
///   kAuto  the newest loadable step of SessionOptions::ckpt_dir; none yet: step 0 (acc-run's
///          restarts: the same command starts and continues the job)
///   kPath  SessionOptions::resume_path: a step directory, or a root (its newest step; when that
///          one does not load, refused naming the older step that does)
enum class Resume { kNone, kAuto, kPath };

/// "none", "auto", "path".
const char* resume_name(Resume r);

/// How messages name the session's options. A command line over the session gives its flags
/// ({.ckpt_dir = "--ckpt-dir", ...}, as train_gpt does), so that an error names what its user
/// typed; the defaults are the fields' own names.
struct OptionNames {
  std::string ckpt_dir = "ckpt_dir";
  std::string save_every = "save_every";
  std::string keep = "keep";
  std::string start_over = "start_over";
  std::string resume = "resume";  // "resume auto", "resume 'DIR'"
  std::string log_json = "log_json";
  std::string steps = "steps";
  std::string lr = "the learning rate";  // "lower the learning rate or set gradient clipping"
  std::string grad_clip = "gradient clipping";  // (a loss that became non-finite)

  /// The flags of train_gpt's command line (--ckpt-dir, --save-every, --keep, --ckpt-start-over,
  /// --resume, --log-json, --steps, --lr, --grad-clip), which examples/custom_model.cpp shares.
  static OptionNames command_line() {
    return {.ckpt_dir = "--ckpt-dir",
            .save_every = "--save-every",
            .keep = "--keep",
            .start_over = "--ckpt-start-over",
            .resume = "--resume",
            .log_json = "--log-json",
            .steps = "--steps",
            .lr = "--lr",
            .grad_clip = "--grad-clip"};
  }
};

// Every field has a default (designated initializers name only what they change, -Wextra quiet).
struct SessionOptions {
  /// Checkpoint root ("": no checkpoints). One job writes a root at a time: rank 0 holds
  /// ROOT/.lock from prepare() to the session's end. A root holding committed steps is refused
  /// unless the run resumes from it (kAuto, or a kPath inside it) or start_over is set: the
  /// steps of two runs would interleave.
  std::string ckpt_dir{};
  /// Also save every this many steps (after step s with (s + 1) % save_every == 0; 0: only at
  /// finish()). Needs ckpt_dir.
  int64_t save_every = 0;
  /// Committed steps kept in ckpt_dir, the newest (>= 1); std::nullopt keeps every one.
  std::optional<int> keep = 3;
  /// Wait for each save (default: the state is snapshotted at the step boundary and written in
  /// the background while training goes on, committed at a later step).
  bool sync_save = false;
  /// Delete ckpt_dir's committed steps (another run's) before the first step, and start over.
  /// Refused with kAuto or a kPath inside ckpt_dir, which would continue them.
  bool start_over = false;
  Resume resume = Resume::kNone;
  std::string resume_path{};  // with kPath only
  /// One JSON line per step, written by rank 0 ("": none): {"attempt", "step", "loss",
  /// "grad_norm", "lr", "step_ms", "tokens_per_s" (or "samples_per_s")}. A fresh run (attempt 0,
  /// nothing resumed) starts the file anew; a resumed run or a restarted attempt (acc-run's
  /// ACC_RUN_ATTEMPT > 0) appends, so the file holds every step of every attempt: steps redone
  /// after a resume appear again, with the higher attempt number.
  std::string log_json{};
  /// Rank 0 logs a console line every this many steps, and the last step's (0: never).
  int64_t log_every = 10;
  /// The run's total steps when known (0: unknown): a resume at or past it is refused ("nothing
  /// left to train"), and console lines show it.
  int64_t steps = 0;
  /// Sets the optimizer's learning rate before each step (none: the optimizer's own).
  std::shared_ptr<const optim::LRScheduler> lr_schedule{};
  /// Tokens per sample (a language model's sequence length), for tokens/s in the logs; 0: the
  /// logs give samples/s. The samples of a step are AccelerateResult::data.global_batch.
  int64_t tokens_per_sample = 0;
  /// The world the session saves, resumes and watches over (default: dist::ProcessGroup::world()).
  dist::ProcessGroupPtr world{};
  /// The hang detector's options (elastic/agent.hpp; defaults from the environment).
  elastic::AgentOptions agent{};
  OptionNames names{};
};

/// What one step did.
struct StepResult {
  int64_t step = 0;      // the step's number (0-based)
  double loss = 0;       // Trainer::train_step's: the global batch's mean loss
  double grad_norm = 0;  // global gradient norm before clipping
  double lr = 0;
  double step_ms = 0;  // the train_step alone (not the loader, the log or a save)
};

class TrainingSession {
 public:
  /// The part of a session that needs no model: the options checked, ckpt_dir's lock taken (rank
  /// 0), its committed steps judged (another run's are refused), and the hang detector started.
  /// A program whose model or search costs time calls TrainingSession::prepare first, so that bad
  /// options cost nothing and the agent watches the search's dry-runs too; the constructor that
  /// takes options prepares itself.
  class Prepared {
   public:
    Prepared(Prepared&&) noexcept;
    Prepared& operator=(Prepared&&) noexcept;
    ~Prepared();
    const SessionOptions& options() const;
    elastic::Agent& agent();
    struct State;

   private:
    friend class TrainingSession;
    explicit Prepared(std::unique_ptr<State> s);
    std::unique_ptr<State> s_;
  };

  /// Collective over options.world. Throws acc::ValueError naming the option and its value for
  /// bad options (save_every < 0, keep < 1, log_every < 0, steps < 0, tokens_per_sample < 0,
  /// save_every, start_over or kAuto without ckpt_dir, kPath without resume_path or resume_path
  /// without kPath, start_over with a resume that continues ckpt_dir) and for a ckpt_dir that
  /// holds another run's committed steps; acc::IoError for output paths that cannot be written
  /// (ckpt_dir a file or in a missing directory, log_json's directory missing or not writable), a
  /// resume_path that is no directory, and ckpt_dir's lock held by another job (naming it);
  /// what elastic::Agent::start throws (a bad ACC_FAULT, ...), and acc::ValueError for an
  /// ACC_RUN_ATTEMPT that is not a non-negative integer. Every rank throws alike, and nothing is
  /// written: no file or directory is made before every option is found good.
  static Prepared prepare(SessionOptions options);

  /// Resumes (SessionOptions::resume) into acc's trainer, the loader and every rank's default
  /// generator, deletes ckpt_dir's old steps with start_over, and opens the step log. `acc` and
  /// `loader` must outlive the session, and acc.trainer must stay until finish() (step() and
  /// finish() name a trainer reset or replaced before). Collective over the world. Throws what
  /// prepare() throws; acc::ValueError when acc has no trainer, when acc.model_hash is empty and
  /// there is a checkpoint to read or write, and for a checkpoint of another model (its model type,
  /// config field by field, module type or hash named), a resume at or past options.steps, or a
  /// loader state that does not fit the loader (naming the checkpoint's metadata file);
  /// acc::IoError when no committed step loads (naming each step tried and why) or a kPath root's
  /// newest step does not (naming the older one that does), and when the step log cannot be opened.
  /// On any error nothing is written (start_over deletes, and the log is opened, last).
  TrainingSession(AccelerateResult& acc, data::Loader& loader, SessionOptions options);
  TrainingSession(AccelerateResult& acc, data::Loader& loader, Prepared prepared);
  /// finish(), unless it ran or an exception is unwinding (then a pending background save is left
  /// uncommitted; the next save removes its files); errors are logged, not thrown.
  ~TrainingSession();
  TrainingSession(const TrainingSession&) = delete;
  TrainingSession& operator=(const TrainingSession&) = delete;

  /// The step training starts at: 0, or the resumed checkpoint's step.
  int64_t first_step() const;
  /// The step step() runs next.
  int64_t next_step() const;
  /// The step directory resumed from, if any.
  const std::optional<std::string>& resumed_from() const;
  /// This job's attempt under acc-run (ACC_RUN_ATTEMPT), 0 outside it.
  int attempt() const;

  /// One optimizer step: the loader's next batch, the learning rate, Trainer::train_step, the
  /// progress mark and straggler report, the log line, and a save when save_every says so.
  /// Collective. Throws acc::ValueError when the loss is not finite (naming the step, and the
  /// parameters that became non-finite if any), what the loader, train_step and the save throw,
  /// and acc::ValueError after finish(). A step log line that cannot be written (rank 0 alone
  /// writes) is logged as an error and the log closed: throwing on rank 0 only would leave the
  /// other ranks waiting in the next step's collectives.
  StepResult step();
  /// Saves the state after the steps run so far (unless that step is saved already), waits for
  /// the background save and logs a summary (rank 0: first and last loss, median step time,
  /// throughput, peak memory). Collective; once only (later calls do nothing). Throws what the
  /// save throws.
  void finish();

  strategies::Trainer& trainer();
  data::Loader& loader();
  elastic::Agent& agent();
  const SessionOptions& options() const;

  struct State;

 private:
  std::unique_ptr<State> s_;
};

}  // namespace acc
