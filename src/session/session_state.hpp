#pragma once
// What a TrainingSession holds, shared by its files (private).

#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "acc/checkpoint/async_saver.hpp"
#include "acc/checkpoint/root_lock.hpp"
#include "acc/session.hpp"

namespace acc {

struct TrainingSession::Prepared::State {
  SessionOptions options;
  dist::ProcessGroupPtr world;
  int attempt = 0;
  std::optional<ckpt::RootLock> lock;  // rank 0, with a ckpt_dir
  std::unique_ptr<elastic::Agent> agent;
};

namespace session_detail {

/// "resume auto" / "resume 'DIR'" in the options' names.
std::string describe_resume(const SessionOptions& o);

/// The model's part of a checkpoint's extra: a language model's {"model_type", "config"}, another
/// module's {"module_type"}.
nlohmann::json model_extra(const nn::Module& model);

/// What resuming found (nothing: a fresh start).
struct Resumed {
  std::string dir;
  int64_t step = 0;
};

/// Resumes `trainer`, `loader` and the default generator as the options say. Collective over
/// `world` and the trainer's group. Throws as TrainingSession's constructor documents.
std::optional<Resumed> resume(const SessionOptions& o, const dist::ProcessGroupPtr& world,
                              strategies::Trainer& trainer, const nn::Module& model,
                              const std::string& model_hash, data::Loader& loader);

/// The JSON step log (rank 0): opened anew or for appending, each line flushed and checked.
class StepLog {
 public:
  /// Throws acc::IoError naming `what` and the path when it cannot be opened.
  StepLog(const std::string& path, bool append, const std::string& what);
  /// Throws acc::IoError when the write fails.
  void write(const nlohmann::json& line);

 private:
  std::string path_, what_;
  std::ofstream out_;
};

/// Rank 0's outcome of `fn` on every rank of `world`: fn runs on rank 0 only, and an exception
/// there is thrown on every rank, as acc::ValueError or acc::IoError (any other acc::Error), with
/// rank 0's message.
void on_rank0(dist::ProcessGroup& world, const std::function<void()>& fn);

}  // namespace session_detail

struct TrainingSession::State {
  std::unique_ptr<Prepared::State> prepared;
  const SessionOptions* o = nullptr;  // prepared->options
  AccelerateResult* acc = nullptr;
  data::Loader* loader = nullptr;
  strategies::Trainer* trainer = nullptr;
  nn::ModulePtr model;
  bool leader = false;
  int64_t first_step = 0;
  int64_t next_step = 0;
  std::optional<std::string> resumed_from;
  int64_t saved_step = -1;  // the newest step saved into ckpt_dir by this session (or resumed)
  std::unique_ptr<ckpt::AsyncSaver> saver;
  std::optional<session_detail::StepLog> log;
  bool finished = false;
  double first_loss = 0, last_loss = 0;
  std::vector<double> step_ms;  // every step's but the first (it warms caches up)
};

}  // namespace acc
