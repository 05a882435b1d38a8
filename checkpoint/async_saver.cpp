#include "acc/checkpoint/async_saver.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "acc/tensor/node.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/progress.hpp"
#include "entries.hpp"
#include "save_protocol.hpp"
#include "trainer_header.hpp"

namespace acc::ckpt {

using detail::agree;
using detail::check_options;
using detail::commit_here;
using detail::contiguous_local;
using detail::PendingSave;
using detail::prepare;
using detail::share_commit;
using detail::trainer_header;
using detail::write_shard;
using detail::written_here;
using dist::PlacementEntry;

namespace {

// Set once by one thread, waited for by another.
class Latch {
 public:
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      set_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

}  // namespace

struct AsyncSaver::State {
  std::string root;
  SaveOptions options;
  dist::ProcessGroupPtr group;
  std::unique_ptr<PendingSave> pending;
  bool committing = false;  // the pending save's shards are agreed; rank 0 commits
  // Host copies of what this rank saves, kept for the next save (same names and sizes: the same
  // buffers, without a page fault each time).
  dist::PlacementTable snapshot;
  std::thread worker;            // the copy and the shard's write; then, on rank 0, the commit
  std::atomic<bool> done{true};  // this rank's part of the current phase
};

AsyncSaver::AsyncSaver(std::string root, SaveOptions options) : s_(std::make_unique<State>()) {
  s_->root = std::move(root);
  s_->options = options;
  check_options(0, options);
}

AsyncSaver::~AsyncSaver() {
  if (s_->worker.joinable()) s_->worker.join();
  if (s_->pending && !s_->committing) {
    // Committing takes every rank (collectives), which a destructor cannot promise: the written
    // shards stay in their temporary directory, which the next save removes.
    logging::warn(
        "checkpoint: the save of step {} was never finished (AsyncSaver::finish); "
        "it is not committed",
        s_->pending->step);
  }
}

bool AsyncSaver::pending() const {
  return s_->pending != nullptr;
}

void AsyncSaver::save(int64_t step, strategies::Trainer& trainer,
                      const std::string& model_trace_hash, nlohmann::json extra) {
  progress::phase(progress::Phase::kSave);
  if (s_->pending) finish();  // the next save waits for the previous
  ACC_CHECK(trainer.context() != nullptr, "checkpoint: the trainer has no process group");
  s_->group = trainer.context()->world();
  auto p = std::make_unique<PendingSave>();
  p->root = s_->root;
  p->step = step;
  p->options = s_->options;
  p->header = trainer_header(trainer, model_trace_hash, std::move(extra));
  prepare(*p, *s_->group);
  // The snapshot's buffers (the last save's where they fit) and the live tensors to copy into
  // them. The copy runs on the worker while the next step's forward and backward run; the step's
  // update waits for it (Trainer::before_next_update), since it changes what is copied.
  std::map<std::string, Tensor> old;
  for (PlacementEntry& e : s_->snapshot) old[e.name] = std::move(e.local);
  s_->snapshot.clear();
  std::vector<Tensor> sources;
  {
    NoGradGuard no_grad;  // contiguous() of a non-contiguous tensor must record nothing
    for (const PlacementEntry& e : trainer.placements()) {
      if (!written_here(e)) continue;
      PlacementEntry copy = e;
      auto it = old.find(e.name);
      copy.local = it != old.end() && it->second.numel() == e.local.numel() &&
                           it->second.dtype() == e.local.dtype()
                       ? it->second
                       : empty({e.local.numel()}, {e.local.dtype()});
      sources.push_back(contiguous_local(e));
      s_->snapshot.push_back(std::move(copy));
    }
  }
  old.clear();
  auto copied = std::make_shared<Latch>();
  trainer.before_next_update([copied] { copied->wait(); });
  s_->pending = std::move(p);
  s_->committing = false;
  s_->done = false;
  const int rank = s_->group->rank();
  s_->worker = std::thread([s = s_.get(), rank, sources = std::move(sources), copied]() mutable {
    for (size_t i = 0; i < sources.size(); ++i) {
      std::memcpy(s->snapshot[i].local.raw_data(), sources[i].raw_data(),
                  static_cast<size_t>(sources[i].numel()) * element_size(sources[i].dtype()));
    }
    sources.clear();
    copied->set();
    // Below the training threads from here: where the writer and training share a core, training
    // goes first and the write takes the idle time (a failure to lower it is harmless).
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
    write_shard(*s->pending, s->snapshot, rank, /*pipelined=*/false);
    s->done = true;
  });
}

std::optional<std::string> AsyncSaver::poll() {
  if (!s_->pending) return std::nullopt;
  Tensor busy = from_vector(std::vector<int64_t>{s_->done ? 0 : 1}, {1});
  s_->group->allreduce(busy, dist::ReduceOp::kSum)->wait();
  if (busy.to_vector<int64_t>()[0] > 0) return std::nullopt;
  return advance();
}

std::optional<std::string> AsyncSaver::finish() {
  if (!s_->pending) return std::nullopt;
  if (!s_->committing) advance();
  return advance();
}

std::optional<std::string> AsyncSaver::advance() {
  if (s_->worker.joinable()) s_->worker.join();
  dist::ProcessGroup& group = *s_->group;
  // Taken out while the collectives run: a failed save leaves nothing pending.
  std::unique_ptr<PendingSave> p = std::move(s_->pending);
  if (s_->committing) return share_commit(*p, group);
  std::vector<nlohmann::json> per_rank = agree(*p, group);
  s_->pending = std::move(p);
  s_->committing = true;
  s_->done = group.rank() != 0;
  if (group.rank() == 0) {  // the metadata, renames, fsyncs and old steps' removal: off training
    s_->worker = std::thread([s = s_.get(), per_rank = std::move(per_rank), world = group.size()] {
      commit_here(*s->pending, per_rank, world);
      s->done = true;
    });
  }
  return std::nullopt;
}

}  // namespace acc::ckpt
