#pragma once
// Differentiable communication: autograd ops over a ProcessGroup, as
// torch.distributed.nn.functional and Megatron's mappings.py. Tensor-, sequence- and
// pipeline-parallel code communicates only through these, so that its backward communicates by
// itself and a trace sees every byte.
//
//   op                          forward                         backward
//   copy_to_group               identity                        all-reduce (sum)      Megatron f
//   reduce_from_group           all-reduce (sum)                identity              Megatron g
//   gather_along                all-gather along dim            this rank's slice
//   scatter_along               this rank's slice along dim     all-gather
//   allgather_along             all-gather along dim            reduce-scatter (sum)  sequence par.
//   reduce_scatter_along        reduce-scatter (sum) along dim  all-gather
//   alltoall_along              all-to-all (Ulysses)            the inverse all-to-all
//   send_to / recv_from         a message to / from a peer      the gradient the other way
//
// Contracts:
//  - Every rank of the group calls the same ops in the same order with tensors of the same shape
//    and dtype (the group's collective contract); slices are in rank order: rank r holds elements
//    [r n, (r + 1) n) of a dimension split into pieces of n.
//  - A dimension split over the group (scatter_along, reduce_scatter_along, alltoall_along's
//    scatter_dim) must divide evenly: anything else throws acc::ShapeError naming the op, the
//    dimension, its size and the group's name and size, before anything is communicated.
//  - Tensors are f32 or bf16 (anything else: acc::TypeError); bf16 sums accumulate in f32 and
//    round back (ProcessGroup). Inputs of any layout are accepted; outputs are new contiguous
//    tensors, except copy_to_group's, an identity that shares x's storage as a view would (and
//    reduce_from_group's backward, which passes the gradient on as it is).
//  - Each call waits for its communication with the group's timeout (ProcessGroup::split's, else
//    ACC_COMM_TIMEOUT_SEC): a stall throws acc::TimeoutError naming the op, its sequence number and
//    the group, never hangs. Forward and backward communicate synchronously; overlapping them with
//    computation is the caller's schedule's business.
//  - Meta tensors (Device::kMeta) move nothing: each op returns meta tensors of the right shapes
//    and reports its communication to the tracer (acc/tensor/observer.hpp's on_comm: kind, group
//    name and size, bytes), in forward and in backward, on a real or a meta group
//    (ProcessGroup::meta). A cpu tensor on a meta group throws acc::TypeError naming the group.
//
// Pipeline boundaries (send_to / recv_from). PyTorch's pipelining sends outside autograd; here
// the messages are autograd ops, so a stage is an ordinary graph from what it receives to what it
// sends, and its backward is driven by the gradient that comes back:
//
//   stage 0:  Tensor y = linear(x, w0);  Tensor h = dist::send_to(y, 1, pp);  h.backward();
//   stage 1:  Tensor y = dist::recv_from(shape, {.requires_grad = true}, 0, pp);
//             Tensor loss = ...(y);  loss.backward();       // sends dL/dy back to stage 0
//
// send_to returns a handle: a 0-d f32 zero whose backward receives x's gradient from the peer and
// carries it into x's graph (h.backward() with no argument; with several sends and a loss,
// autograd::backward({loss, h1, h2}, {})). recv_from returns the received tensor; with
// options.requires_grad its backward sends its gradient back to the source. A middle stage does
// both: h = send_to(f(recv_from(...)), next); h.backward().
//
// Messages are matched by order and tag: the n-th message from rank a to rank b on a group pairs
// with b's n-th receive from a (ProcessGroup's point-to-point sequence numbers, per peer and
// direction, part of the MPI tag), and only when their tags agree. Activations travel with
// ProcessGroup tag 2 x tag, gradients with 2 x tag + 1, so a gradient never matches a receive of
// an activation even when both go the same way (interleaved schedules). Both stages must issue a
// pair's messages in the same order (a schedule does); a receive posted for the wrong message
// waits and times out naming its sequence number and peer. The forward send is not waited for
// when its gradient is wanted (a stage that sends an activation and then receives a gradient from
// the same peer must not block on the send: the peer may be sending to it at the same moment);
// its backward waits for it before receiving the gradient. Without a gradient to come back (no
// grad mode, or x not requiring grad) send_to waits for its message before returning. recv_from's
// backward waits for its gradient's message (the peer's backward is receiving it), unless a
// DeferredSends is installed on the thread: then it posts the message, hands it over and goes on
// (a pipeline schedule needs that: in Megatron's interleaved 1F1B two ranks send each other
// gradients at the same moment, and two waiting sends would deadlock). Every
// recv_from that requires grad must be reached by its stage's backward (its gradient is what the
// peer's backward waits for).

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "acc/dist/process_group.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::dist {

/// Tags of send_to / recv_from are 0..kMaxP2PTag (half of ProcessGroup's: each uses two).
inline constexpr int kMaxP2PTag = ProcessGroup::kMaxTag / 2;

// ---- tensor parallelism ----

/// Identity; backward all-reduces (sums) the gradient over `group`. Where a replicated input
/// enters a column-parallel layer (Megatron's f).
Tensor copy_to_group(const Tensor& x, const ProcessGroupPtr& group);
/// x summed over `group` (all-reduce); backward passes the gradient through. The partial outputs
/// of a row-parallel layer (Megatron's g).
Tensor reduce_from_group(const Tensor& x, const ProcessGroupPtr& group);
/// The ranks' x concatenated along `dim` in rank order (all-gather: size(dim) x W); backward keeps
/// this rank's slice of the gradient (the consumers of the gathered tensor are replicated).
Tensor gather_along(const Tensor& x, int64_t dim, const ProcessGroupPtr& group);
/// This rank's slice of x along `dim` (size(dim) / W); backward all-gathers the gradient.
Tensor scatter_along(const Tensor& x, int64_t dim, const ProcessGroupPtr& group);

// ---- sequence parallelism ----

/// As gather_along forward; backward reduce-scatters (sums) the gradient along `dim`: every
/// rank's consumers contributed to every slice (Megatron-SP's all-gather before a column-parallel
/// layer).
Tensor allgather_along(const Tensor& x, int64_t dim, const ProcessGroupPtr& group);
/// x summed over `group`, this rank keeping its slice along `dim` (reduce-scatter); backward
/// all-gathers the gradient (Megatron-SP's reduce-scatter after a row-parallel layer).
Tensor reduce_scatter_along(const Tensor& x, int64_t dim, const ProcessGroupPtr& group);
/// All-to-all: x split into W pieces along `scatter_dim`, piece j to rank j; the pieces received
/// concatenated along `gather_dim` in rank order (size(scatter_dim) / W, size(gather_dim) x W).
/// DeepSpeed-Ulysses: (B, T/W, NH, HS) -> (B, T, NH/W, HS) with scatter_dim 2, gather_dim 1.
/// Backward: the inverse, alltoall_along(grad, gather_dim, scatter_dim).
Tensor alltoall_along(const Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                      const ProcessGroupPtr& group);

// ---- pipeline parallelism ----

/// Sends x to rank `dst` of `group` (the file comment: order, tags, when it waits) and returns the
/// handle: a 0-d f32 zero whose backward receives x's gradient from `dst`. Throws acc::ValueError
/// for a peer that is not another rank of the group or a tag outside [0, kMaxP2PTag].
Tensor send_to(const Tensor& x, int dst, const ProcessGroupPtr& group, int tag = 0);
/// Receives a tensor of `shape` and options.dtype (f32 or bf16) from rank `src` of `group`, on
/// options.device (kMeta: nothing received, for a trace). With options.requires_grad (and grad
/// mode on) it carries a backward that sends its gradient to `src`. A message of another size
/// fails with acc::CommError naming both sizes.
Tensor recv_from(const Shape& shape, TensorOptions options, int src, const ProcessGroupPtr& group,
                 int tag = 0);

/// A receive posted ahead of the recv_from that takes it, so that the message arrives while the
/// caller computes (a pipeline stage posts its next activation's receive as it takes this one).
/// Posting it takes its place in the order of messages from `src` (the file comment): every
/// message from `src` that comes before it must be posted before it.
struct PostedRecv {
  Tensor buffer;  // the message, once the work completes
  WorkPtr work;   // null for a meta tensor
  int src = -1;
  int tag = 0;
  ProcessGroupPtr group;
  TensorOptions options;
};
/// Posts the receive recv_from(shape, options, src, group, tag) would make, without waiting.
/// Throws as recv_from does.
PostedRecv post_recv(const Shape& shape, TensorOptions options, int src,
                     const ProcessGroupPtr& group, int tag = 0);
/// recv_from of a posted receive: waits for it, and with posted.options.requires_grad (and grad
/// mode on) carries the backward that sends its gradient back to the source.
Tensor recv_from(PostedRecv posted);

/// Gradient receives posted ahead of the send_to backwards that take them. While one is installed
/// on the thread, send_to's backward takes the oldest receive posted here for its group, peer and
/// tag instead of posting its own, so the gradient can arrive while the caller computes (a
/// pipeline stage posts its next backward's as it runs this one). The order rule of PostedRecv
/// holds: post them in the order the peer sends. Destroying one drops what is left unwaited (the
/// engine keeps the buffers). One per thread at a time (acc::ValueError otherwise).
class PostedGradients {
 public:
  PostedGradients();
  ~PostedGradients();
  PostedGradients(const PostedGradients&) = delete;
  PostedGradients& operator=(const PostedGradients&) = delete;
  /// Posts the receive of the gradient of x, sent by send_to(x, dst, group, tag): `shape` and
  /// `options` are x's.
  void post(const Shape& shape, TensorOptions options, int dst, const ProcessGroupPtr& group,
            int tag = 0);
  /// The oldest receive posted for (group, peer, tag), removed; nullopt when none.
  std::optional<PostedRecv> take(const std::string& group, int peer, int tag);
  size_t pending() const { return posted_.size(); }
  /// The one installed on this thread (null when none).
  static PostedGradients* current();

 private:
  std::vector<std::pair<std::tuple<std::string, int, int>, PostedRecv>> posted_;
};

/// While one is alive, recv_from's backward on this thread does not wait for the gradient message
/// it posts but adds it here; wait() waits for them all (a pipeline schedule calls it at the end of
/// its step). Each keeps its tensor alive until it completes. Destroying one with messages not
/// waited for drops them unwaited (the communication engine keeps their tensors: ProcessGroup's
/// contract), which is what an exception unwinding a step does; the next message to or from that
/// peer then times out naming it. One per thread at a time (acc::ValueError otherwise).
class DeferredSends {
 public:
  DeferredSends();
  ~DeferredSends();
  DeferredSends(const DeferredSends&) = delete;
  DeferredSends& operator=(const DeferredSends&) = delete;
  /// Adds a posted message.
  void add(WorkPtr work);
  /// Drops the messages that completed (a schedule calls it between actions, so a long step does
  /// not keep every gradient it sent).
  void prune();
  /// Waits for every message: throws what Work::wait throws (acc::TimeoutError naming the send).
  void wait();
  size_t pending() const { return works_.size(); }
  /// The one installed on this thread (null when none).
  static DeferredSends* current();

 private:
  std::vector<WorkPtr> works_;
};

}  // namespace acc::dist
