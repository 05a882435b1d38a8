#pragma once
// The placement table: for every tensor a rank holds (parameter, gradient, each optimizer state
// field) its dotted name, global shape, dtype and the region of the global tensor it holds. The
// gradient norm, optimizer grouping, full_parameters() and sharded checkpoints read this table and
// have no case per strategy.
//
// Regions today are flat ranges of the row-major flattened global tensor (a whole tensor is the
// range [0, numel)). Tensor parallelism will add a per-dimension box beside the flat range (a
// Megatron column block of a weight is not one flat range); a pipeline stage simply has no entry
// for the tensors of other stages.
//
// Replicas: a tensor is held `replicas` times over the group, each copy split into disjoint
// regions. ddp: every rank holds replica `rank` whole; zero/fsdp: one replica, split into one
// flat range per rank (possibly empty on some ranks). Over all ranks, every element of every global
// tensor is covered exactly once per replica.
//
// Scalar step counts of the optimizer are not in the table: every rank holding a piece of a
// parameter keeps its own (equal) count (Optimizer::param_step).

#include <cstdint>
#include <string>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc::strategies {

enum class TensorKind { kParameter, kGradient, kOptimizerState };
const char* tensor_kind_name(TensorKind k);

/// Elements [offset, offset + length) of the row-major flattened global tensor.
struct FlatRange {
  int64_t offset = 0;
  int64_t length = 0;
  bool operator==(const FlatRange&) const = default;
};

struct Placement {
  /// The global tensor's name: the parameter's dotted name for parameters and gradients
  /// ("transformer.h.0.attn.c_attn.weight"), `state.<param>.<field>` for optimizer state.
  std::string name;
  std::string param;  // the parameter it belongs to
  TensorKind kind = TensorKind::kParameter;
  std::string field;  // optimizer state field ("exp_avg", ...); "" otherwise
  Shape global_shape;
  DType dtype = DType::kFloat32;
  FlatRange range;  // the part of the global tensor this rank holds
  int replica = 0;
  int replicas = 1;
  /// The held elements, `range.length` of them in row-major order (the parameter itself when whole,
  /// a 1-D view of a flat buffer when a shard). Undefined for a gradient not computed yet.
  Tensor local;

  /// True when this rank holds the whole global tensor (not a shard of it).
  bool is_whole() const { return range.length == numel_of(global_shape); }
};
using PlacementTable = std::vector<Placement>;

/// True when some entry of `table` (of kind `kind`) holds only a shard of its tensor.
bool any_sharded(const PlacementTable& table);
bool any_sharded(const PlacementTable& table, TensorKind kind);

/// Chunk `rank` of `world` equal chunks of a buffer of `padded` elements (a multiple of `world`):
/// the one definition of "this rank's shard" for zero and fsdp. Throws acc::ValueError when
/// `padded` is not a multiple of `world` or rank is out of range.
FlatRange shard_range(int64_t padded, int world, int rank);

/// The intersection of two ranges (length 0 when they do not overlap).
FlatRange intersect(const FlatRange& a, const FlatRange& b);

}  // namespace acc::strategies
