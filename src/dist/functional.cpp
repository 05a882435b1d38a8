// The differentiable collectives of acc/dist/functional.hpp (send_to / recv_from: p2p.cpp). Each
// public op checks its arguments, computes its output with one of the moves below (which handle
// meta tensors by shape and report their communication last) and records its backward, whose
// closure captures only the group and the dimensions.

#include "acc/dist/functional.hpp"
#include "acc/autograd/ops.hpp"
#include "functional_util.hpp"

namespace acc::dist {
namespace {

using detail::report_comm;

Shape with_size(Shape s, int64_t dim, int64_t size) {
  s[static_cast<size_t>(dim)] = size;
  return s;
}

// The size of each rank's piece of dimension `dim`, refusing one that does not divide evenly.
int64_t piece_size(const Tensor& x, int64_t dim, const ProcessGroup& g, const char* op) {
  const int64_t n = x.size(dim);
  ACC_CHECK_SHAPE(n % g.size() == 0, op, ": dimension ", dim, " of size ", n,
                  " does not split evenly over group '", g.name(), "' of ", g.size(),
                  " ranks (shape ", x.shape(), ")");
  return n / g.size();
}

// x as consecutive blocks, block j its j-th piece along `dim` (contiguous): the layout of
// ProcessGroup's reduce_scatter input and alltoall buffers. No copy when dim is 0.
Tensor blocks_along(const Tensor& xc, int64_t dim, int ranks) {
  if (dim == 0) return xc.view({xc.numel()});
  std::vector<Tensor> blocks;
  for (const Tensor& c : chunk(xc, ranks, dim)) blocks.push_back(c.contiguous().view({-1}));
  return cat(blocks, 0);
}

// The inverse: consecutive blocks of shape `piece` joined along `dim`.
Tensor join_blocks(const Tensor& flat, const Shape& piece, int64_t dim, int ranks) {
  const int64_t n = numel_of(piece);
  if (dim == 0) {
    Shape whole = piece;
    whole[0] *= ranks;
    return flat.view(whole);
  }
  std::vector<Tensor> pieces;
  for (int j = 0; j < ranks; ++j) pieces.push_back(flat.narrow(0, j * n, n).view(piece));
  return cat(pieces, dim);
}

// ---- the moves: no autograd, meta tensors by shape, communication reported last ----

Tensor allreduce_sum(const Tensor& x, ProcessGroup& g) {
  NoGradGuard no_grad;
  Tensor out;
  if (x.is_meta()) {
    out = empty(x.shape(), x.options());
  } else {
    out = x.detach().clone();
    g.allreduce(out, ReduceOp::kSum)->wait();
  }
  report_comm(CommKind::kAllreduce, g, static_cast<int64_t>(out.nbytes()));
  return out;
}

Tensor allgather_dim(const Tensor& x, int64_t dim, ProcessGroup& g) {
  NoGradGuard no_grad;
  const Shape whole = with_size(x.shape(), dim, x.size(dim) * g.size());
  Tensor out;
  if (x.is_meta()) {
    // What the real path holds at once, so a trace's peak sees it: the received blocks and, along
    // a dimension other than 0, the joined copy.
    Tensor flat = dim != 0 ? empty({numel_of(whole)}, x.options()) : Tensor();
    out = empty(whole, x.options());
  } else {
    Tensor xc = x.detach().contiguous();
    Tensor flat = empty({xc.numel() * g.size()}, xc.options());
    g.allgather(flat, xc)->wait();
    out = join_blocks(flat, xc.shape(), dim, g.size());
  }
  report_comm(CommKind::kAllgather, g, static_cast<int64_t>(out.nbytes()));
  return out;
}

Tensor reduce_scatter_dim(const Tensor& x, int64_t dim, int64_t piece, ProcessGroup& g) {
  NoGradGuard no_grad;
  const Shape mine = with_size(x.shape(), dim, piece);
  Tensor out;
  if (x.is_meta()) {
    // As the real path: along a dimension other than 0, the blocks are copied out (chunks, then
    // their concatenation) and the concatenation stays while this rank's piece is received.
    Tensor in;
    if (dim != 0) {
      Tensor chunks = empty(x.shape(), x.options());
      in = empty(x.shape(), x.options());
    }
    out = empty(mine, x.options());
  } else {
    Tensor in = blocks_along(x.detach().contiguous(), dim, g.size());
    out = empty(mine, x.options());
    g.reduce_scatter(out, in, ReduceOp::kSum)->wait();
  }
  report_comm(CommKind::kReduceScatter, g, static_cast<int64_t>(x.nbytes()));
  return out;
}

// This rank's piece of x along dim: no communication.
Tensor slice_dim(const Tensor& x, int64_t dim, int64_t piece, const ProcessGroup& g) {
  NoGradGuard no_grad;
  if (x.is_meta()) return empty(with_size(x.shape(), dim, piece), x.options());
  return x.detach().narrow(dim, g.rank() * piece, piece).clone();
}

Tensor alltoall_dims(const Tensor& x, int64_t scatter_dim, int64_t gather_dim, int64_t piece,
                     ProcessGroup& g) {
  NoGradGuard no_grad;
  const Shape received = with_size(x.shape(), scatter_dim, piece);
  Tensor out;
  if (x.is_meta()) {
    out =
        empty(with_size(received, gather_dim, received[static_cast<size_t>(gather_dim)] * g.size()),
              x.options());
  } else {
    Tensor send = blocks_along(x.detach().contiguous(), scatter_dim, g.size());
    Tensor recv = empty({send.numel()}, x.options());
    g.alltoall(recv, send)->wait();
    out = join_blocks(recv, received, gather_dim, g.size());
  }
  report_comm(CommKind::kAlltoall, g, static_cast<int64_t>(x.nbytes()));
  return out;
}

using Grads = std::vector<Tensor>;
using Needs = std::vector<bool>;

// Checks shared by the ops with a dimension; returns it wrapped.
int64_t checked_dim(const Tensor& x, int64_t dim, const ProcessGroupPtr& group, const char* op) {
  detail::check_group(group, op);
  detail::check_tensor_on(x, *group, op, "x");
  ACC_CHECK_SHAPE(x.dim() > 0, op, ": x must have a dimension to split or join, got shape ",
                  x.shape());
  return wrap_dim(dim, x.dim());
}

}  // namespace

Tensor copy_to_group(const Tensor& x, const ProcessGroupPtr& group) {
  detail::check_group(group, "copy_to_group");
  detail::check_tensor_on(x, *group, "copy_to_group", "x");
  // The identity shares x's storage, as a view would: nothing is copied.
  Tensor out = x.detach();
  autograd::record_op("CopyToGroupBackward", {x}, {out}, [group](const Grads& g, const Needs&) {
    return Grads{allreduce_sum(g[0], *group)};
  });
  return out;
}

Tensor reduce_from_group(const Tensor& x, const ProcessGroupPtr& group) {
  detail::check_group(group, "reduce_from_group");
  detail::check_tensor_on(x, *group, "reduce_from_group", "x");
  Tensor out = allreduce_sum(x, *group);
  autograd::record_op("ReduceFromGroupBackward", {x}, {out},
                      [](const Grads& g, const Needs&) { return Grads{g[0]}; });
  return out;
}

Tensor gather_along(const Tensor& x, int64_t dim, const ProcessGroupPtr& group) {
  dim = checked_dim(x, dim, group, "gather_along");
  const int64_t piece = x.size(dim);
  Tensor out = allgather_dim(x, dim, *group);
  autograd::record_op("GatherAlongBackward", {x}, {out},
                      [group, dim, piece](const Grads& g, const Needs&) {
                        return Grads{slice_dim(g[0], dim, piece, *group)};
                      });
  return out;
}

Tensor scatter_along(const Tensor& x, int64_t dim, const ProcessGroupPtr& group) {
  dim = checked_dim(x, dim, group, "scatter_along");
  const int64_t piece = piece_size(x, dim, *group, "scatter_along");
  Tensor out = slice_dim(x, dim, piece, *group);
  autograd::record_op("ScatterAlongBackward", {x}, {out},
                      [group, dim](const Grads& g, const Needs&) {
                        return Grads{allgather_dim(g[0], dim, *group)};
                      });
  return out;
}

Tensor allgather_along(const Tensor& x, int64_t dim, const ProcessGroupPtr& group) {
  dim = checked_dim(x, dim, group, "allgather_along");
  const int64_t piece = x.size(dim);
  Tensor out = allgather_dim(x, dim, *group);
  autograd::record_op("AllgatherAlongBackward", {x}, {out},
                      [group, dim, piece](const Grads& g, const Needs&) {
                        return Grads{reduce_scatter_dim(g[0], dim, piece, *group)};
                      });
  return out;
}

Tensor reduce_scatter_along(const Tensor& x, int64_t dim, const ProcessGroupPtr& group) {
  dim = checked_dim(x, dim, group, "reduce_scatter_along");
  const int64_t piece = piece_size(x, dim, *group, "reduce_scatter_along");
  Tensor out = reduce_scatter_dim(x, dim, piece, *group);
  autograd::record_op("ReduceScatterAlongBackward", {x}, {out},
                      [group, dim](const Grads& g, const Needs&) {
                        return Grads{allgather_dim(g[0], dim, *group)};
                      });
  return out;
}

Tensor alltoall_along(const Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                      const ProcessGroupPtr& group) {
  scatter_dim = checked_dim(x, scatter_dim, group, "alltoall_along");
  gather_dim = wrap_dim(gather_dim, x.dim());
  const int64_t piece = piece_size(x, scatter_dim, *group, "alltoall_along");
  Tensor out = alltoall_dims(x, scatter_dim, gather_dim, piece, *group);
  // The backward splits the gathered dimension back into the pieces it was joined from.
  const int64_t gathered_piece = out.size(gather_dim) / group->size();
  autograd::record_op(
      "AlltoallAlongBackward", {x}, {out},
      [group, scatter_dim, gather_dim, gathered_piece](const Grads& g, const Needs&) {
        return Grads{alltoall_dims(g[0], gather_dim, scatter_dim, gathered_piece, *group)};
      });
  return out;
}

}  // namespace acc::dist
