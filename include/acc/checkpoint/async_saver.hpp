#pragma once
// AsyncSaver: a Trainer's checkpoint written while training goes on.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "acc/checkpoint/save.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc::ckpt {

/// save_trainer without stopping training for the write: save() gathers the header (collective)
/// and starts a background thread that copies the state this rank saves to host memory while the
/// next step's forward and backward run (that step's update waits for the copy: Trainer::
/// before_next_update) and then writes the shard. poll(), called at each step boundary (one small
/// all-reduce while a save is pending, nothing otherwise), agrees once every rank's write is done,
/// and then hands the commit to rank 0's background thread; a later poll() returns the committed
/// directory. finish() does what is left at once. A save() while one is pending finishes that one
/// first. Until the next step() the trainer's state must change only through step() (call finish()
/// before loading into it). save(), poll() and finish() are collectives over the trainer's group;
/// errors are those of save(), thrown by the call that learns them. Rank 0 holds the root's lock
/// from save() until the commit's outcome is known, unless this process holds it already (a job's
/// RootLock). The copy's buffers are kept for the next save (one host copy of this rank's share of
/// the state). Dropping a saver with a save pending leaves it uncommitted unless rank 0 was already
/// committing it (logged; the next save removes its temporary directory).
class AsyncSaver {
 public:
  explicit AsyncSaver(std::string root, SaveOptions options = {});
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  void save(int64_t step, strategies::Trainer& trainer, const std::string& model_trace_hash,
            nlohmann::json extra = {});
  /// The committed step directory when this call learnt that the pending save is committed.
  std::optional<std::string> poll();
  /// Waits for the pending save and commits it; std::nullopt when none was pending.
  std::optional<std::string> finish();
  bool pending() const;

 private:
  // Takes the pending save one phase on once every rank's part of the current one is done: the
  // writes agreed and rank 0's commit started, or the commit's outcome shared.
  std::optional<std::string> advance();
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace acc::ckpt
