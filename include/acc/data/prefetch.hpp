#pragma once
// PrefetchLoader: any Loader with its next batches built ahead on a background thread.
//
//   auto loader = std::make_unique<data::BatchLoader>(tokens, options);
//   data::PrefetchLoader prefetch(std::move(loader), {.depth = 2});
//   for (...) trainer->train_step(prefetch.next());   // built while the last step ran
//
// The thread calls the inner loader's next() in order and queues the batches (at most `depth`
// of them), so the batches are the inner loader's own, in its order: bitwise those it returns
// without prefetch. The thread builds batches only: it runs no GEMM and no TBB work of its own,
// and spends the rest of a step asleep on the full queue, so it is one extra, mostly idle thread
// beside the ranks x threads that acc::set_num_threads sizes (a loader that does heavy tensor
// work in next() would compete with training for the cores).
//
// Position: state() is the inner loader's state as of the batches the caller has taken, not as
// of the batches built ahead: a checkpoint saved after k next() calls resumes at batch k. The
// thread records the inner loader's state() before each next() and queues it with the batch.
//
// Not thread-safe to share with the inner loader: acc's default generator (acc::manual_seed,
// dropout) and the tracked-memory limit (memory::LimitGuard) are process-wide, so an inner loader
// that draws from the default generator races with training (nondeterministic batches, a wrong
// RNG in checkpoints: give it a Generator of its own), and one built before a search allocates
// under a dry-run's budget (build the loader after auto_accelerate, as the examples do).
//
// Threads: the inner loader is only ever called by one thread at a time (a mutex the background
// thread holds from the inner state() through the inner next()); PrefetchLoader's own methods
// are for one (the training) thread, as a Loader's are. The batches are built on another
// thread, so the training thread's thread-local settings (acc::DefaultDeviceGuard, a tracer's
// op observer, grad mode) do not apply to them, and the queued batches count in
// acc::memory's tracked bytes.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "acc/data/batch.hpp"
#include "acc/data/loader.hpp"

namespace acc::data {

struct PrefetchOptions {
  int64_t depth = 2;  // batches built ahead (the queue's bound), >= 1
};

class PrefetchLoader : public Loader {
 public:
  /// Takes the inner loader whole (a std::unique_ptr: nobody else may call it while the
  /// background thread does) and starts the thread. Throws acc::ValueError naming the depth
  /// unless depth >= 1, and for a null loader; std::system_error when no thread can be started.
  explicit PrefetchLoader(std::unique_ptr<Loader> inner, PrefetchOptions options = {});
  /// Stops the thread: it wakes at once when the queue is full, and otherwise finishes the batch
  /// it is building (the inner next() is not interrupted). Never throws.
  ~PrefetchLoader() override;
  PrefetchLoader(const PrefetchLoader&) = delete;
  PrefetchLoader& operator=(const PrefetchLoader&) = delete;

  /// The inner loader's next batch, waiting for the thread when none is queued. When the inner
  /// loader threw on the thread, the batches before are returned first, then that exception is
  /// rethrown (the same type and message): by this call and every later one, as prefetching has
  /// stopped there; load_state() (for example of state()) clears it and prefetches again.
  Batch next() override;
  /// The inner loader's state before the oldest batch built and not yet returned by next(), or
  /// its current state when none is queued (then it may wait for the batch being built). Throws
  /// what the inner state() throws.
  nlohmann::json state() const override;
  /// Stops the thread, restores the inner loader's state, drops the queued batches and any held
  /// error, and prefetches from there. Throws what the inner load_state() throws; then nothing
  /// has changed: the queued batches are kept and the thread goes on from where it was.
  void load_state(const nlohmann::json& state) override;

  int64_t depth() const { return options_.depth; }

 private:
  struct Prefetched {
    nlohmann::json state;  // the inner loader's state before `batch`
    Batch batch;
  };

  void start();
  void stop();
  void run();

  std::unique_ptr<Loader> inner_;
  PrefetchOptions options_;
  // Lock order: inner_mu_, then mu_. The thread never waits on a condition holding inner_mu_.
  mutable std::mutex inner_mu_;        // held while anyone calls inner_
  mutable std::mutex mu_;              // guards the fields below
  std::condition_variable not_full_;   // the thread waits for room (or stop_)
  std::condition_variable not_empty_;  // next() waits for a batch, an error or the thread's end
  std::deque<Prefetched> queue_;
  std::exception_ptr error_;  // what the inner loader threw after the queued batches
  bool stop_ = false;
  bool running_ = false;  // the thread has not finished
  std::thread thread_;
};

}  // namespace acc::data
