#pragma once
// A device mesh over the world: pp x dp x sp x tp ranks, tensor parallelism innermost (adjacent
// ranks), then sequence parallelism, data parallelism, and pipeline stages outermost, as Megatron
// lays them out. Each dimension gets a sub-group built with MPI_Comm_split.

#include <array>
#include <map>
#include <string>

#include "acc/dist/process_group.hpp"

namespace acc::dist {

struct MeshShape {
  int pp = 1, dp = 1, tp = 1, sp = 1;
  int product() const { return pp * dp * tp * sp; }
  std::string to_string() const;
};

class DeviceMesh {
 public:
  /// Throws acc::ValueError for a size below 1 or a product that is not the world size, naming
  /// the shape and the world ("mesh pp=1 dp=2 tp=4 sp=1 needs 8 ranks, the world has 6").
  /// Collective over `world`.
  explicit DeviceMesh(MeshShape shape, ProcessGroupPtr world = ProcessGroup::world());

  const MeshShape& shape() const { return shape_; }
  /// This rank's coordinate along "pp", "dp", "tp" or "sp".
  int coordinate(const std::string& dim) const;
  /// The group of ranks that differ from this one only along `dim`.
  ProcessGroupPtr group(const std::string& dim) const;
  const ProcessGroupPtr& world() const { return world_; }

 private:
  MeshShape shape_;
  ProcessGroupPtr world_;
  std::map<std::string, int> coord_;
  std::map<std::string, ProcessGroupPtr> groups_;
};

}  // namespace acc::dist
