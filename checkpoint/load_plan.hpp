#pragma once
// The load planner: which chunks of a checkpoint each placement entry needs, and what to copy from
// each. Nothing here reads a file: load() (load.cpp) reads and decodes what the plan says.
//
// A region (a box with an optional flat range inside it) is, in the tensor's row-major
// flattening, a sorted list of runs (dist::PlacementEntry::global_runs), in the same order as its
// own elements: a box's row-major order is the tensor's order restricted to it. The elements two
// regions share are therefore found by merging their runs, and each shared run is a copy from one
// region's elements to the other's. A whole tensor or a flat range of one is one run; a column
// block is one run per row.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "acc/checkpoint/format.hpp"
#include "acc/dist/sharding.hpp"

namespace acc::ckpt::detail {

/// Elements [src, src + length) of a chunk, in its own order, go to elements [dst, dst + length)
/// of an entry's local tensor.
struct Copy {
  int64_t src = 0, dst = 0, length = 0;
  bool operator==(const Copy&) const = default;
};

/// The copies that move the elements a chunk's region (`from_box`, `from_flat`) shares with an
/// entry's (`to_box`, `to_flat`), both of a tensor of `shape`, in order; adjacent ones merged.
/// Empty when they share nothing.
std::vector<Copy> copies_between(const Shape& shape, const dist::Box& from_box,
                                 const std::optional<dist::FlatRange>& from_flat,
                                 const dist::Box& to_box,
                                 const std::optional<dist::FlatRange>& to_flat);

/// What one chunk gives one entry.
struct Target {
  const dist::PlacementEntry* entry;
  std::vector<Copy> copies;
  /// The chunk's elements all go to one place, in order: decoded straight into the entry.
  bool whole(const ChunkInfo& chunk) const;
};

/// One chunk to read, and the entries it fills (several when a rank holds several boxes of one
/// tensor, as a fused q|k|v block does): each chunk is read and decoded once.
struct ChunkRead {
  const TensorInfo* tensor;
  const ChunkInfo* chunk;
  std::vector<Target> targets;
};

/// The reads that fill the parameter and optimizer-state entries of `table` from the checkpoint
/// `meta` describes: the chunks that share elements with an entry's region, in the order the
/// entries first need them. Throws acc::ValueError naming what differs when the table does not fit
/// the checkpoint (a tensor missing from it, another shape (acc::ShapeError) or dtype
/// (acc::TypeError), a region outside its tensor, a local tensor not contiguous or of another
/// size).
std::vector<ChunkRead> plan_load(const std::string& step_dir, const Metadata& meta,
                                 const dist::PlacementTable& table);

}  // namespace acc::ckpt::detail
