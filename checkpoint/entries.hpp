#pragma once
// Which entries of a placement table a checkpoint holds, and their elements: shared by the writer,
// the save protocol, the async saver and the loader.

#include "acc/dist/sharding.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::ckpt::detail {

/// Parameters and optimizer state are saved; gradients are not.
bool saved_kind(dist::TensorKind k);

/// The elements an entry holds as one range of its tensor's row-major flattening: all that format
/// version 1 stores (a whole tensor, or a flat shard of one). Throws acc::ValueError for a box that
/// is not one range (a column block), which needs the boxes of format version 2.
dist::FlatRange range_of(const dist::PlacementEntry& e);

/// Whether this rank writes the entry: a saved kind, replica 0's holder, something held.
bool written_here(const dist::PlacementEntry& e);

/// "parameter" or "optimizer_state".
const char* kind_name(dist::TensorKind k);

/// The contiguous bytes of an entry's local tensor. Throws acc::ValueError when it holds another
/// number of elements than its region, acc::TypeError for another dtype than its entry's.
Tensor contiguous_local(const dist::PlacementEntry& e);

}  // namespace acc::ckpt::detail
