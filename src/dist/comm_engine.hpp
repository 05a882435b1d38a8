#pragma once
// The communication thread: the only thread that calls MPI between init and finalize. Operations
// are started in submission order (non-blocking MPI calls) and progressed together by polling
// MPI_Testall, with a short wait (doubling while nothing moves) when nothing moved so that a
// waiting rank leaves the cores to computation.

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "acc/dist/process_group.hpp"

namespace acc::dist::detail {

/// Throws acc::CommError with MPI's message when rc is not MPI_SUCCESS.
void check_mpi(int rc, const char* what);

/// A duplicate of `comm` whose errors return codes (MPI_ERRORS_RETURN) instead of aborting.
MPI_Comm dup_returning_errors(MPI_Comm comm);

/// How many sequence numbers a point-to-point tag spans in MPI tags: a message's MPI tag is
/// tag x span + seq mod span, so that the n-th message of a pair of ranks can only match the n-th
/// receive (never an earlier or later one of the same tag within `span` messages), and the
/// largest tag, ProcessGroup::kMaxTag, still fits under MPI_TAG_UB (at least 32767 by the
/// standard, which gives 32; OpenMPI's 2^31 - 1 gives 2^21). Reads MPI_COMM_WORLD's MPI_TAG_UB.
int64_t p2p_tag_span();

struct GroupState {
  MPI_Comm comm = MPI_COMM_NULL;
  // A duplicate of `comm` for the point-to-point messages of AutoAcc's own collective algorithms
  // (ring reduce-scatter), so they never match a user's send/recv.
  MPI_Comm algo_comm = MPI_COMM_NULL;
  std::string name;
  int rank = 0, size = 1;
  std::vector<int> members;
  /// A meta group (ProcessGroup::meta): a size, a rank and a name, no communicator.
  bool meta = false;
  std::atomic<uint64_t> seq{0};  // collectives
  // Point-to-point messages per peer (a rank of the group) and direction: the numbers given out,
  // and the messages recorded and issued. They differ while a message is between the two (fault
  // injection stops a rank right there, and the hang analysis must see that message as not sent).
  struct P2PCounts {
    std::vector<uint64_t> numbered, issued;  // by peer
  };
  mutable std::mutex p2p_mu;
  P2PCounts sends, recvs;  // guarded by p2p_mu
  // The number of distinct sequence values one tag's MPI tags hold (p2p_tag_span).
  int64_t tag_span = 32;
  FlightRecorder recorder;
  /// The timeout of calls that do not set one (nullopt: dist::default_timeout()).
  std::optional<std::chrono::milliseconds> timeout;
};

class CommEngine {
 public:
  using StartFn = std::function<std::vector<MPI_Request>()>;
  using FinishFn = std::function<void()>;
  /// Called on the comm thread each time the requests issued so far have all completed; returns
  /// the next round's requests, or none when the operation is done (multi-step algorithms).
  using NextFn = std::function<std::vector<MPI_Request>()>;
  /// Called on the comm thread with the statuses of the requests issued so far once they have all
  /// completed, before `next` or `finish`; throws acc::CommError to fail the Work (a message that
  /// filled less of its receive buffer than expected: MPI reports only one that overflows it).
  using CheckFn = std::function<void(const std::vector<MPI_Status>&)>;

  static CommEngine& instance();
  void start();
  /// Drains what is in flight (up to `drain_ms`; at once when an operation has already failed or
  /// timed out: what is left is stuck); returns false when something is still in flight.
  bool stop(int64_t drain_ms);
  /// Called when a Work of `group` fails or a wait on it times out: the job is failing, so stop()
  /// drains no longer (a rank leaves within moments of reporting the fault).
  void note_fault(const std::string& group);
  /// The ranks of `group` are alive and done with it (a dry-run's communicator after one rank's
  /// candidate failed): what is left in flight on it stays buried (never freed), its faults no
  /// longer count, and stop() neither waits for it nor skips MPI_Finalize because of it. OpenMPI
  /// 4.1 finalizes with such operations pending on a communicator of their own (checked with a
  /// pending Iallgather, Iallreduce, Isend and Irecv on an MPI_Comm_dup). Group names must be
  /// unique for this (the dry-runs number theirs).
  void abandon_group(const std::string& group);
  /// Whether an operation of a group not abandoned has failed or timed out.
  bool faulted();
  bool running() const { return running_.load(); }

  /// Queues an operation: `start` issues its non-blocking MPI calls on the comm thread; when they
  /// complete, `next` (if given) may issue another round, and so on until it returns none; then
  /// `finish` runs there. Each may throw acc::CommError, which fails the Work; so may `check`,
  /// which sees each round's statuses first.
  void submit(WorkPtr work, StartFn start, FinishFn finish = nullptr, NextFn next = nullptr,
              CheckFn check = nullptr);
  /// Runs `fn` (blocking MPI calls allowed) on the comm thread and waits for it.
  void run_sync(const std::function<void()>& fn);

  /// Brackets a thread blocked in Work::wait: while one is, the comm thread polls at
  /// ACC_COMM_POLL_US without backing off (the waiter's core is idle, and what it waits for is
  /// usually the tail of a step, whose latency is exposed).
  void waiter_enter();
  void waiter_leave() { waiters_.fetch_sub(1); }

  MPI_Op bf16_sum() const { return bf16_sum_; }
  MPI_Op bf16_max() const { return bf16_max_; }

 private:
  struct Task {
    WorkPtr work;
    StartFn start;
    FinishFn finish;
    NextFn next;
    CheckFn check;
    std::vector<MPI_Request> requests;
    std::vector<MPI_Status> statuses;  // of the completed round, when `check` wants them
    bool failed = false;
  };
  void loop();
  // Keeps a failed task (its Work, tensors and buffers) alive for the life of the process.
  void bury(Task&& t);
  // Whether nothing of a group not abandoned is queued or in flight (mu_ held).
  bool idle_locked() const;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::vector<Task> inflight_;
  // Failed tasks and tasks still in flight when stop() gave up. Their MPI requests may still be
  // active (an MPI error ends MPI_Testall, not the other requests of the operation; a start() that
  // threw may have issued some), so nothing they read or write is ever freed: a failure path must
  // not become a use-after-free. Only failures add here, and a failure ends the job.
  std::vector<Task> buried_;
  std::set<std::string> faulted_groups_, abandoned_groups_;  // guarded by mu_
  std::atomic<bool> running_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> abandon_{false};
  std::atomic<int> waiters_{0};
  std::atomic<uint64_t> wait_starts_{0};  // waits begun (waiter_enter), for the spin
  std::thread thread_;
  MPI_Op bf16_sum_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL;
  int poll_us_ = 20;       // ACC_COMM_POLL_US: the first wait when nothing progressed
  int max_poll_us_ = 256;  // ACC_COMM_MAX_POLL_US: the longest
  int spin_us_ = 250;      // ACC_COMM_SPIN_US: polls without sleeping this long into a wait
};

}  // namespace acc::dist::detail
