#pragma once
// The device mesh and the parallel context of a run.
//
// A mesh lays the world's ranks out as pp x dp x cp x tp, tensor parallelism innermost (adjacent
// ranks), then context (sequence) parallelism, data parallelism, and pipeline stages outermost,
// as Megatron lays them out: rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp.
//
// DeviceMesh is that arithmetic alone (no communicator: the planner uses it for meshes that are
// not at hand). ParallelContext is a run's mesh over real ranks: the world, this rank's
// coordinate, and one process group per mesh dimension plus the combined dp x cp group that
// gradients are reduced over. Everything that communicates asks the context for the group of its
// role; nothing assumes "the group" is the world.

#include <array>
#include <memory>
#include <string>

#include "acc/dist/process_group.hpp"

namespace acc::dist {

/// Mesh dimensions, outermost first.
enum class MeshDim { kPp, kDp, kCp, kTp };
inline constexpr std::array<MeshDim, 4> kMeshDims = {MeshDim::kPp, MeshDim::kDp, MeshDim::kCp,
                                                     MeshDim::kTp};
/// "pp", "dp", "cp", "tp".
const char* mesh_dim_name(MeshDim d);
/// The MeshDim named `name`; acc::ValueError naming it otherwise.
MeshDim parse_mesh_dim(const std::string& name);

/// A position in the mesh, one coordinate per dimension.
struct MeshCoord {
  int pp = 0, dp = 0, cp = 0, tp = 0;
  int at(MeshDim d) const;
  int& at(MeshDim d);
  bool operator==(const MeshCoord&) const = default;
};

struct DeviceMesh {
  int pp = 1, dp = 1, cp = 1, tp = 1;

  /// A mesh whose only dimension larger than 1 is dp (today's data-parallel runs).
  static DeviceMesh data_parallel(int world) { return DeviceMesh{.dp = world}; }

  int size(MeshDim d) const;
  /// Ranks between neighbours along `d` (tp innermost): tp 1, cp tp, dp tp x cp, pp tp x cp x dp.
  int stride(MeshDim d) const;
  int product() const { return pp * dp * cp * tp; }
  /// "pp=1 dp=2 cp=1 tp=4".
  std::string to_string() const;
  /// Throws acc::ValueError when a size is below 1 or the product is not `world` (naming both:
  /// "mesh pp=1 dp=2 cp=1 tp=4 needs 8 ranks, the world has 6").
  void check(int world) const;
  /// The coordinate of `rank` and the rank at `coord` (tp innermost). acc::ValueError for a rank or
  /// a coordinate outside the mesh.
  MeshCoord coordinate_of(int rank) const;
  int rank_of(const MeshCoord& coord) const;
  bool operator==(const DeviceMesh&) const = default;
};

/// A run's mesh over real ranks. Built collectively over `world` (every rank of it constructs one
/// with the same mesh, in the same order as its other collectives on `world`).
class ParallelContext {
 public:
  /// Throws what DeviceMesh::check throws. A dimension of the world's size uses `world` itself (a
  /// data-parallel run's groups are named 'world', as before the mesh), except pp, which always
  /// gets a group named after it (a hang analysis names a pipeline's stages by it); a dimension of
  /// size 1 a
  /// group of this rank alone ('self'); the others a sub-group named after the dimension ("tp",
  /// "dp", ...), and "dp_cp" when both dp and cp are larger than 1.
  ParallelContext(DeviceMesh mesh, ProcessGroupPtr world);

  /// dp = the group's size, every other dimension 1: a strategy applied with a plain group.
  static std::shared_ptr<const ParallelContext> data_parallel(ProcessGroupPtr group);

  /// Rank `rank` of `mesh` with meta groups only (ProcessGroup::meta: sizes, ranks and the names
  /// a real context gives them, no communicator, no MPI): how one process traces what that rank
  /// runs (the search's trace of a tensor-parallel candidate, a plan for a cluster not at hand).
  /// Throws what DeviceMesh::check and coordinate_of throw.
  static std::shared_ptr<const ParallelContext> meta(DeviceMesh mesh, int rank);

  const DeviceMesh& mesh() const { return mesh_; }
  const ProcessGroupPtr& world() const { return world_; }
  int rank() const { return world_->rank(); }
  int world_size() const { return world_->size(); }
  const MeshCoord& coordinate() const { return coord_; }
  int coordinate(MeshDim d) const { return coord_.at(d); }
  int size(MeshDim d) const { return mesh_.size(d); }
  /// The ranks that differ from this one only along `d`.
  const ProcessGroupPtr& group(MeshDim d) const;
  /// The ranks that differ from this one only along dp and cp: gradients are reduced over it.
  const ProcessGroupPtr& dp_cp_group() const { return dp_cp_; }
  /// Samples this rank reads and who reads the same: the data is split by the dp coordinate, so
  /// ranks of one tp, cp or pp group read the same samples.
  int data_rank() const { return coord_.dp; }
  int data_world() const { return mesh_.dp; }

 private:
  DeviceMesh mesh_;
  ProcessGroupPtr world_;
  MeshCoord coord_;
  std::array<ProcessGroupPtr, 4> groups_;
  ProcessGroupPtr dp_cp_;
};

using ParallelContextPtr = std::shared_ptr<const ParallelContext>;

}  // namespace acc::dist
