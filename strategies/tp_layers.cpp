#include "tp_layers.hpp"

#include <algorithm>
#include <cmath>

#include "acc/autograd/ops.hpp"
#include "acc/dist/functional.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"

namespace acc::strategies {
namespace {

void check_args(const std::vector<nn::RowBlock>& blocks, const dist::ProcessGroupPtr& group,
                const char* what) {
  ACC_CHECK(group != nullptr, what, ": the group is null");
  ACC_CHECK(!blocks.empty(), what, ": no blocks of the weight to keep");
}

}  // namespace

nn::RowBlock even_block(int64_t size, int parts, int rank, const char* what) {
  ACC_CHECK(parts >= 1 && rank >= 0 && rank < parts, what, ": rank ", rank, " of ", parts);
  ACC_CHECK(size % parts == 0, what, ": ", size, " is not a multiple of ", parts);
  const int64_t each = size / parts;
  return {rank * each, each};
}

ColumnParallelLinear::ColumnParallelLinear(nn::Linear& whole,
                                           const std::vector<nn::RowBlock>& blocks,
                                           dist::ProcessGroupPtr group,
                                           dist::ProcessGroupPtr sharers)
    : Module("ColumnParallelLinear"), group_(std::move(group)), sharers_(std::move(sharers)) {
  check_args(blocks, group_, "ColumnParallelLinear");
  NoGradGuard ng;
  const Tensor& w = whole.weight();
  const Tensor& b = whole.bias();
  weight_ = register_parameter("weight", nn::gather_rows(w, blocks));
  if (b.defined()) bias_ = register_parameter("bias", nn::gather_rows(b, blocks));
  if (sharers_ && sharers_->size() > 1) {
    // Each gradient summed over the sharers as it reaches the parameter (Megatron's f on the
    // weight: copy_to_group's backward). Not copy_to_group(weight_) in forward: its identity is a
    // tensor of its own sharing the weight's storage, which linear saves for backward, so it kept
    // the storage the weight had in forward. Under fsdp that was the block's gathered parameters,
    // alive after fsdp released them (every block's, through the forward) and beside the block
    // gathered again for backward: 5-12 % over the memory model's peak at tp 2 and 4
    // (search_space_mpi_test's FsdpOverKvHeadsSharedByTensorParallelRanksIsWithinFivePercent).
    for (Tensor* p : {&weight_, &bias_}) {
      if (!p->defined()) continue;
      p->register_grad_hook([group = sharers_](const Tensor& g) {
        NoGradGuard ng;
        return dist::reduce_from_group(g, group);
      });
    }
  }
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  const Tensor in =
      sequence_parallel_ ? dist::allgather_along(x, 1, group_) : dist::copy_to_group(x, group_);
  return linear(in, weight_, bias_);
}

RowParallelLinear::RowParallelLinear(nn::Linear& whole, const std::vector<nn::RowBlock>& blocks,
                                     dist::ProcessGroupPtr group)
    : Module("RowParallelLinear"), group_(std::move(group)) {
  check_args(blocks, group_, "RowParallelLinear");
  NoGradGuard ng;
  const Tensor& w = whole.weight();
  const Tensor& b = whole.bias();
  // Columns of W are rows of W^T.
  const Tensor columns = nn::gather_rows(w.transpose(0, 1).contiguous(), blocks);
  weight_ = register_parameter("weight", columns.transpose(0, 1).contiguous());
  if (b.defined()) bias_ = register_parameter("bias", b.clone());
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  Tensor y = sequence_parallel_ ? dist::reduce_scatter_along(linear(x, weight_), 1, group_)
                                : dist::reduce_from_group(linear(x, weight_), group_);
  return bias_.defined() ? add(y, bias_) : y;
}

std::pair<Tensor, int64_t> padded_vocab_rows(const Tensor& w, const dist::ProcessGroup& group) {
  const int W = group.size();
  const int64_t vocab = w.size(0);
  const int64_t rows = (vocab + W - 1) / W;  // Vp / W
  const int64_t first = group.rank() * rows;
  NoGradGuard ng;
  Tensor mine = zeros({rows, w.size(1)});
  const int64_t real = std::clamp<int64_t>(vocab - first, 0, rows);
  if (real > 0) mine.narrow(0, 0, real).copy_(w.narrow(0, first, real));
  return {mine, first};
}

VocabParallelEmbedding::VocabParallelEmbedding(nn::Embedding& whole, dist::ProcessGroupPtr group)
    : nn::Embedding("VocabParallelEmbedding",
                    group ? padded_vocab_rows(whole.weight(), *group).first : Tensor()),
      group_(std::move(group)) {
  ACC_CHECK(group_ != nullptr, "VocabParallelEmbedding: the group is null");
  vocab_ = whole.weight().size(0);
  first_ = group_->rank() * weight().size(0);
}

Tensor VocabParallelEmbedding::attend(const Tensor& h) {
  return linear(dist::copy_to_group(h, group_), weight());
}

VocabParallelHead::VocabParallelHead(nn::Linear& whole, dist::ProcessGroupPtr group)
    : Module("VocabParallelHead"), group_(std::move(group)) {
  ACC_CHECK(group_ != nullptr, "VocabParallelHead: the group is null");
  ACC_CHECK(!whole.bias().defined(), "VocabParallelHead: the output projection has a bias (",
            whole.bias().shape(), "): a vocabulary-parallel head takes none");
  auto [rows, first] = padded_vocab_rows(whole.weight(), *group_);
  first_ = first;
  weight_ = register_parameter("weight", rows);
}

Tensor VocabParallelHead::forward(const Tensor& x) {
  return linear(dist::copy_to_group(x, group_), weight_);
}

namespace {

// Rows local[n] of `table` where local[n] >= 0, zero rows elsewhere: (N, C). Backward adds each
// looked-up row's gradient into its table row. One op, so nothing but the ids is kept for
// backward (a lookup multiplied by a mask would keep the lookup's whole output alive).
Tensor masked_lookup(const Tensor& table, std::vector<int64_t> local) {
  const auto N = static_cast<int64_t>(local.size());
  const int64_t C = table.size(1);
  Tensor out = zeros({N, C});
  {
    const Tensor t = table.contiguous();
    const float* src = t.data<float>();
    float* dst = out.data<float>();
    parallel_for(N, std::max<int64_t>(1, 8192 / std::max<int64_t>(C, 1)),
                 [&](int64_t b, int64_t e) {
                   for (int64_t n = b; n < e; ++n) {
                     const int64_t row = local[static_cast<size_t>(n)];
                     if (row >= 0) std::copy(src + row * C, src + (row + 1) * C, dst + n * C);
                   }
                 });
  }
  autograd::record_op("VocabParallelEmbeddingBackward", {table}, {out},
                      [local = std::move(local), shape = table.shape(), C](
                          const std::vector<Tensor>& g, const std::vector<bool>&) {
                        Tensor dt = zeros(shape);
                        const Tensor gc = g[0].contiguous();
                        const float* src = gc.data<float>();
                        float* dst = dt.data<float>();
                        // In id order: the sum into a row is the same whatever the threads.
                        for (size_t n = 0; n < local.size(); ++n) {
                          if (local[n] < 0) continue;
                          float* row = dst + local[n] * C;
                          const float* gr = src + static_cast<int64_t>(n) * C;
                          for (int64_t c = 0; c < C; ++c) row[c] += gr[c];
                        }
                        return std::vector<Tensor>{dt};
                      });
  return out;
}

}  // namespace

Tensor VocabParallelEmbedding::forward(const Tensor& idx) {
  const Tensor& table = weight();
  // Traced (meta ids): the shapes and the all-reduce; which rows are this rank's needs the values.
  if (idx.is_meta()) return dist::reduce_from_group(embedding(idx, table), group_);
  const int64_t rows = table.size(0);
  const auto ids = idx.contiguous().to_vector<int64_t>();
  std::vector<int64_t> local(ids.size(), -1);
  for (size_t i = 0; i < ids.size(); ++i) {
    ACC_CHECK(ids[i] >= 0 && ids[i] < vocab_, "VocabParallelEmbedding: id ", ids[i],
              " at position ", i, " is outside [0, ", vocab_, ")");
    if (ids[i] >= first_ && ids[i] < first_ + rows) local[i] = ids[i] - first_;
  }
  Shape out_shape = idx.shape();
  out_shape.push_back(table.size(1));
  return dist::reduce_from_group(masked_lookup(table, std::move(local)).view(out_shape), group_);
}

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_size,
                                    const dist::ProcessGroupPtr& group, int64_t ignore_index) {
  ACC_CHECK(group != nullptr, "vocab_parallel_cross_entropy: the group is null");
  ACC_CHECK(logits.dim() >= 1 && logits.dtype() == DType::kFloat32,
            "vocab_parallel_cross_entropy: logits must be f32 (..., V/W), got ", logits.shape());
  const int64_t cols = logits.size(-1), rows = logits.numel() / std::max<int64_t>(1, cols);
  const int W = group->size();
  ACC_CHECK_AS(ShapeError, targets.numel() == rows,
               "vocab_parallel_cross_entropy: ", targets.numel(), " targets for ", rows,
               " rows of logits ", logits.shape());
  ACC_CHECK(vocab_size >= 1 && vocab_size <= cols * W, "vocab_parallel_cross_entropy: vocab_size ",
            vocab_size, " is outside [1, ", cols * W, "] (", cols, " columns x ", W, " ranks)");
  if (logits.is_meta()) {
    // Traced: the loss and its gradient's shapes (the row statistics' reductions are 3 x rows
    // floats, left out of the trace's communication).
    Tensor out = empty({}, logits.options());
    autograd::record_op("VocabParallelCrossEntropyBackward", {logits}, {out},
                        [z = logits](const std::vector<Tensor>&, const std::vector<bool>&) {
                          // z held as the real op holds the logits until backward.
                          return std::vector<Tensor>{empty(z.shape(), z.options())};
                        });
    return out;
  }
  const int64_t first = group->rank() * cols;  // this rank's first column
  const int64_t valid = std::clamp<int64_t>(vocab_size - first, 0, cols);
  // Each row's target as a column of this rank (-1: another rank's or ignored), and the rows
  // counted in the mean.
  const auto tgt = targets.contiguous().to_vector<int64_t>();
  std::vector<int64_t> local(static_cast<size_t>(rows), -1);
  std::vector<float> counted(static_cast<size_t>(rows), 0.f);
  int64_t count = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = tgt[static_cast<size_t>(i)];
    if (t == ignore_index) continue;
    ACC_CHECK(t >= 0 && t < vocab_size, "vocab_parallel_cross_entropy: target ", t, " at row ", i,
              " is outside [0, ", vocab_size, ")");
    counted[static_cast<size_t>(i)] = 1.f;
    ++count;
    if (t >= first && t < first + valid) local[static_cast<size_t>(i)] = t - first;
  }
  // Fused: the row maxima over every rank's valid columns (one max-reduction), then this rank's
  // sums of exponentials and target logits (one sum-reduction of both); the logits are never
  // gathered and nothing is communicated in backward. lse = max + log(sum of exponentials).
  const Tensor z = logits.contiguous();
  Tensor mx = empty({rows});
  kernels::vocab_ce_max(mx.data<float>(), z.data<float>(), rows, cols, valid);
  if (W > 1) group->allreduce(mx, dist::ReduceOp::kMax)->wait();
  Tensor sums = empty({2 * rows});
  kernels::vocab_ce_sums(sums.data<float>(), z.data<float>(), mx.data<float>(), local.data(), rows,
                         cols, valid);
  if (W > 1) group->allreduce(sums, dist::ReduceOp::kSum)->wait();
  Tensor lse = empty({rows});
  double total = 0;
  {
    const float* m = mx.data<float>();
    const float* s = sums.data<float>();
    float* l = lse.data<float>();
    for (int64_t i = 0; i < rows; ++i) {
      const float log_sum = std::log(s[i]);
      l[i] = m[i] + log_sum;
      if (counted[static_cast<size_t>(i)] != 0.f) total += log_sum - s[rows + i];
    }
  }
  Tensor out = empty({});
  *out.data<float>() = static_cast<float>(count > 0 ? total / static_cast<double>(count) : 0.0);
  autograd::record_op(
      "VocabParallelCrossEntropyBackward", {logits}, {out},
      [z, lse, local = std::move(local), counted = std::move(counted), rows, cols, valid, count](
          const std::vector<Tensor>& g, const std::vector<bool>&) {
        Tensor dz = empty(z.shape());
        const float scale =
            count > 0 ? static_cast<float>(g[0].item() / static_cast<double>(count)) : 0.f;
        std::vector<float> dloss(counted.size());
        for (size_t i = 0; i < counted.size(); ++i) dloss[i] = counted[i] * scale;
        kernels::vocab_ce_backward(dz.data<float>(), z.data<float>(), lse.data<float>(),
                                   local.data(), dloss.data(), rows, cols, valid);
        return std::vector<Tensor>{dz};
      });
  return out;
}

}  // namespace acc::strategies
