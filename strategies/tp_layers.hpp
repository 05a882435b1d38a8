#pragma once
// Megatron's tensor-parallel linears (Shoeybi et al. 2019), built from a whole nn::Linear: each
// rank keeps its block of the weight and communicates only through the differentiable mappings of
// acc/dist/functional.hpp (the one place tensor-parallel code talks).
//
//   column-parallel  y_r = f(x) W_r^T + b_r    W_r: this rank's rows (output features) of W
//                    f = copy_to_group: identity forward, gradient summed over tp backward
//   row-parallel     y = g(x_r W_r^T) + b       W_r: this rank's columns (input features) of W
//                    g = reduce_from_group: sum over tp forward, identity backward
//
// A column-parallel layer's output stays split along its last dimension: the next layer is the
// row-parallel one that takes that split as its input (attention: c_attn -> heads -> c_proj; MLP:
// c_fc -> activation -> c_proj). The blocks say which rows (columns) a rank keeps, so a fused
// q|k|v projection or grouped-query heads (nn/head_split.hpp) are sharded by the same class.
// The parameters keep the names "weight" and "bias", so the module replaces the whole Linear at
// its path (nn::Module::replace_module) and the state dict keeps its names.

#include <utility>
#include <vector>

#include "acc/dist/process_group.hpp"
#include "acc/nn/head_split.hpp"
#include "acc/nn/layers.hpp"
#include "acc/nn/module.hpp"

namespace acc::strategies {

class ColumnParallelLinear : public nn::Module {
 public:
  /// The rows `blocks` of `whole`'s weight (out, in) and bias, concatenated in order, copied into
  /// storage of this layer's own. `sharers` (optional): the ranks of `group` that hold the same
  /// rows (kv heads shared by several ranks' query heads); each gradient of the weight and bias
  /// is summed over them as it reaches the parameter (a gradient hook). Throws
  /// acc::ValueError for a null group or no blocks, and acc::ShapeError for a block outside the
  /// weight's rows.
  ColumnParallelLinear(nn::Linear& whole, const std::vector<nn::RowBlock>& blocks,
                       dist::ProcessGroupPtr group, dist::ProcessGroupPtr sharers = nullptr);
  /// x (..., in), replicated over the group -> this rank's output features (..., rows). With
  /// sequence parallelism x is this rank's chunk (B, T / W, in) of the sequence, all-gathered
  /// along dimension 1 first (backward: the gradient reduce-scattered), instead of copy_to_group.
  Tensor forward(const Tensor& x) override;
  void set_sequence_parallel(bool on) { sequence_parallel_ = on; }
  Tensor& weight() { return weight_; }
  Tensor& bias() { return bias_; }

 private:
  dist::ProcessGroupPtr group_, sharers_;
  bool sequence_parallel_ = false;
  Tensor weight_, bias_;
};

class RowParallelLinear : public nn::Module {
 public:
  /// The columns `blocks` (RowBlocks along the weight's dimension 1) of `whole`'s weight (out, in);
  /// the bias whole (added once, after the sum). Throws as ColumnParallelLinear.
  RowParallelLinear(nn::Linear& whole, const std::vector<nn::RowBlock>& blocks,
                    dist::ProcessGroupPtr group);
  /// x (..., this rank's input features) -> (..., out), summed over the group: every rank the
  /// whole output. With sequence parallelism the sum is reduce-scattered along dimension 1 (the
  /// sequence) instead: this rank's chunk (B, T / W, out), the bias added to it.
  Tensor forward(const Tensor& x) override;
  void set_sequence_parallel(bool on) { sequence_parallel_ = on; }
  Tensor& weight() { return weight_; }
  Tensor& bias() { return bias_; }

 private:
  dist::ProcessGroupPtr group_;
  bool sequence_parallel_ = false;
  Tensor weight_, bias_;
};

/// Megatron's vocab-parallel embedding: this rank's rows [rank Vp/W, (rank + 1) Vp/W) of the
/// table padded to Vp = the vocabulary rounded up to a multiple of W (padding rows zero, never
/// looked up: ids are < the vocabulary). An id outside this rank's rows looks up nothing here
/// (its output row is zero), and the ranks' outputs are summed (reduce_from_group), so every rank
/// gets the whole (..., C); backward gives each rank the gradient of its own rows. An
/// nn::Embedding, so a model that ties its output projection to it (GPT, tied Llama) keeps it
/// tied: attend(h) gives this rank's columns of the logits (..., Vp / W), h entering through
/// copy_to_group (its gradient summed over the ranks), for vocab_parallel_cross_entropy.
class VocabParallelEmbedding : public nn::Embedding {
 public:
  /// Throws acc::ValueError for a null group.
  VocabParallelEmbedding(nn::Embedding& whole, dist::ProcessGroupPtr group);
  /// idx (...) i64 ids in [0, vocab_size()) -> (..., C). Throws acc::ValueError naming an id
  /// outside the vocabulary.
  Tensor forward(const Tensor& idx) override;
  Tensor attend(const Tensor& h) override;
  int64_t vocab_size() const { return vocab_; }
  /// Vp / W rows, from row first_row() of the padded table.
  int64_t first_row() const { return first_; }

 private:
  dist::ProcessGroupPtr group_;
  int64_t vocab_ = 0, first_ = 0;
};

/// An untied output projection (Llama's lm_head, (V, C) without bias) split as the
/// vocab-parallel embedding splits its table: this rank's rows of the weight padded to Vp, so
/// forward gives its columns of the logits (..., Vp / W) for vocab_parallel_cross_entropy (x
/// enters through copy_to_group). Throws acc::ValueError for a null group or a whole with a bias.
class VocabParallelHead : public nn::Module {
 public:
  VocabParallelHead(nn::Linear& whole, dist::ProcessGroupPtr group);
  Tensor forward(const Tensor& x) override;
  Tensor& weight() { return weight_; }
  int64_t first_row() const { return first_; }

 private:
  dist::ProcessGroupPtr group_;
  int64_t first_ = 0;
  Tensor weight_;
};

/// This rank's rows of `whole` (V, C) padded with zero rows to Vp / W (Vp: V rounded up to a
/// multiple of W): rows [rank Vp/W, (rank + 1) Vp/W) of the padded table, and where they start.
std::pair<Tensor, int64_t> padded_vocab_rows(const Tensor& whole, const dist::ProcessGroup& group);

/// Megatron's vocab-parallel cross-entropy: the mean over the rows whose target is not
/// `ignore_index` of -log softmax(logits)[target], where the logits (..., V) are split over the
/// group along the vocabulary and never gathered: `logits` is this rank's (..., Vp / W), columns
/// [rank Vp/W, (rank + 1) Vp/W) of a vocabulary padded to Vp (a multiple of W) whose columns
/// >= vocab_size are padding, never in the loss or its gradient. The row max, the sum of
/// exponentials and the target's logit are reduced over the group (the max as a constant: the
/// softmax does not depend on it); every rank returns the same loss, and its backward gives each
/// rank the gradient of its own columns. Throws acc::ValueError naming a target outside
/// [0, vocab_size) that is not ignore_index, and acc::ShapeError when the shapes disagree.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab_size,
                                    const dist::ProcessGroupPtr& group,
                                    int64_t ignore_index = -100);

/// The even split of `size` features over `parts` ranks: rank `rank`'s block. Throws
/// acc::ValueError naming `what`, the size and the count when size % parts != 0.
nn::RowBlock even_block(int64_t size, int parts, int rank, const char* what);

}  // namespace acc::strategies
