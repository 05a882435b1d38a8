#pragma once
// Reading a checkpoint step: its metadata, and the regions a placement table holds.

#include <string>

#include "acc/checkpoint/format.hpp"
#include "acc/dist/sharding.hpp"

namespace acc::ckpt {

/// metadata.json of a step directory, validated (format.hpp). Throws acc::IoError when it cannot
/// be read or the directory leads out of its root through a symlink (layout.hpp), acc::ValueError
/// naming the field when it is malformed or hostile, or when a step-N directory's name disagrees
/// with its metadata's step.
Metadata read_metadata(const std::string& step_dir);

/// Fills the parameter and optimizer-state entries of `table` in place (their `local` tensors)
/// from the checkpoint in `step_dir`, described by `meta` (read_metadata), whatever layout saved
/// it: for each entry's region (a box, with a flat range inside it or not) it reads only the chunks
/// whose regions share elements with it (load_plan.hpp), each once, checks each chunk's bytes
/// against the file's size and its xxh64 before decompressing, and copies what they share. Every
/// rank reads what it needs on its own (nothing collective). Throws acc::ValueError naming what
/// differs when the table does not fit the checkpoint (a tensor missing from it, another shape or
/// dtype, a region outside its tensor), and acc::IoError naming the file and chunk for a missing,
/// unreadable (the system's error named) or truncated shard, one reached through a symlink out of
/// the checkpoint root, a checksum mismatch or a chunk that does not decompress to its size.
/// Gradients are not in checkpoints and are left alone.
void load(const std::string& step_dir, const Metadata& meta, const dist::PlacementTable& table);

}  // namespace acc::ckpt
