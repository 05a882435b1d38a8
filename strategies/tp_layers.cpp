#include "tp_layers.hpp"

#include "acc/autograd/ops.hpp"
#include "acc/dist/functional.hpp"
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
                                           dist::ProcessGroupPtr group)
    : Module("ColumnParallelLinear"), group_(std::move(group)) {
  check_args(blocks, group_, "ColumnParallelLinear");
  NoGradGuard ng;
  const Tensor& w = whole.weight();
  const Tensor& b = whole.bias();
  weight_ = register_parameter("weight", nn::gather_rows(w, blocks));
  if (b.defined()) bias_ = register_parameter("bias", nn::gather_rows(b, blocks));
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  return linear(dist::copy_to_group(x, group_), weight_, bias_);
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
  Tensor y = dist::reduce_from_group(linear(x, weight_), group_);
  return bias_.defined() ? add(y, bias_) : y;
}

}  // namespace acc::strategies
