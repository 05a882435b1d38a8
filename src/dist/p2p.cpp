// send_to and recv_from of acc/dist/functional.hpp: pipeline boundaries as autograd ops. An
// activation travels with ProcessGroup tag 2 x tag, its gradient back with 2 x tag + 1.

#include <memory>
#include <optional>
#include <tuple>

#include "acc/autograd/ops.hpp"
#include "acc/dist/functional.hpp"
#include "acc/tensor/node.hpp"
#include "functional_util.hpp"

namespace acc::dist {
namespace {

using Grads = std::vector<Tensor>;
using Needs = std::vector<bool>;

int activation_tag(int tag) {
  return 2 * tag;
}
int gradient_tag(int tag) {
  return 2 * tag + 1;
}

void check_p2p(const ProcessGroupPtr& group, int peer, int tag, const char* op, const char* role) {
  detail::check_group(group, op);
  ACC_CHECK(peer >= 0 && peer < group->size() && peer != group->rank(), op, ": ", role, " ", peer,
            " is not another rank of group '", group->name(), "' (size ", group->size(),
            ", this rank ", group->rank(), ")");
  ACC_CHECK(tag >= 0 && tag <= kMaxP2PTag, op, ": tag ", tag, " is not in [0, ", kMaxP2PTag,
            "] (group '", group->name(), "')");
}

// The message of `x` (contiguous) to `peer`, or nothing for a meta tensor; the send is reported.
WorkPtr send_message(const Tensor& x, int peer, int mpi_tag, ProcessGroup& g) {
  WorkPtr work;
  if (!x.is_meta()) work = g.send(x, peer, mpi_tag);
  detail::report_comm(CommKind::kSend, g, static_cast<int64_t>(x.nbytes()), peer);
  return work;
}

// A tensor of `shape` received from `peer` (empty for meta); the receive is reported.
Tensor recv_message(const Shape& shape, TensorOptions options, int peer, int mpi_tag,
                    ProcessGroup& g) {
  options.requires_grad = false;
  Tensor t = empty(shape, options);
  if (!t.is_meta()) g.recv(t, peer, mpi_tag)->wait();
  detail::report_comm(CommKind::kRecv, g, static_cast<int64_t>(t.nbytes()), peer);
  return t;
}

// A receive of a message of `shape` from `peer` with ProcessGroup tag `mpi_tag`, posted (nothing
// for meta); reported to the tracer.
PostedRecv post_message(const Shape& shape, TensorOptions options, int peer, int tag, int mpi_tag,
                        const ProcessGroupPtr& group) {
  PostedRecv p;
  p.src = peer;
  p.tag = tag;
  p.group = group;
  p.options = options;
  TensorOptions buffer_options = options;
  buffer_options.requires_grad = false;
  NoGradGuard no_grad;
  p.buffer = empty(shape, buffer_options);
  if (!p.buffer.is_meta()) p.work = group->recv(p.buffer, peer, mpi_tag);
  detail::report_comm(CommKind::kRecv, *group, static_cast<int64_t>(p.buffer.nbytes()), peer);
  return p;
}

}  // namespace

Tensor send_to(const Tensor& x, int dst, const ProcessGroupPtr& group, int tag) {
  check_p2p(group, dst, tag, "send_to", "destination");
  detail::check_tensor_on(x, *group, "send_to", "x");
  Tensor handle;
  WorkPtr work;
  {
    NoGradGuard no_grad;
    handle = zeros({}, {DType::kFloat32, x.is_meta() ? Device::kMeta : Device::kCPU});
    work = send_message(x.detach().contiguous(), dst, activation_tag(tag), *group);
  }
  const Shape shape = x.shape();
  const TensorOptions options = x.options();
  const bool recorded = autograd::record_op(
      "SendToBackward", {x}, {handle},
      [group, dst, tag, shape, options, work](const Grads&, const Needs&) {
        // The activation went first: by the time the gradient comes the peer has it, so this
        // wait ends at once unless the peer never received it (then it times out naming it).
        if (work) work->wait();
        if (PostedGradients* posted = PostedGradients::current()) {
          if (std::optional<PostedRecv> r = posted->take(group->name(), dst, tag)) {
            if (r->work) r->work->wait();
            ACC_CHECK_SHAPE(r->buffer.shape() == shape, "send_to: the gradient posted for tag ",
                            tag, " from rank ", dst, " has shape ", r->buffer.shape(),
                            ", the activation sent was ", shape);
            return Grads{r->buffer};
          }
        }
        return Grads{recv_message(shape, options, dst, gradient_tag(tag), *group)};
      });
  // No gradient will come back to wait in: wait for the message here (a one-way send cannot be
  // part of a cycle of sends waiting for each other).
  if (!recorded && work) work->wait();
  return handle;
}

PostedRecv post_recv(const Shape& shape, TensorOptions options, int src,
                     const ProcessGroupPtr& group, int tag) {
  check_p2p(group, src, tag, "recv_from", "source");
  ACC_CHECK_TYPE(options.dtype == DType::kFloat32 || options.dtype == DType::kBFloat16,
                 "recv_from: dtype must be f32 or bf16, got ", options.dtype);
  ACC_CHECK_TYPE(options.device == Device::kMeta || !group->is_meta(), "recv_from: a ",
                 options.device, " tensor cannot be received on group '", group->name(),
                 "', a meta group (rank ", group->rank(), " of ", group->size(),
                 ", no communicator): pass device kMeta");
  return post_message(shape, options, src, tag, activation_tag(tag), group);
}

Tensor recv_from(PostedRecv posted) {
  if (posted.work) posted.work->wait();
  Tensor out = posted.buffer;
  const ProcessGroupPtr group = posted.group;
  const int src = posted.src, tag = posted.tag;
  const TensorOptions options = posted.options;
  const bool wants_grad = options.requires_grad && GradMode::is_enabled();
  // The op as the tracer sees it (record_op records no node: the op has no inputs).
  autograd::record_op("RecvFromBackward", {}, {out}, nullptr);
  if (!wants_grad) return out;
  // A node with no inputs: its backward only sends the gradient back to the source.
  const TensorOptions grad_options{options.dtype, options.device, false};
  auto node = std::make_shared<autograd::FunctionNode>(
      "RecvFromBackward", [group, src, tag, grad_options](const Grads& g, const Needs&) {
        NoGradGuard no_grad;
        Tensor grad = g[0].detach();
        if (grad.dtype() != grad_options.dtype) grad = grad.to(grad_options.dtype);
        WorkPtr work = send_message(grad.contiguous(), src, gradient_tag(tag), *group);
        if (work && DeferredSends::current() != nullptr) {
          DeferredSends::current()->add(std::move(work));
        } else if (work) {
          work->wait();
        }
        return Grads{};
      });
  node->set_scope(acc::detail::current_scope());
  node->set_num_outputs(1);
  node->add_output(out.shape(), grad_options);
  AutogradMeta& meta = out.autograd_meta();
  meta.grad_fn = node;
  meta.output_nr = 0;
  return out;
}

Tensor recv_from(const Shape& shape, TensorOptions options, int src, const ProcessGroupPtr& group,
                 int tag) {
  return recv_from(post_recv(shape, options, src, group, tag));
}

namespace {
thread_local DeferredSends* installed = nullptr;
thread_local PostedGradients* installed_gradients = nullptr;
}  // namespace

PostedGradients::PostedGradients() {
  ACC_CHECK(installed_gradients == nullptr,
            "PostedGradients: one is already installed on this thread (nested pipeline steps?)");
  installed_gradients = this;
}

PostedGradients::~PostedGradients() {
  installed_gradients = nullptr;
}

PostedGradients* PostedGradients::current() {
  return installed_gradients;
}

void PostedGradients::post(const Shape& shape, TensorOptions options, int dst,
                           const ProcessGroupPtr& group, int tag) {
  check_p2p(group, dst, tag, "send_to", "destination");
  options.requires_grad = false;
  posted_.emplace_back(std::make_tuple(group->name(), dst, tag),
                       post_message(shape, options, dst, tag, gradient_tag(tag), group));
}

std::optional<PostedRecv> PostedGradients::take(const std::string& group, int peer, int tag) {
  const auto key = std::make_tuple(group, peer, tag);
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (it->first != key) continue;
    PostedRecv r = std::move(it->second);
    posted_.erase(it);
    return r;
  }
  return std::nullopt;
}

DeferredSends::DeferredSends() {
  ACC_CHECK(installed == nullptr,
            "DeferredSends: one is already installed on this thread (nested pipeline steps?)");
  installed = this;
}

DeferredSends::~DeferredSends() {
  installed = nullptr;
}

DeferredSends* DeferredSends::current() {
  return installed;
}

void DeferredSends::add(WorkPtr work) {
  works_.push_back(std::move(work));
}

void DeferredSends::prune() {
  std::erase_if(works_, [](const WorkPtr& w) { return w->is_completed(); });
}

void DeferredSends::wait() {
  for (auto& w : works_) w->wait();
  works_.clear();
}

}  // namespace acc::dist
