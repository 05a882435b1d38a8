#pragma once
// Sharding specs and the placement table: for every tensor a rank holds (parameter, gradient,
// each optimizer state field) its dotted name, true global shape, dtype, how it lies along each
// mesh dimension, and the region of the global tensor it holds. The gradient norm, optimizer
// grouping, full_parameters(), memory reports and sharded checkpoints read this table and have no
// case per method.
//
// How a tensor lies along one mesh dimension (DTensor's placements, plus ZeRO's flat split):
//   Replicate   every rank along the dimension holds the same values;
//   Shard(d)    tensor dimension d is split over the ranks along it (split_dim: the one uneven
//               split rule), which narrows the rank's box;
//   ShardFlat   the box is flattened (row-major) and split over the ranks along it in flat
//               ranges: ZeRO's and fsdp's buckets. The range is the method's (bucket layout), so
//               the entry carries it; at most one mesh dimension is flat-sharded;
//   Partial     every rank holds a summand of the values (a gradient not yet reduced, e.g. a
//               sequence-parallel norm weight's); reduced before anything reads it as the tensor.
//
// The region a rank holds is a box of the global shape (per-dimension offsets and sizes), with an
// optional flat range inside the box's row-major flattening. Replicas: `replicas` copies of the
// tensor exist over the mesh (the product of its Replicate dimensions among dp, cp and tp, or what
// the method says, e.g. a tied embedding on two pipeline stages), each split into disjoint
// regions: over all ranks every element of every global tensor is covered exactly once per
// replica (coverage_errors checks it). A pipeline stage has no entry for tensors it does not hold.
//
// Scalar step counts of the optimizer are not in the table: every rank holding a piece of a
// parameter keeps its own (equal) count (Optimizer::param_step).

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "acc/dist/device_mesh.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc::dist {

enum class TensorKind { kParameter, kGradient, kOptimizerState };
/// "parameter", "gradient", "optimizer_state".
const char* tensor_kind_name(TensorKind k);
/// The kind named `name`; acc::ValueError naming `what` and the name otherwise.
TensorKind parse_tensor_kind(const std::string& name, const std::string& what);

/// How a tensor lies along one mesh dimension (see the file comment).
struct Placement {
  enum class Kind { kReplicate, kShard, kShardFlat, kPartial };
  Kind kind = Kind::kReplicate;
  int dim = -1;  // kShard: the tensor dimension split along the mesh dimension

  static Placement replicate() { return {}; }
  static Placement shard(int dim) { return {Kind::kShard, dim}; }
  static Placement shard_flat() { return {Kind::kShardFlat, -1}; }
  static Placement partial() { return {Kind::kPartial, -1}; }
  /// "Replicate()", "Shard(0)", "ShardFlat()", "Partial(sum)".
  std::string to_string() const;
  bool operator==(const Placement&) const = default;
};

/// One placement per mesh dimension, indexed by MeshDim.
struct ShardingSpec {
  std::array<Placement, 4> dims{};
  Placement& operator[](MeshDim d) { return dims[static_cast<size_t>(d)]; }
  const Placement& operator[](MeshDim d) const { return dims[static_cast<size_t>(d)]; }
  /// Replicate() along every dimension.
  static ShardingSpec replicated() { return {}; }
  /// The same with `d` set to `p`.
  ShardingSpec with(MeshDim d, Placement p) const;
  bool any(Placement::Kind k) const;
  /// "pp:Replicate() dp:ShardFlat() cp:Replicate() tp:Shard(0)".
  std::string to_string() const;
  bool operator==(const ShardingSpec&) const = default;
};

/// Elements [offset, offset + length) of a row-major flattening.
struct FlatRange {
  int64_t offset = 0;
  int64_t length = 0;
  int64_t end() const { return offset + length; }
  bool operator==(const FlatRange&) const = default;
};
/// The intersection of two ranges (length 0 when they do not overlap).
FlatRange intersect(const FlatRange& a, const FlatRange& b);

/// A region of a tensor: per dimension, an offset and a size.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  /// The whole of a tensor of `shape`.
  static Box whole(const Shape& shape);
  int64_t numel() const;
  bool empty() const { return numel() == 0; }
  /// "[0:128, 64:128]" (begin:end per dimension).
  std::string to_string() const;
  bool operator==(const Box&) const = default;
};
/// The intersection of two boxes of one tensor (an empty box, sizes 0, when they do not overlap).
/// Throws acc::ShapeError for boxes of different ranks.
Box intersect(const Box& a, const Box& b);

/// The one uneven split rule: a dimension of `size` split into `parts` is cut as torch.chunk and
/// DTensor cut it, in pieces of ceil(size / parts), the last ones shorter or empty. Methods that
/// need an even split (heads, vocabulary rows) check divisibility themselves, naming the counts.
/// Throws acc::ValueError for parts < 1, size < 0 or an index outside [0, parts).
FlatRange split_dim(int64_t size, int parts, int index);

/// The box the rank at `coord` of `mesh` holds of a tensor of `shape` under `spec`: each mesh
/// dimension with Shard(d), outermost first, splits what is left of tensor dimension d with
/// split_dim. Throws acc::ValueError for a Shard(d) with d outside the shape.
Box box_of(const Shape& shape, const ShardingSpec& spec, const DeviceMesh& mesh,
           const MeshCoord& coord);

/// ZeRO's and fsdp's flat rule: chunk `rank` of `world` equal chunks of a buffer of `padded`
/// elements (a multiple of `world`). Throws acc::ValueError when `padded` is not a multiple of
/// `world` or the rank is out of range.
FlatRange shard_range(int64_t padded, int world, int rank);

/// Which replica the rank at `coord` holds and how many there are: the linear index of its
/// coordinates along the dimensions among dp, cp and tp where `spec` replicates (outermost
/// first), and the product of their sizes. Pipeline stages are not replicas: a stage holds its own
/// tensors (a method that places one tensor on two stages sets the replica itself).
int replica_of(const ShardingSpec& spec, const DeviceMesh& mesh, const MeshCoord& coord);
int replicas_of(const ShardingSpec& spec, const DeviceMesh& mesh);

/// One tensor a rank holds.
struct PlacementEntry {
  /// The global tensor's name: the parameter's dotted name for parameters and gradients
  /// ("transformer.h.0.attn.c_attn.weight"), `state.<param>.<field>` for optimizer state.
  std::string name;
  std::string param;  // the parameter it belongs to
  TensorKind kind = TensorKind::kParameter;
  std::string field;  // optimizer state field ("exp_avg", ...); "" otherwise
  Shape global_shape;
  DType dtype = DType::kFloat32;
  ShardingSpec spec;
  Box box;                        // the region of the global tensor, before a flat split
  std::optional<FlatRange> flat;  // with a ShardFlat dimension: the part of the box held
  int replica = 0;
  int replicas = 1;
  /// The held elements, held_numel() of them: the box's elements in row-major order, or the flat
  /// range of them (the parameter itself when whole, a view of a shard or of a flat buffer).
  /// Undefined for a gradient not computed yet.
  Tensor local;

  int64_t held_numel() const { return flat ? flat->length : box.numel(); }
  /// This rank holds the whole global tensor (not a shard of it).
  bool is_whole() const;
  /// The held elements as runs of the global tensor's row-major flattening, in local order:
  /// (range in the global flattening, where it starts in `local`). One run for a whole tensor or
  /// a row block; one per row for a column block.
  std::vector<std::pair<FlatRange, int64_t>> global_runs() const;
};
using PlacementTable = std::vector<PlacementEntry>;

/// An entry for `local`, which holds all of a tensor of `shape` (replica `replica` of `replicas`,
/// spec replicated).
PlacementEntry whole_entry(const std::string& name, const std::string& param, TensorKind kind,
                           const Shape& shape, const Tensor& local, int replica, int replicas);

/// True when some entry of `table` (of kind `kind`) holds only a part of its tensor.
bool any_sharded(const PlacementTable& table);
bool any_sharded(const PlacementTable& table, TensorKind kind);

/// What is wrong with the tables of every rank of a mesh taken together (`tables[r]` is rank r's):
/// for each global tensor and kind, every element of every replica held exactly once, entries of
/// one tensor agreeing on shape, dtype and replica count, boxes and flat ranges inside their
/// tensor and `local` of the size held (when defined). Empty when all is well; each line names
/// the tensor, the replica and the first element that is missing or held twice. For tests and
/// for methods' self-checks.
std::vector<std::string> coverage_errors(const std::vector<PlacementTable>& tables);

}  // namespace acc::dist
