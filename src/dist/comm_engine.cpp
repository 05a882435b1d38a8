#include "comm_engine.hpp"

#include <algorithm>
#include <chrono>

#include "acc/tensor/dtype.hpp"
#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"

namespace acc::dist::detail {
namespace {

// bf16 reductions: each element is widened to f32, combined, and rounded back.
void bf16_sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = BFloat16::round_from_float(BFloat16::to_float(a[i]) + BFloat16::to_float(b[i]));
  }
}

void bf16_max_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    if (BFloat16::to_float(a[i]) > BFloat16::to_float(b[i])) b[i] = a[i];
  }
}

}  // namespace

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  ACC_THROW(CommError, what, " failed: ", std::string(msg, static_cast<size_t>(len)));
}

MPI_Comm dup_returning_errors(MPI_Comm comm) {
  MPI_Comm dup = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  return dup;
}

int64_t p2p_tag_span() {
  void* value = nullptr;
  int flag = 0;
  check_mpi(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &flag), "MPI_Comm_get_attr");
  const int64_t ub = flag && value ? *static_cast<int*>(value) : 32767;  // the standard's least
  return std::max<int64_t>(1, (ub + 1) / (ProcessGroup::kMaxTag + 1));
}

CommEngine& CommEngine::instance() {
  static CommEngine* engine = new CommEngine();  // outlives static destruction
  return *engine;
}

void CommEngine::start() {
  if (running_.load()) return;
  // Poll intervals in whole microseconds, checked before they are narrowed to int (99999999999
  // wrapped to a 20-minute poll): at most 1 s, beyond which a poll is a stall of its own.
  constexpr int64_t kMaxPollUs = 1000000;
  const int64_t poll = env::get_int("ACC_COMM_POLL_US", 20);
  ACC_CHECK(poll >= 0 && poll <= kMaxPollUs, "ACC_COMM_POLL_US must be >= 0 and at most ",
            kMaxPollUs, " (1 s), got ", poll);
  const int64_t max_poll = env::get_int("ACC_COMM_MAX_POLL_US", 256);
  ACC_CHECK(max_poll >= poll && max_poll <= kMaxPollUs,
            "ACC_COMM_MAX_POLL_US must be >= ", "ACC_COMM_POLL_US (", poll, ") and at most ",
            kMaxPollUs, " (1 s), got ", max_poll);
  poll_us_ = static_cast<int>(poll);
  max_poll_us_ = static_cast<int>(max_poll);
  const int64_t spin = env::get_int("ACC_COMM_SPIN_US", 250);
  ACC_CHECK(spin >= 0 && spin <= kMaxPollUs, "ACC_COMM_SPIN_US must be >= 0 and at most ",
            kMaxPollUs, " (1 s), got ", spin);
  spin_us_ = static_cast<int>(spin);
  check_mpi(MPI_Op_create(&bf16_sum_fn, 1, &bf16_sum_), "MPI_Op_create(bf16 sum)");
  check_mpi(MPI_Op_create(&bf16_max_fn, 1, &bf16_max_), "MPI_Op_create(bf16 max)");
  stopping_ = false;
  abandon_ = false;
  running_ = true;
  thread_ = std::thread([this] { loop(); });
}

bool CommEngine::stop(int64_t drain_ms) {
  if (!running_.load()) return true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (faulted()) drain_ms = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(drain_ms);
  bool drained = true;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (idle_locked()) break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      drained = false;
      abandon_ = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  abandon_ = true;
  cv_.notify_all();
  thread_.join();
  running_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Task& t : inflight_) buried_.push_back(std::move(t));
    for (Task& t : queue_) buried_.push_back(std::move(t));
    inflight_.clear();
    queue_.clear();
  }
  if (drained) {
    MPI_Op_free(&bf16_sum_);
    MPI_Op_free(&bf16_max_);
  }
  return drained;
}

void CommEngine::submit(WorkPtr work, StartFn start, FinishFn finish, NextFn next, CheckFn check) {
  ACC_CHECK_AS(CommError, running_.load(),
               "communication is not initialised (call acc::dist::init first)");
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Task{std::move(work),
                          std::move(start),
                          std::move(finish),
                          std::move(next),
                          std::move(check),
                          {},
                          {},
                          false});
  }
  cv_.notify_all();
}

void CommEngine::bury(Task&& t) {
  std::lock_guard<std::mutex> lock(mu_);
  faulted_groups_.insert(t.work->group());
  buried_.push_back(std::move(t));
}

void CommEngine::note_fault(const std::string& group) {
  std::lock_guard<std::mutex> lock(mu_);
  faulted_groups_.insert(group);
}

void CommEngine::abandon_group(const std::string& group) {
  std::lock_guard<std::mutex> lock(mu_);
  abandoned_groups_.insert(group);
  faulted_groups_.erase(group);
}

bool CommEngine::faulted() {
  std::lock_guard<std::mutex> lock(mu_);
  return !faulted_groups_.empty();
}

bool CommEngine::idle_locked() const {
  auto live = [&](const Task& t) { return abandoned_groups_.count(t.work->group()) == 0; };
  return std::none_of(queue_.begin(), queue_.end(), live) &&
         std::none_of(inflight_.begin(), inflight_.end(), live);
}

void CommEngine::waiter_enter() {
  wait_starts_.fetch_add(1);                         // each wait restarts the comm thread's spin
  if (waiters_.fetch_add(1) == 0) cv_.notify_all();  // cut a backed-off wait short
}

void CommEngine::run_sync(const std::function<void()>& fn) {
  auto work = std::make_shared<Work>("sync", "", 0, 0, 1, std::chrono::hours(24), nullptr, 0);
  std::exception_ptr error;
  submit(work, [&]() -> std::vector<MPI_Request> {
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    return {};
  });
  work->wait();
  if (error) std::rethrow_exception(error);
}

void CommEngine::loop() {
  int backoff_us = poll_us_;
  // When something last moved or a wait began, and the waits begun by then.
  auto moved_at = std::chrono::steady_clock::now();
  uint64_t waits_seen = 0;
  while (true) {
    std::vector<Task> fresh;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (abandon_.load() || (stopping_.load() && queue_.empty() && inflight_.empty())) break;
      if (queue_.empty() && inflight_.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(50));
        continue;
      }
      while (!queue_.empty()) {
        fresh.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    // Start new operations in submission order.
    for (Task& t : fresh) {
      t.work->mark_started();
      try {
        t.requests = t.start();
      } catch (const std::exception& e) {
        t.work->mark_failed(e.what());
        bury(std::move(t));  // it may have issued some of its requests before throwing
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      inflight_.push_back(std::move(t));
    }
    // Progress everything in flight; complete what is done.
    bool progressed = !fresh.empty();
    std::vector<Task> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < inflight_.size();) {
        Task& t = inflight_[i];
        int flag = 1;
        int rc = MPI_SUCCESS;
        if (!t.requests.empty()) {
          if (t.check) t.statuses.resize(t.requests.size());
          rc = MPI_Testall(static_cast<int>(t.requests.size()), t.requests.data(), &flag,
                           t.check ? t.statuses.data() : MPI_STATUSES_IGNORE);
        }
        if (rc != MPI_SUCCESS || flag) {
          if (rc != MPI_SUCCESS) {
            try {
              check_mpi(rc, t.work->op().c_str());
            } catch (const std::exception& e) {
              t.work->mark_failed(e.what());
              t.failed = true;
            }
          }
          done.push_back(std::move(t));
          inflight_.erase(inflight_.begin() + static_cast<std::ptrdiff_t>(i));
          progressed = true;
        } else {
          ++i;
        }
      }
    }
    // Outside the lock: the next round of a multi-step operation (its local reduction work must
    // not hold up threads submitting new operations), or completion.
    for (Task& t : done) {
      if (t.failed) {
        bury(std::move(t));
        continue;
      }
      try {
        if (t.check) t.check(t.statuses);
      } catch (const std::exception& e) {
        t.work->mark_failed(e.what());  // every request had completed: nothing is in flight
        continue;
      }
      try {
        if (t.next) {
          t.requests = t.next();
          if (!t.requests.empty()) {
            std::lock_guard<std::mutex> lock(mu_);
            inflight_.push_back(std::move(t));
            continue;
          }
        }
      } catch (const std::exception& e) {
        t.work->mark_failed(e.what());
        bury(std::move(t));  // next() may have issued part of its round
        continue;
      }
      try {
        if (t.finish) t.finish();
        t.work->mark_completed();
      } catch (const std::exception& e) {
        t.work->mark_failed(e.what());  // every request had completed: nothing is in flight
      }
    }
    // Nothing moved: wait, doubling the wait up to max_poll_us_ while nothing moves, and wake at
    // once for a new operation. Each wake-up preempts a computing thread on a busy core: in a
    // 2-rank ddp run on 2 cores, polling every 20 us preempted the main threads ~20k times in
    // 30 s, every 200 us ~4.5k times. While a thread is blocked in Work::wait there is no
    // computation of this rank to preempt and the wait is exposed, so the comm thread polls
    // without backing off, and for spin_us_ after a wait began or anything last moved it
    // does not sleep at all (yielding the core to any other runnable thread at each turn). MPI
    // moves a message only inside MPI_Testall, on both ends, and a timed wait of 20 us sleeps
    // 60-70 us (the kernel's timer slack): sleeping between polls, a 4 KiB all-reduce of 2 ranks
    // took 0.75 ms against 0.022 ms spinning, 1 MiB 0.75 against 0.19 ms (bench_collectives,
    // 2026-11-29, 2 vCPUs), and a tensor-parallel step waits on some 20 such collectives per
    // micro-batch. The spin is bounded so that a rank waiting long for a late peer (a skewed
    // step, a save, a hang) leaves the cores to the ranks still computing, oversubscribed.
    const bool waited_on = waiters_.load() > 0;
    if (progressed || waited_on) {
      backoff_us = poll_us_;
    }
    const auto now = std::chrono::steady_clock::now();
    const uint64_t waits = wait_starts_.load();
    if (progressed || waits != waits_seen) moved_at = now;
    waits_seen = waits;
    if (!progressed && waited_on && now - moved_at < std::chrono::microseconds(spin_us_)) {
      std::this_thread::yield();
    } else if (!progressed && poll_us_ > 0) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::microseconds(backoff_us), [&] {
        return !queue_.empty() || abandon_.load() || (!waited_on && waiters_.load() > 0);
      });
      if (!waited_on) backoff_us = std::min(backoff_us * 2, max_poll_us_);
    }
  }
}

}  // namespace acc::dist::detail
