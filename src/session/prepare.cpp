// TrainingSession::prepare: the options checked, the checkpoint root's lock and the hang
// detector's agent, before the program builds its model.

#include <filesystem>
#include <system_error>

#include "acc/checkpoint/layout.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/elastic/launcher.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "session_state.hpp"

namespace acc {

namespace fs = std::filesystem;

const char* resume_name(Resume r) {
  switch (r) {
    case Resume::kNone:
      return "none";
    case Resume::kAuto:
      return "auto";
    case Resume::kPath:
      return "path";
  }
  return "?";
}

namespace session_detail {

std::string describe_resume(const SessionOptions& o) {
  return o.names.resume + (o.resume == Resume::kAuto ? " auto" : " '" + o.resume_path + "'");
}

void on_rank0(dist::ProcessGroup& world, const std::function<void()>& fn) {
  // "v" + message: a ValueError, "i" + message: any other error (an IoError on every rank).
  std::string refused;
  if (world.rank() == 0) {
    try {
      fn();
    } catch (const ValueError& e) {
      refused = std::string("v") + e.what();
    } catch (const std::exception& e) {
      refused = std::string("i") + e.what();
    }
  }
  refused = dist::broadcast_text(world, refused, 0);
  if (refused.empty()) return;
  if (refused[0] == 'v') throw ValueError(refused.substr(1));
  throw IoError(refused.substr(1));
}

}  // namespace session_detail

namespace {

// What a run may find in its ckpt_dir: nothing committed, or the steps it continues. A job that
// does not continue the run there must not write there: its steps would interleave with the other
// run's (a step of the same number replacing the other's), and a later resume would continue
// whichever step is newest. Rank 0, holding the root's lock.
void check_ckpt_dir_is_this_runs(const SessionOptions& o, bool resumes_here) {
  if (o.start_over) return;  // its steps go before training (TrainingSession's constructor)
  const std::vector<std::string> steps = ckpt::committed_steps(o.ckpt_dir);
  if (steps.empty() || resumes_here) return;
  const OptionNames& n = o.names;
  ACC_THROW(ValueError, n.ckpt_dir, " '", o.ckpt_dir, "' holds ", steps.size(),
            " committed step(s) of another run (the newest: ",
            fs::path(steps.back()).filename().string(), ")",
            o.resume == Resume::kPath
                ? ", and " + n.resume + " '" + o.resume_path + "' is not one of them"
                : std::string(),
            ": this run's steps would interleave with them. Continue that run with ", n.resume,
            " auto, or give ", n.start_over, " to delete its steps and start over");
}

// The options alone (no file looked at but resume_path's): the same on every rank.
void check_options(const SessionOptions& o) {
  const OptionNames& n = o.names;
  ACC_CHECK(o.save_every >= 0, n.save_every, " must be >= 0 (0: save at the end only), got ",
            o.save_every);
  ACC_CHECK(!o.keep || *o.keep >= 1, n.keep,
            " must be >= 1 (the newest steps kept; std::nullopt keeps every one), got ", *o.keep);
  ACC_CHECK(o.log_every >= 0, "log_every must be >= 0 (0: no console lines), got ", o.log_every);
  ACC_CHECK(o.steps >= 0, n.steps, " must be >= 0 (0: unknown), got ", o.steps);
  ACC_CHECK(o.tokens_per_sample >= 0,
            "tokens_per_sample must be >= 0 (0: the logs give samples/s), got ",
            o.tokens_per_sample);
  ACC_CHECK(o.save_every == 0 || !o.ckpt_dir.empty(), n.save_every, " needs ", n.ckpt_dir);
  ACC_CHECK(!o.start_over || !o.ckpt_dir.empty(), n.start_over, " needs ", n.ckpt_dir);
  ACC_CHECK(o.resume != Resume::kAuto || !o.ckpt_dir.empty(), n.resume, " auto resumes from ",
            n.ckpt_dir, ": give ", n.ckpt_dir);
  ACC_CHECK(o.resume != Resume::kPath || !o.resume_path.empty(),
            "resume is Resume::kPath but resume_path is empty: give the step directory or "
            "checkpoint root to resume from");
  ACC_CHECK(o.resume == Resume::kPath || o.resume_path.empty(), "resume_path '", o.resume_path,
            "' is given but resume is Resume::k", o.resume == Resume::kAuto ? "Auto" : "None",
            ": set resume = Resume::kPath to resume from it");
}

}  // namespace

TrainingSession::Prepared TrainingSession::prepare(SessionOptions options) {
  auto s = std::make_unique<Prepared::State>();
  s->world = options.world ? options.world : dist::ProcessGroup::world();
  s->options = std::move(options);
  const SessionOptions& o = s->options;
  const OptionNames& n = o.names;
  check_options(o);
  s->attempt = elastic::run_attempt();
  if (o.resume == Resume::kPath) {
    std::error_code ec;
    ACC_CHECK_AS(IoError, fs::is_directory(o.resume_path, ec), n.resume, " '", o.resume_path,
                 "' is not a checkpoint directory (a ", n.ckpt_dir,
                 " or one of its step-N directories)");
  }
  const bool resumes_here =
      o.resume == Resume::kAuto || (o.resume == Resume::kPath && !o.ckpt_dir.empty() &&
                                    ckpt::path_within(o.resume_path, o.ckpt_dir));
  ACC_CHECK(!o.start_over || !resumes_here, n.start_over, " deletes the committed steps of ",
            n.ckpt_dir, " '", o.ckpt_dir, "', which ", session_detail::describe_resume(o),
            " would continue: give one or the other");

  // Output paths before any work, so a typo costs nothing; then one writing job per checkpoint
  // root (checkpoint/README.md): rank 0 takes ROOT/.lock for the job's life, and every rank learns
  // the outcome, so that a refused job stops on every rank before its first step, naming the job
  // that holds the root.
  session_detail::on_rank0(*s->world, [&] {
    if (!o.ckpt_dir.empty()) {
      std::error_code ec;
      ACC_CHECK_AS(IoError, !fs::exists(o.ckpt_dir, ec) || fs::is_directory(o.ckpt_dir, ec),
                   n.ckpt_dir, " '", o.ckpt_dir, "' is a file, not a directory");
      const fs::path parent = fs::absolute(o.ckpt_dir).parent_path();
      ACC_CHECK_AS(IoError, fs::is_directory(parent, ec), n.ckpt_dir, " '", o.ckpt_dir,
                   "': directory '", parent.string(), "' does not exist");
    }
    if (!o.log_json.empty()) check_output_path(o.log_json, n.log_json);
    if (!o.ckpt_dir.empty()) {
      s->lock = ckpt::RootLock::acquire(o.ckpt_dir);
      try {
        check_ckpt_dir_is_this_runs(o, resumes_here);
      } catch (...) {
        s->lock.reset();
        throw;
      }
    }
  });
  // The hang detector and ACC_FAULT's fault injection (elastic/README.md).
  s->agent = elastic::Agent::start(s->world, o.agent);
  return Prepared(std::move(s));
}

TrainingSession::Prepared::Prepared(std::unique_ptr<State> s) : s_(std::move(s)) {}
TrainingSession::Prepared::Prepared(Prepared&&) noexcept = default;
TrainingSession::Prepared& TrainingSession::Prepared::operator=(Prepared&&) noexcept = default;
TrainingSession::Prepared::~Prepared() = default;

const SessionOptions& TrainingSession::Prepared::options() const {
  return s_->options;
}

elastic::Agent& TrainingSession::Prepared::agent() {
  return *s_->agent;
}

}  // namespace acc
