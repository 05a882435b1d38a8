#pragma once
// Hooks through which a tracer watches execution: every op (forward and backward), the FLOPs and
// the communication they report, and the birth and death of every storage (meta storages included,
// so a shape-only run on the meta device has the same memory timeline as a real one). One observer
// per thread, set for the duration of a trace; with none set the hooks cost a thread-local load.
//
// The module scope stack lives here too (nn::Module pushes its dotted name when called), so that
// ops and their backward nodes know which module they belong to.

#include <cstdint>
#include <string>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc {

/// The communication a trace tells apart, in c10d's spelling. It lives here, beside the hook that
/// reports it, because the tracer (which must not depend on the dist layer) records it.
enum class CommKind { kAllreduce, kAllgather, kReduceScatter, kAlltoall, kBroadcast, kSend, kRecv };

/// "allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "send", "recv": the words
/// of the traces' JSON and of search::CommCalibration's ops.
const char* comm_kind_name(CommKind k);

/// One communication op as an observer sees it.
struct CommRecord {
  CommKind kind = CommKind::kAllreduce;
  std::string group;   // the process group's name ("tp", "pp", "world")
  int group_size = 1;  // ranks in the group
  /// Bytes of the whole buffer one rank holds for the op, as search::CommCalibration counts them
  /// (nccl-tests' "size"): the tensor all-reduced or broadcast, the output of an all-gather, the
  /// input of a reduce-scatter or an all-to-all, the message of a send or a recv. What a rank
  /// puts on the wire follows from the algorithm (a ring all-reduce sends 2 (n - 1) / n of it).
  int64_t bytes = 0;
  int peer = -1;  // send / recv: the other rank, as a rank of the group
};

}  // namespace acc

namespace acc::detail {

class OpObserver {
 public:
  virtual ~OpObserver() = default;
  /// A storage of `nbytes` was created (id unique for the process lifetime).
  virtual void on_alloc(uint64_t storage_id, size_t nbytes, Device device) = 0;
  /// A storage reported by on_alloc was destroyed.
  virtual void on_free(uint64_t storage_id) = 0;
  /// Matrix-product FLOPs of the op being executed (reported before on_op).
  virtual void on_flops(int64_t flops, bool backward) = 0;
  /// The communication of the op being executed, reported right before its on_op (a forward op's,
  /// or a backward node's as the last thing its apply does). At most one per op. Observers that do
  /// not care keep this default.
  virtual void on_comm(const CommRecord& comm) { (void)comm; }
  /// A backward node is about to run on these gradients (its on_op follows with no inputs, so that
  /// the observer holds no reference that would change what the node does with them). Nested for
  /// backward passes run inside a node (activation recomputation).
  virtual void on_backward_begin(const std::vector<Tensor>& grad_inputs) = 0;
  /// An op ran: a forward op (name of its backward node without "Backward", e.g. "Linear") or a
  /// backward node ("LinearBackward"), with the module scope it belongs to.
  virtual void on_op(const std::string& name, const std::string& scope,
                     const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs,
                     bool backward) = 0;
};

/// The observer of this thread, or null.
OpObserver* op_observer();
/// Installs `obs` for this thread (null removes it); returns the previous one.
OpObserver* set_op_observer(OpObserver* obs);

/// Installs `obs` for this thread for the guard's lifetime, then restores the previous one (also
/// when an exception unwinds the scope).
class ObserverGuard {
 public:
  explicit ObserverGuard(OpObserver* obs) : prev_(set_op_observer(obs)) {}
  ~ObserverGuard() { set_op_observer(prev_); }
  ObserverGuard(const ObserverGuard&) = delete;
  ObserverGuard& operator=(const ObserverGuard&) = delete;

 private:
  OpObserver* prev_;
};

/// Module scope stack of this thread ("" when empty).
void push_scope(std::string scope);
void pop_scope();
const std::string& current_scope();

}  // namespace acc::detail
