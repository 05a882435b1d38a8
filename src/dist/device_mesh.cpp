#include "acc/dist/device_mesh.hpp"

#include "acc/util/error.hpp"

namespace acc::dist {

std::string MeshShape::to_string() const {
  return "pp=" + std::to_string(pp) + " dp=" + std::to_string(dp) + " tp=" + std::to_string(tp) +
         " sp=" + std::to_string(sp);
}

DeviceMesh::DeviceMesh(MeshShape shape, ProcessGroupPtr world)
    : shape_(shape), world_(std::move(world)) {
  ACC_CHECK(shape.pp >= 1 && shape.dp >= 1 && shape.tp >= 1 && shape.sp >= 1, "mesh ",
            shape.to_string(), ": every size must be >= 1");
  ACC_CHECK(shape.product() == world_->size(), "mesh ", shape.to_string(), " needs ",
            shape.product(), " ranks, the world has ", world_->size());
  // Rank layout: tp innermost, then sp, dp, pp outermost.
  const int r = world_->rank();
  coord_["tp"] = r % shape.tp;
  coord_["sp"] = (r / shape.tp) % shape.sp;
  coord_["dp"] = (r / (shape.tp * shape.sp)) % shape.dp;
  coord_["pp"] = r / (shape.tp * shape.sp * shape.dp);
  const std::map<std::string, int> size = {
      {"pp", shape.pp}, {"dp", shape.dp}, {"tp", shape.tp}, {"sp", shape.sp}};
  for (const char* dim : {"pp", "dp", "sp", "tp"}) {
    // Color: the coordinates along every other dimension; key: the coordinate along this one.
    int color = 0;
    for (const char* other : {"pp", "dp", "sp", "tp"}) {
      if (std::string(other) == dim) continue;
      color = color * size.at(other) + coord_.at(other);
    }
    groups_[dim] = world_->split(color, coord_.at(dim), dim);
  }
}

int DeviceMesh::coordinate(const std::string& dim) const {
  auto it = coord_.find(dim);
  ACC_CHECK(it != coord_.end(), "mesh: unknown dimension '", dim, "' (expected pp, dp, tp or sp)");
  return it->second;
}

ProcessGroupPtr DeviceMesh::group(const std::string& dim) const {
  auto it = groups_.find(dim);
  ACC_CHECK(it != groups_.end(), "mesh: unknown dimension '", dim, "' (expected pp, dp, tp or sp)");
  return it->second;
}

}  // namespace acc::dist
