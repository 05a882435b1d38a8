#pragma once
// A batch: the user's named tensors, every one with the samples along dimension 0 (the batch
// dimension), which is where a batch is split into micro-batches (grad_accum) and, by the loader,
// over data-parallel ranks. A language model's batch holds "idx" (B, T) and "targets" (B, T):
// Batch(idx, targets) makes one, and idx() / targets() read them.
//
// Copies are shallow (Tensor handles); narrow() and split() return views.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc::data {

class Batch {
 public:
  using Entry = std::pair<std::string, Tensor>;

  Batch() = default;
  /// A language model's batch: {"idx": idx, "targets": targets}.
  Batch(Tensor idx, Tensor targets);
  /// The user's tensors, by name. Throws acc::ValueError for an empty or repeated name and for an
  /// undefined tensor, naming it.
  explicit Batch(std::vector<Entry> tensors);

  /// The tensor named `name`. Throws acc::ValueError naming it and the names the batch has.
  const Tensor& at(const std::string& name) const;
  const Tensor& operator[](const std::string& name) const { return at(name); }
  bool contains(const std::string& name) const;
  /// A language model's inputs and targets (at("idx"), at("targets")).
  const Tensor& idx() const { return at("idx"); }
  const Tensor& targets() const { return at("targets"); }
  const std::vector<Entry>& tensors() const { return tensors_; }
  bool empty() const { return tensors_.empty(); }

  /// The number of samples: the size of dimension 0, which every tensor must share. Throws
  /// acc::ShapeError naming the tensors and their sizes when they disagree, or a tensor that has no
  /// dimension, and acc::ValueError for an empty batch.
  int64_t size() const;
  /// Samples [start, start + n) of every tensor (views). Throws what size() throws, and
  /// acc::ValueError naming the range when it is outside [0, size()].
  Batch narrow(int64_t start, int64_t n) const;
  /// `parts` micro-batches of size() / parts samples each, in order. Throws acc::ValueError
  /// naming `what`, the sizes and `parts` when size() does not split evenly.
  std::vector<Batch> split(int parts, const std::string& what) const;
  /// "idx (4, 64) i64, targets (4, 64) i64".
  std::string describe() const;

 private:
  std::vector<Entry> tensors_;
};

}  // namespace acc::data
