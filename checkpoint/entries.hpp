#pragma once
// Which entries of a placement table a checkpoint holds, and their elements: shared by the writer,
// the save protocol, the async saver and the loader.

#include "acc/dist/sharding.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::ckpt::detail {

/// Parameters and optimizer state are saved; gradients are not.
bool saved_kind(dist::TensorKind k);

/// Throws acc::ValueError naming the entry unless its region lies inside its tensor: a box of the
/// tensor's rank with offsets and sizes >= 0 inside its shape, and a flat range inside the box.
void check_region(const dist::PlacementEntry& e);

/// Whether this rank writes the entry: a saved kind, replica 0's holder, something held.
bool written_here(const dist::PlacementEntry& e);

/// The contiguous bytes of an entry's local tensor (its region's elements in row-major order).
/// Throws acc::ValueError when the region is outside the tensor or the local tensor holds another
/// number of elements, acc::TypeError for another dtype than its entry's.
Tensor contiguous_local(const dist::PlacementEntry& e);

}  // namespace acc::ckpt::detail
