#include "acc/dist/process_group.hpp"

#include <atomic>
#include <climits>
#include <cstring>

#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/parse.hpp"
#include "acc/util/progress.hpp"
#include "comm_engine.hpp"

namespace acc::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

std::chrono::milliseconds default_timeout() {
  return duration_ms(env::get_seconds("ACC_COMM_TIMEOUT_SEC").value_or(300.0));
}

std::string describe_group_name(const std::string& name) {
  // A mesh group's name is "<dimension> of <coordinates>" (ParallelContext's split_along): quoted
  // whole, "group 'tp of dp=1'" read as one name that says nothing of which group along tp.
  const size_t of = name.find(" of ");
  if (of == std::string::npos || of == 0) return ::acc::detail::str_cat("group '", name, "'");
  return ::acc::detail::str_cat("group '", name.substr(0, of), "'", name.substr(of));
}

// ---------------------------------------------------------------------------------------------
// Work

namespace {
// Nanoseconds threads have spent blocked in Work::wait (wait_seconds()).
std::atomic<int64_t> g_wait_ns{0};
}  // namespace

double wait_seconds() {
  return static_cast<double>(g_wait_ns.load(std::memory_order_relaxed)) * 1e-9;
}

Work::Work(std::string op, std::string group, uint64_t seq, int rank, int size,
           std::chrono::milliseconds timeout, FlightRecorder* recorder, size_t record,
           std::string label)
    : op_(std::move(op)),
      group_(std::move(group)),
      label_(label.empty() ? ::acc::detail::str_cat(op_, " (seq ", seq, ")") : std::move(label)),
      seq_(seq),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      recorder_(recorder),
      record_(record) {}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ == State::kCompleted;
}

void Work::mark_started() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == State::kQueued) state_ = State::kStarted;
  }
  if (recorder_) recorder_->mark_started(record_);
}

void Work::mark_completed() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = State::kCompleted;
  }
  if (recorder_) recorder_->mark_finished(record_, RecordState::kCompleted);
  release_tensors();
  cv_.notify_all();
}

void Work::mark_failed(const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = State::kFailed;
    error_ = error;
  }
  if (recorder_) recorder_->mark_finished(record_, RecordState::kFailed);
  // The tensors stay: MPI may still read or write them (the engine keeps the failed operation).
  cv_.notify_all();
}

void Work::wait(std::optional<std::chrono::milliseconds> timeout) {
  const auto limit = timeout.value_or(timeout_);
  std::unique_lock<std::mutex> lock(mu_);
  auto done = [&] { return state_ == State::kCompleted || state_ == State::kFailed; };
  bool finished = done();
  if (!finished) {
    auto& engine = detail::CommEngine::instance();
    const auto t0 = std::chrono::steady_clock::now();
    engine.waiter_enter();
    finished = cv_.wait_for(lock, limit, done);
    engine.waiter_leave();
    g_wait_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count(),
        std::memory_order_relaxed);
  }
  if (state_ == State::kFailed) {
    ACC_THROW(CommError, label_, " on ", describe_group_name(group_), " failed on rank ", rank_,
              " of ", size_, ": ", error_);
  }
  if (!finished) {
    const char* where = state_ == State::kQueued ? "queued behind earlier operations" : "started";
    lock.unlock();
    const std::string msg = detail_str(limit, where);
    detail::CommEngine::instance().note_fault(group_);
    if (recorder_) {
      recorder_->mark_finished(record_, RecordState::kTimedOut);
      recorder_->dump_to_log(msg);
    }
    throw TimeoutError(msg);
  }
}

std::string Work::detail_str(std::chrono::milliseconds limit, const char* where) const {
  return ::acc::detail::str_cat(label_, " on ", describe_group_name(group_),
                                " did not complete within ", limit.count(), " ms on rank ", rank_,
                                " of ", size_, " (", where, ")");
}

// ---------------------------------------------------------------------------------------------
// ProcessGroup

namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::kFloat32:
      return MPI_FLOAT;
    case DType::kBFloat16:
      return MPI_UINT16_T;
    case DType::kInt32:
      return MPI_INT32_T;
    case DType::kInt64:
      return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  auto& eng = detail::CommEngine::instance();
  if (t == DType::kBFloat16) return op == ReduceOp::kMax ? eng.bf16_max() : eng.bf16_sum();
  return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
}

// The largest element count one MPI call is given (ACC_MPI_MAX_COUNT lowers it for tests; read
// at every call, on the communication thread, so a test can change it between collectives).
int64_t max_count() {
  const int64_t v = env::get_int("ACC_MPI_MAX_COUNT", INT_MAX);
  ACC_CHECK(v >= 1 && v <= INT_MAX, "ACC_MPI_MAX_COUNT must be in [1, ", INT_MAX, "], got ", v);
  return v;
}

void check_tensor(const Tensor& t, const char* op, const char* what) {
  ACC_CHECK(t.defined(), op, ": ", what, " is undefined");
  ACC_CHECK_TYPE(!t.is_meta(), op, ": ", what, " is a meta tensor (shape ", t.shape(), ")");
  ACC_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous, got strides ", t.strides(),
            " for shape ", t.shape());
}

// Divides `x` (in place) by `n` after an average: f32 and bf16 only.
void scale_in_place(Tensor& x, int n) {
  if (n == 1) return;
  const float inv = 1.0f / static_cast<float>(n);
  const int64_t count = x.numel();  // not in the loop condition: numel() is a product each call
  if (x.dtype() == DType::kFloat32) {
    float* p = x.data<float>();
    for (int64_t i = 0; i < count; ++i) p[i] *= inv;
  } else if (x.dtype() == DType::kBFloat16) {
    BFloat16* p = x.data<BFloat16>();
    for (int64_t i = 0; i < count; ++i) p[i] = BFloat16(static_cast<float>(p[i]) * inv);
  } else {
    ACC_THROW(TypeError, "avg reduction needs a floating tensor, got ", x.dtype());
  }
}

// A contiguous MPI datatype of k elements such that n / k fits one call; k divides n.
MPI_Datatype block_type(int64_t n, DType t, int64_t* count) {
  if (n <= max_count()) {
    *count = n;
    return mpi_type(t);
  }
  int64_t k = (n + max_count() - 1) / max_count();
  while (n % k != 0) ++k;
  MPI_Datatype dt;
  detail::check_mpi(MPI_Type_contiguous(static_cast<int>(k), mpi_type(t), &dt),
                    "MPI_Type_contiguous");
  detail::check_mpi(MPI_Type_commit(&dt), "MPI_Type_commit");
  *count = n / k;
  return dt;
}

// Calls f(offset, count) for consecutive chunks of [0, n) of at most max_count() elements, at
// least once (an empty message still pairs with its peer).
template <class F>
void for_each_count_chunk(int64_t n, F f) {
  int64_t off = 0;
  do {
    const int64_t cn = std::min(max_count(), n - off);
    f(off, static_cast<int>(cn));
    off += cn;
  } while (off < n);
}

// Issues `call(ptr, count)` for consecutive chunks of x (for_each_count_chunk) and returns their
// requests.
template <class Call>
std::vector<MPI_Request> per_chunk(const Tensor& x, Call call) {
  std::vector<MPI_Request> reqs;
  char* base = static_cast<char*>(x.raw_data());
  const size_t es = element_size(x.dtype());
  for_each_count_chunk(x.numel(), [&](int64_t off, int cn) {
    reqs.push_back(call(base + off * static_cast<int64_t>(es), cn));
  });
  return reqs;
}

// Ring reduce-scatter (the bandwidth-optimal ring of Patarasuk and Yuan): W - 1 steps; in step
// s rank r sends its partial sum of chunk (r - s - 1) mod W to rank r + 1 and receives the
// partial of chunk (r - s - 2) mod W from rank r - 1, adding its own input of that chunk to it.
// After the last step it holds chunk r summed over every rank. Each rank sends and receives
// (W - 1) / W of the input once and does 1 / W of the additions. OpenMPI's libnbc
// MPI_Ireduce_scatter_block took 76 ms for 17.8M floats at 2 ranks on the development machine,
// this ring 26 ms (benchmarks/bench_collectives). The sums are in a fixed order per chunk, the same
// on every run. Messages travel on the group's algo_comm, tagged with the collective's sequence
// number so that two reduce-scatters in flight at once never match each other's messages.
class RingReduceScatter {
 public:
  RingReduceScatter(std::shared_ptr<detail::GroupState> st, Tensor out, Tensor in, ReduceOp op,
                    uint64_t seq)
      : st_(std::move(st)),
        out_(std::move(out)),
        in_(std::move(in)),
        op_(op),
        tag_(static_cast<int>(seq % 32768)),  // MPI guarantees tags up to 32767
        n_(out_.numel()),
        es_(element_size(out_.dtype())) {}

  std::vector<MPI_Request> start() {
    if (st_->size == 1) {
      if (n_ > 0) std::memcpy(out_.raw_data(), in_.raw_data(), static_cast<size_t>(n_) * es_);
      return {};
    }
    // Partial sums in flight (tracked memory): none at 2 ranks, where the one step receives
    // straight into the output; one buffer at 3; two, used in turn, beyond.
    for (int i = 0; i < std::min(2, st_->size - 2); ++i) bufs_[i] = empty({n_}, {out_.dtype()});
    return issue();
  }

  // The step's messages have arrived: add this rank's input of the received chunk, then issue
  // the next step (none after the last).
  std::vector<MPI_Request> next() {
    if (st_->size == 1) return {};
    const int W = st_->size;
    const int chunk = mod(st_->rank - step_ - 2, W);
    char* recv = recv_buffer();
    const char* mine = in_ptr(chunk);
    for_each_count_chunk(n_, [&](int64_t off, int cn) {
      const int64_t b = off * static_cast<int64_t>(es_);
      detail::check_mpi(MPI_Reduce_local(mine + b, recv + b, cn, mpi_type(out_.dtype()),
                                         mpi_op(op_, out_.dtype())),
                        "MPI_Reduce_local");
    });
    if (++step_ == W - 1) return {};
    return issue();
  }

  // On completion: the partial-sum buffers and the input go now, not when the comm thread next
  // drops the finished task (the reducer frees its full gradient buckets through this).
  void release() {
    for (auto& b : bufs_) b = Tensor();
    in_ = Tensor();
  }

 private:
  static int mod(int a, int w) { return ((a % w) + w) % w; }
  const char* in_ptr(int chunk) const {
    return static_cast<const char*>(in_.raw_data()) + chunk * n_ * static_cast<int64_t>(es_);
  }
  // Step s receives into the output at the last step, else into buffer s % 2; step s > 0 sends
  // buffer (s - 1) % 2, which holds the partial sum received and reduced in step s - 1.
  char* recv_buffer() {
    if (step_ == st_->size - 2) return static_cast<char*>(out_.raw_data());
    return static_cast<char*>(bufs_[step_ % 2].raw_data());
  }
  std::vector<MPI_Request> issue() {
    const int W = st_->size, r = st_->rank;
    const char* send = step_ == 0 ? in_ptr(mod(r - 1, W))
                                  : static_cast<const char*>(bufs_[(step_ - 1) % 2].raw_data());
    char* recv = recv_buffer();
    std::vector<MPI_Request> reqs;
    for_each_count_chunk(n_, [&](int64_t off, int cn) {
      const int64_t b = off * static_cast<int64_t>(es_);
      MPI_Request rr, sr;
      detail::check_mpi(
          MPI_Irecv(recv + b, cn, mpi_type(out_.dtype()), mod(r - 1, W), tag_, st_->algo_comm, &rr),
          "MPI_Irecv");
      reqs.push_back(rr);
      detail::check_mpi(
          MPI_Isend(send + b, cn, mpi_type(out_.dtype()), mod(r + 1, W), tag_, st_->algo_comm, &sr),
          "MPI_Isend");
      reqs.push_back(sr);
    });
    return reqs;
  }

  std::shared_ptr<detail::GroupState> st_;
  Tensor out_, in_;
  ReduceOp op_;
  int tag_;
  int64_t n_;
  size_t es_;
  int step_ = 0;
  Tensor bufs_[2];
};

using ExchangeFn = int (*)(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, MPI_Comm,
                           MPI_Request*);

// allgather and alltoall: `per_rank` elements to/from every rank in one call, counted in a
// contiguous block datatype when the count would not fit an int. `in_place`: the input is this
// rank's block of the output (MPI_IN_PLACE).
WorkPtr submit_exchange(const std::shared_ptr<detail::GroupState>& st, WorkPtr work,
                        const Tensor& output, const Tensor& input, int64_t per_rank, ExchangeFn fn,
                        const char* what, bool in_place = false) {
  work->keep_alive(output);
  work->keep_alive(input);
  auto type = std::make_shared<MPI_Datatype>(MPI_DATATYPE_NULL);
  detail::CommEngine::instance().submit(
      work,
      [st, out = output, in = input, type, per_rank, fn, what, in_place]() {
        int64_t count = 0;
        *type = block_type(per_rank, in.dtype(), &count);
        MPI_Request r;
        const void* send = in_place ? MPI_IN_PLACE : in.raw_data();
        detail::check_mpi(fn(send, static_cast<int>(count), *type, out.raw_data(),
                             static_cast<int>(count), *type, st->comm, &r),
                          what);
        return std::vector<MPI_Request>{r};
      },
      [type, in = input]() {
        if (*type != mpi_type(in.dtype())) MPI_Type_free(type.get());
      });
  return work;
}

}  // namespace

namespace detail {
struct PgAccess {
  // A collective: numbered in the group's one sequence.
  static WorkPtr make_work(GroupState& s, const std::string& op, const Tensor* t, int peer,
                           std::optional<std::chrono::milliseconds> timeout) {
    return make(s, op, t, peer, timeout, std::nullopt, -1);
  }

  // A point-to-point message: numbered among this rank's messages to (send) or from (recv) peer.
  static WorkPtr make_p2p_work(GroupState& s, P2PDirection dir, const Tensor& t, int peer, int tag,
                               std::optional<std::chrono::milliseconds> timeout) {
    return make(s, p2p_direction_name(dir), &t, peer, timeout, dir, tag);
  }

  // "rank 1", or "rank 1 (world rank 5)" where the group's ranks are not the world's.
  static std::string peer_name(const GroupState& s, int peer) {
    const int global = s.members.at(static_cast<size_t>(peer));
    return global == peer ? ::acc::detail::str_cat("rank ", peer)
                          : ::acc::detail::str_cat("rank ", peer, " (world rank ", global, ")");
  }

 private:
  static WorkPtr make(GroupState& s, const std::string& op, const Tensor* t, int peer,
                      std::optional<std::chrono::milliseconds> timeout,
                      std::optional<P2PDirection> p2p, int tag) {
    // The call's own timeout, else the group's, else the process default (read now: tests and
    // launchers set ACC_COMM_TIMEOUT_SEC before the first collective, not before init). Read
    // before anything is numbered or recorded: a bad ACC_COMM_TIMEOUT_SEC throws here.
    const auto limit = timeout ? *timeout : s.timeout ? *s.timeout : default_timeout();
    uint64_t seq = 0;
    std::string label;  // empty: the Work's "<op> (seq N)"
    if (p2p) {
      {
        std::lock_guard<std::mutex> lock(s.p2p_mu);
        GroupState::P2PCounts& c = *p2p == P2PDirection::kSend ? s.sends : s.recvs;
        if (c.numbered.size() < static_cast<size_t>(s.size)) {
          c.numbered.resize(static_cast<size_t>(s.size), 0);
          c.issued.resize(static_cast<size_t>(s.size), 0);
        }
        seq = ++c.numbered[static_cast<size_t>(peer)];
      }
      const int global = s.members.at(static_cast<size_t>(peer));
      label = ::acc::detail::str_cat(
          op, " seq ", seq, *p2p == P2PDirection::kSend ? " to rank " : " from rank ", peer,
          " (tag ", tag,
          global == peer ? std::string() : ::acc::detail::str_cat(", world rank ", global), ")");
    } else {
      seq = ++s.seq;
    }
    // Marked before the op is recorded or issued: fault injection stops a rank right here.
    progress::phase(progress::Phase::kCollective, [&] {
      if (!p2p) {
        return ::acc::detail::str_cat(op, " seq ", seq, " of ", describe_group_name(s.name));
      }
      return ::acc::detail::str_cat(op, " seq ", seq,
                                    *p2p == P2PDirection::kSend ? " to " : " from ",
                                    peer_name(s, peer), " of ", describe_group_name(s.name));
    });
    FlightRecord r;
    r.group = s.name;
    r.seq = seq;
    r.op = op;
    if (t) {
      r.bytes = static_cast<int64_t>(t->nbytes());
      r.dtype = dtype_name(t->dtype());
    }
    r.peer = peer;
    r.p2p = p2p;
    r.tag = p2p ? tag : -1;
    const size_t id = s.recorder.record(std::move(r));
    if (p2p) {
      std::lock_guard<std::mutex> lock(s.p2p_mu);
      uint64_t& issued =
          (*p2p == P2PDirection::kSend ? s.sends : s.recvs).issued[static_cast<size_t>(peer)];
      issued = std::max(issued, seq);
    }
    progress::issued();
    return std::make_shared<Work>(op, s.name, seq, s.rank, s.size, limit, &s.recorder, id,
                                  std::move(label));
  }
};

// Every operation of a meta group is refused: it has no communicator.
void check_not_meta(const GroupState& s, const char* op) {
  ACC_CHECK_TYPE(!s.meta, op, ": group '", s.name, "' is a meta group (rank ", s.rank, " of ",
                 s.size,
                 ", no communicator): it carries meta tensors only, through the differentiable "
                 "ops of acc/dist/functional.hpp");
}
}  // namespace detail

ProcessGroup::ProcessGroup(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}

ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const {
  return state_->rank;
}
int ProcessGroup::size() const {
  return state_->size;
}
const std::string& ProcessGroup::name() const {
  return state_->name;
}
const std::vector<int>& ProcessGroup::members() const {
  return state_->members;
}
bool ProcessGroup::is_meta() const {
  return state_->meta;
}
void ProcessGroup::abandon() {
  if (state_->meta) return;  // nothing was ever in flight
  detail::CommEngine::instance().abandon_group(state_->name);
}

std::shared_ptr<ProcessGroup> ProcessGroup::meta(int size, int rank, const std::string& name) {
  ACC_CHECK(size >= 1, "meta process group '", name, "': size must be >= 1, got ", size);
  ACC_CHECK(rank >= 0 && rank < size, "meta process group '", name, "': rank ", rank,
            " is not in [0, ", size, ")");
  ACC_CHECK(!name.empty(), "meta process group: the name must not be empty (size ", size, ", rank ",
            rank, ")");
  auto st = std::make_shared<detail::GroupState>();
  st->meta = true;
  st->name = name;
  st->rank = rank;
  st->size = size;
  for (int r = 0; r < size; ++r) st->members.push_back(r);
  return std::make_shared<ProcessGroup>(st);
}

FlightRecorder& ProcessGroup::flight_recorder() {
  return state_->recorder;
}
uint64_t ProcessGroup::sequence_number() const {
  return state_->seq.load();
}
uint64_t ProcessGroup::p2p_sequence_number(int peer, P2PDirection direction) const {
  std::lock_guard<std::mutex> lock(state_->p2p_mu);
  const auto& counts = (direction == P2PDirection::kSend ? state_->sends : state_->recvs).issued;
  return peer >= 0 && static_cast<size_t>(peer) < counts.size() ? counts[static_cast<size_t>(peer)]
                                                                : 0;
}

WorkPtr ProcessGroup::allreduce(Tensor& t, ReduceOp op, const CollectiveOptions& o) {
  detail::check_not_meta(*state_, "allreduce");
  check_tensor(t, "allreduce", "tensor");
  auto work = detail::PgAccess::make_work(*state_, std::string("allreduce.") + reduce_op_name(op),
                                          &t, -1, o.timeout);
  work->keep_alive(t);
  auto st = state_;
  Tensor x = t;
  detail::CommEngine::instance().submit(
      work,
      [st, x, op]() {
        return per_chunk(x, [&](char* p, int n) {
          MPI_Request r;
          detail::check_mpi(MPI_Iallreduce(MPI_IN_PLACE, p, n, mpi_type(x.dtype()),
                                           mpi_op(op, x.dtype()), st->comm, &r),
                            "MPI_Iallreduce");
          return r;
        });
      },
      [x, op, st]() mutable {
        if (op == ReduceOp::kAvg) scale_in_place(x, st->size);
      });
  return work;
}

WorkPtr ProcessGroup::reduce_scatter(Tensor& output, const Tensor& input, ReduceOp op,
                                     const CollectiveOptions& o) {
  detail::check_not_meta(*state_, "reduce_scatter");
  check_tensor(output, "reduce_scatter", "output");
  check_tensor(input, "reduce_scatter", "input");
  ACC_CHECK_TYPE(input.dtype() == output.dtype(), "reduce_scatter: input ", input.dtype(),
                 " and output ", output.dtype(), " differ");
  ACC_CHECK_SHAPE(input.numel() == output.numel() * size(), "reduce_scatter: input has ",
                  input.numel(), " elements, expected group size ", size(), " x output ",
                  output.numel());
  auto work = detail::PgAccess::make_work(
      *state_, std::string("reduce_scatter.") + reduce_op_name(op), &input, -1, o.timeout);
  work->keep_alive(output);
  work->keep_alive(input);
  auto ring = std::make_shared<RingReduceScatter>(state_, output, input, op, work->seq());
  detail::CommEngine::instance().submit(
      work, [ring] { return ring->start(); },
      [ring, out = output, op, st = state_]() mutable {
        ring->release();
        if (op == ReduceOp::kAvg) scale_in_place(out, st->size);
      },
      [ring] { return ring->next(); });
  return work;
}

WorkPtr ProcessGroup::allgather(Tensor& output, const Tensor& input, const CollectiveOptions& o) {
  detail::check_not_meta(*state_, "allgather");
  check_tensor(output, "allgather", "output");
  check_tensor(input, "allgather", "input");
  ACC_CHECK_TYPE(input.dtype() == output.dtype(), "allgather: input ", input.dtype(),
                 " and output ", output.dtype(), " differ");
  ACC_CHECK_SHAPE(output.numel() == input.numel() * size(), "allgather: output has ",
                  output.numel(), " elements, expected group size ", size(), " x input ",
                  input.numel());
  // The input may be this rank's block of the output (no copy); any other overlap is an error.
  const char* in = static_cast<const char*>(input.raw_data());
  const char* out = static_cast<const char*>(output.raw_data());
  const bool in_place = in == out + static_cast<size_t>(rank()) * input.nbytes();
  ACC_CHECK(in_place || in + input.nbytes() <= out || in >= out + output.nbytes(),
            "allgather: the input overlaps the output other than at this rank's block (rank ",
            rank(), ")");
  auto work = detail::PgAccess::make_work(*state_, "allgather", &input, -1, o.timeout);
  return submit_exchange(state_, work, output, input, input.numel(), &MPI_Iallgather,
                         "MPI_Iallgather", in_place);
}

WorkPtr ProcessGroup::broadcast(Tensor& t, int root, const CollectiveOptions& o) {
  detail::check_not_meta(*state_, "broadcast");
  check_tensor(t, "broadcast", "tensor");
  ACC_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of group '",
            name(), "' (size ", size(), ")");
  auto work = detail::PgAccess::make_work(*state_, "broadcast", &t, root, o.timeout);
  work->keep_alive(t);
  auto st = state_;
  Tensor x = t;
  detail::CommEngine::instance().submit(work, [st, x, root]() {
    return per_chunk(x, [&](char* p, int n) {
      MPI_Request r;
      detail::check_mpi(MPI_Ibcast(p, n, mpi_type(x.dtype()), root, st->comm, &r), "MPI_Ibcast");
      return r;
    });
  });
  return work;
}

WorkPtr ProcessGroup::alltoall(Tensor& output, const Tensor& input, const CollectiveOptions& o) {
  detail::check_not_meta(*state_, "alltoall");
  check_tensor(output, "alltoall", "output");
  check_tensor(input, "alltoall", "input");
  ACC_CHECK_TYPE(input.dtype() == output.dtype(), "alltoall: input ", input.dtype(), " and output ",
                 output.dtype(), " differ");
  ACC_CHECK_SHAPE(input.numel() == output.numel() && input.numel() % size() == 0,
                  "alltoall: input (", input.numel(), " elements) and output (", output.numel(),
                  ") must be equal and divisible by the group size ", size());
  auto work = detail::PgAccess::make_work(*state_, "alltoall", &input, -1, o.timeout);
  return submit_exchange(state_, work, output, input, input.numel() / size(), &MPI_Ialltoall,
                         "MPI_Ialltoall");
}

namespace {

void check_p2p(const detail::GroupState& s, const Tensor& t, int peer, int tag, const char* op,
               const char* role) {
  detail::check_not_meta(s, op);
  check_tensor(t, op, "tensor");
  ACC_CHECK(peer >= 0 && peer < s.size && peer != s.rank, op, ": ", role, " ", peer,
            " is not another rank of group '", s.name, "' (size ", s.size, ", this rank ", s.rank,
            ")");
  ACC_CHECK(tag >= 0 && tag <= ProcessGroup::kMaxTag, op, ": tag ", tag, " is not in [0, ",
            ProcessGroup::kMaxTag, "] (group '", s.name, "')");
}

// The MPI tag of a message: its tag and its sequence number (detail::p2p_tag_span).
int mpi_tag(const detail::GroupState& s, int tag, uint64_t seq) {
  return static_cast<int>(tag * s.tag_span + static_cast<int64_t>(seq % s.tag_span));
}

}  // namespace

WorkPtr ProcessGroup::send(const Tensor& t, int dst, int tag, const CollectiveOptions& o) {
  check_p2p(*state_, t, dst, tag, "send", "destination");
  auto work = detail::PgAccess::make_p2p_work(*state_, P2PDirection::kSend, t, dst, tag, o.timeout);
  work->keep_alive(t);
  auto st = state_;
  Tensor x = t;
  const int mtag = mpi_tag(*st, tag, work->seq());
  detail::CommEngine::instance().submit(work, [st, x, dst, mtag]() {
    return per_chunk(x, [&](char* p, int n) {
      MPI_Request r;
      detail::check_mpi(MPI_Isend(p, n, mpi_type(x.dtype()), dst, mtag, st->comm, &r), "MPI_Isend");
      return r;
    });
  });
  return work;
}

WorkPtr ProcessGroup::recv(Tensor& t, int src, int tag, const CollectiveOptions& o) {
  check_p2p(*state_, t, src, tag, "recv", "source");
  auto work = detail::PgAccess::make_p2p_work(*state_, P2PDirection::kRecv, t, src, tag, o.timeout);
  work->keep_alive(t);
  auto st = state_;
  Tensor x = t;
  const int mtag = mpi_tag(*st, tag, work->seq());
  // Element counts of the chunks posted, to check what arrived: MPI fails a message larger than
  // its buffer, but fills a smaller one's first elements and reports success.
  auto posted = std::make_shared<std::vector<int>>();
  detail::CommEngine::instance().submit(
      work,
      [st, x, src, mtag, posted]() {
        return per_chunk(x, [&](char* p, int n) {
          MPI_Request r;
          detail::check_mpi(MPI_Irecv(p, n, mpi_type(x.dtype()), src, mtag, st->comm, &r),
                            "MPI_Irecv");
          posted->push_back(n);
          return r;
        });
      },
      nullptr, nullptr,
      [x, posted](const std::vector<MPI_Status>& statuses) {
        int64_t got = 0, want = 0;
        bool short_chunk = false;
        for (size_t i = 0; i < statuses.size() && i < posted->size(); ++i) {
          int count = 0;
          MPI_Status status = statuses[i];
          detail::check_mpi(MPI_Get_count(&status, mpi_type(x.dtype()), &count), "MPI_Get_count");
          short_chunk = short_chunk || count != (*posted)[i];
          got += count;
          want += (*posted)[i];
        }
        const int64_t es = static_cast<int64_t>(element_size(x.dtype()));
        ACC_CHECK_AS(CommError, !short_chunk, "received ", got * es, " bytes, expected ", want * es,
                     " (", x.shape(), " ", x.dtype(), "): the sender's tensor is smaller");
      });
  return work;
}

WorkPtr ProcessGroup::barrier(const CollectiveOptions& o) {
  detail::check_not_meta(*state_, "barrier");
  auto work = detail::PgAccess::make_work(*state_, "barrier", nullptr, -1, o.timeout);
  auto st = state_;
  detail::CommEngine::instance().submit(work, [st]() {
    MPI_Request r;
    detail::check_mpi(MPI_Ibarrier(st->comm, &r), "MPI_Ibarrier");
    return std::vector<MPI_Request>{r};
  });
  return work;
}

std::shared_ptr<ProcessGroup> ProcessGroup::split(
    int color, int key, const std::string& name, std::optional<std::chrono::milliseconds> timeout) {
  detail::check_not_meta(*state_, "split");
  ACC_CHECK(!timeout || timeout->count() > 0, "split: the timeout of group '", name,
            "' must be > 0 ms, got ", timeout ? timeout->count() : 0);
  ACC_CHECK(!timeout || *timeout <= duration_ms(kMaxDurationSeconds),
            "split: the timeout of group '", name, "' must be at most ",
            duration_ms(kMaxDurationSeconds).count(), " ms (7 days: every timeout is finite), got ",
            timeout ? timeout->count() : 0);
  auto child = std::make_shared<detail::GroupState>();
  child->name = name;
  child->timeout = timeout;
  child->tag_span = state_->tag_span;
  auto st = state_;
  ++st->seq;  // a collective of this group like any other
  detail::CommEngine::instance().run_sync([&] {
    detail::check_mpi(MPI_Comm_split(st->comm, color, key, &child->comm), "MPI_Comm_split");
    detail::check_mpi(MPI_Comm_set_errhandler(child->comm, MPI_ERRORS_RETURN),
                      "MPI_Comm_set_errhandler");
    detail::check_mpi(MPI_Comm_rank(child->comm, &child->rank), "MPI_Comm_rank");
    detail::check_mpi(MPI_Comm_size(child->comm, &child->size), "MPI_Comm_size");
    child->algo_comm = detail::dup_returning_errors(child->comm);
    // Members as ranks of this group's members (so world ranks when split from the world).
    int mine = st->members.at(static_cast<size_t>(st->rank));
    child->members.assign(static_cast<size_t>(child->size), 0);
    detail::check_mpi(
        MPI_Allgather(&mine, 1, MPI_INT, child->members.data(), 1, MPI_INT, child->comm),
        "MPI_Allgather");
  });
  return std::make_shared<ProcessGroup>(child);
}

std::shared_ptr<ProcessGroup> ProcessGroup::alone(const std::string& name) const {
  auto child = std::make_shared<detail::GroupState>();
  child->name = name;
  child->timeout = state_->timeout;
  child->members = {state_->members.at(static_cast<size_t>(state_->rank))};
  detail::CommEngine::instance().run_sync([&] {
    child->comm = detail::dup_returning_errors(MPI_COMM_SELF);
    child->algo_comm = detail::dup_returning_errors(MPI_COMM_SELF);
  });
  child->rank = 0;
  child->size = 1;
  return std::make_shared<ProcessGroup>(child);
}

}  // namespace acc::dist
