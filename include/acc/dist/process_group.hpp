#pragma once
// Collective communication over OpenMPI, shaped like c10d.
//
// Contracts:
//  - All ranks of a group call its collectives in the same order (MPI's rule); the per-group
//    sequence number of each call is how a mismatch or a stall is diagnosed.
//  - Point-to-point messages are numbered apart from the collectives, per peer and direction: the
//    n-th send from rank a to rank b on a group pairs with b's n-th recv from a, and with nothing
//    else (the number is part of the MPI tag, with the caller's tag). Both sides must issue a
//    pair's messages in the same order; a recv posted for the wrong message waits (and times out
//    naming its sequence number and peer) instead of taking another message's bytes.
//  - Every call returns at once with a Work; the tensors it reads and writes must not be touched
//    until wait() returns (the Work keeps them alive). Outputs are valid after wait(). An
//    operation that failed or timed out keeps its tensors for the life of the process (MPI may
//    still touch them), so dropping a Work while an exception unwinds never frees memory that an
//    abandoned collective reads or writes.
//  - Every collective has a finite timeout (CollectiveOptions::timeout, default
//    ACC_COMM_TIMEOUT_SEC, 300 s). wait() throws acc::TimeoutError naming the op, its sequence
//    number and the group when it does not complete in time (the flight recorder is dumped to the
//    log first); an MPI failure becomes acc::CommError with MPI's message.
//  - All MPI calls are made by one communication thread per process, which starts operations in
//    submission order and progresses every operation in flight while the caller computes: this is
//    what lets gradient communication overlap the backward pass.
//
// Tensors are contiguous CPU tensors; f32, bf16, i32 and i64 are supported (bf16 reductions sum in
// f32 and round back). Large tensors go in chunks so that no MPI count overflows.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "acc/dist/flight_recorder.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::dist {

enum class ReduceOp { kSum, kAvg, kMax };
const char* reduce_op_name(ReduceOp op);

/// The timeout every collective gets unless told otherwise: ACC_COMM_TIMEOUT_SEC (default 300),
/// read with acc::env::get_seconds: a finite number of seconds > 0 and at most 604800 (7 days,
/// acc::kMaxDurationSeconds). A larger one is refused, not taken as "no timeout": every collective
/// has a finite timeout. Throws acc::ValueError naming the variable and its value.
std::chrono::milliseconds default_timeout();

/// Seconds that threads of this process have spent blocked in Work::wait since it started, summed
/// over threads (two threads waiting for one second each add two); a wait on a completed Work adds
/// nothing. The communication a region leaves exposed is the difference of two readings around
/// it, which is how benchmarks measure it without a switch in the library. Per process, not per
/// group; cheap enough to read every step (one relaxed atomic load). Never throws.
double wait_seconds();

/// How a timeout or failure, a flight-recorder dump and a hang report name the group `name`: a
/// mesh group (dist::ParallelContext names it "<dimension> of <coordinates>", "tp of dp=1") as its
/// dimension quoted and its place along the other dimensions, "group 'tp' of dp=1"; any other name
/// quoted whole, "group 'world'". The one place that text is made. Never throws.
std::string describe_group_name(const std::string& name);

struct CollectiveOptions {
  /// nullopt: the group's timeout (ProcessGroup::split), else default_timeout().
  std::optional<std::chrono::milliseconds> timeout;
};

class ProcessGroup;

/// An operation in flight.
class Work {
 public:
  /// `label` names the operation in errors ("recv seq 4 from rank 1 (tag 0)"); empty: "<op> (seq
  /// <seq>)".
  Work(std::string op, std::string group, uint64_t seq, int rank, int size,
       std::chrono::milliseconds timeout, FlightRecorder* recorder, size_t record,
       std::string label = "");
  bool is_completed() const;
  /// Blocks until the operation completes. Throws acc::TimeoutError when it does not within
  /// `timeout` (default: the op's own), acc::CommError when it failed.
  void wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  const std::string& op() const { return op_; }
  const std::string& group() const { return group_; }
  /// The collective sequence number, or a point-to-point message's number among those to or from
  /// its peer.
  uint64_t seq() const { return seq_; }

  // Used by the communication engine.
  void mark_started();
  void mark_completed();
  void mark_failed(const std::string& error);
  void keep_alive(Tensor t) { tensors_.push_back(std::move(t)); }
  void release_tensors() { tensors_.clear(); }

 private:
  std::string detail_str(std::chrono::milliseconds limit, const char* where) const;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  enum class State { kQueued, kStarted, kCompleted, kFailed } state_ = State::kQueued;
  std::string error_;
  std::string op_, group_, label_;
  uint64_t seq_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  FlightRecorder* recorder_;
  size_t record_;
  std::vector<Tensor> tensors_;
};

using WorkPtr = std::shared_ptr<Work>;

namespace detail {
struct GroupState;
}

class ProcessGroup {
 public:
  /// Tags of send and recv are 0..kMaxTag.
  static constexpr int kMaxTag = 1023;

  /// The group of all ranks (after acc::dist::init). Throws acc::CommError before init.
  static std::shared_ptr<ProcessGroup> world();

  /// A group that exists only as a size, a rank and a name, with no communicator and no MPI (no
  /// init needed): how one process traces what rank `rank` of a group of `size` does ("rank 3 of
  /// a tp=8 mesh"). It carries meta tensors only, through the differentiable ops of
  /// acc/dist/functional.hpp, which move nothing and report their communication to the tracer;
  /// every collective below throws acc::TypeError naming the group. Its members are 0..size-1.
  /// Throws acc::ValueError for a size below 1, a rank outside [0, size) or an empty name.
  static std::shared_ptr<ProcessGroup> meta(int size, int rank, const std::string& name);

  int rank() const;
  int size() const;
  const std::string& name() const;
  /// Global ranks of the members, in group-rank order.
  const std::vector<int>& members() const;
  /// Whether this is a meta group (ProcessGroup::meta).
  bool is_meta() const;

  /// In place: t <- op over ranks of t.
  WorkPtr allreduce(Tensor& t, ReduceOp op = ReduceOp::kSum, const CollectiveOptions& o = {});
  /// input (size * n elements) reduced over ranks; this rank gets block `rank` (n elements).
  WorkPtr reduce_scatter(Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::kSum,
                         const CollectiveOptions& o = {});
  /// output (size * n elements) = the inputs (n each) of ranks 0..size-1 concatenated. The input
  /// may be this rank's block of the output (in place, nothing copied); no other overlap.
  WorkPtr allgather(Tensor& output, const Tensor& input, const CollectiveOptions& o = {});
  /// t <- root's t.
  WorkPtr broadcast(Tensor& t, int root, const CollectiveOptions& o = {});
  /// input (size blocks of n) -> output (size blocks of n): block j of rank i goes to block i of
  /// rank j.
  WorkPtr alltoall(Tensor& output, const Tensor& input, const CollectiveOptions& o = {});
  /// t to rank `dst` of this group: the next message of this rank to `dst` (its sequence number is
  /// p2p_sequence_number(dst, kSend) after the call). `tag` in [0, kMaxTag] tells messages apart
  /// beyond their order: a recv matches only a send with the same tag and sequence number.
  /// Throws acc::ValueError for a bad peer or tag.
  WorkPtr send(const Tensor& t, int dst, int tag = 0, const CollectiveOptions& o = {});
  /// t <- the next message from rank `src` of this group (see send). The message must fill t
  /// exactly: a larger one fails the Work with MPI's truncation error, a smaller one with an
  /// acc::CommError naming both sizes.
  WorkPtr recv(Tensor& t, int src, int tag = 0, const CollectiveOptions& o = {});
  WorkPtr barrier(const CollectiveOptions& o = {});

  /// A sub-group of the ranks that pass the same `color` (MPI_Comm_split; `key` orders them).
  /// Collective over this group. Its calls that set no timeout of their own get `timeout` (default:
  /// default_timeout()): how a dry-run gives every collective of a candidate a short limit, so a
  /// rank whose candidate failed does not keep the others waiting for the job's timeout. All ranks
  /// passing one color get a new communicator: what is left in flight on it after a failure never
  /// matches a later call on this group. Throws acc::ValueError for a timeout not above 0 or above
  /// 7 days (acc::kMaxDurationSeconds).
  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name,
                                      std::optional<std::chrono::milliseconds> timeout = {});

  /// A group of this rank alone, named `name`, made without communicating with the others
  /// (MPI_COMM_SELF duplicated: not a collective of this group, whose sequence is untouched).
  /// A mesh dimension of size 1 gets one: collectives over it are local.
  std::shared_ptr<ProcessGroup> alone(const std::string& name) const;

  /// Every rank of this group is alive and done with it, though operations on it may be left in
  /// flight (a collective one rank never joined): they stay buried (nothing they touch is freed),
  /// their timeouts stop counting as the job's fault, and finalize neither waits for them nor
  /// skips MPI_Finalize because of them. The group must not be used afterwards. How a dry-run
  /// leaves its failed candidate's communicator behind.
  void abandon();

  FlightRecorder& flight_recorder();
  /// Collectives issued on this group so far (sends and recvs not counted).
  uint64_t sequence_number() const;
  /// Point-to-point messages issued so far to (kSend) or from (kRecv) `peer`, a rank of this
  /// group (0 for a rank outside it): the sequence number of the last one recorded in the flight
  /// recorder (one whose number was given out but that was stopped before it was recorded, as
  /// fault injection does, is not counted).
  uint64_t p2p_sequence_number(int peer, P2PDirection direction) const;

  explicit ProcessGroup(std::shared_ptr<detail::GroupState> state);
  ~ProcessGroup();

 private:
  std::shared_ptr<detail::GroupState> state_;
};

using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

}  // namespace acc::dist
