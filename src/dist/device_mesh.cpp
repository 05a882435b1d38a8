#include "acc/dist/device_mesh.hpp"

#include <algorithm>

#include "acc/util/error.hpp"

namespace acc::dist {

const char* mesh_dim_name(MeshDim d) {
  switch (d) {
    case MeshDim::kPp:
      return "pp";
    case MeshDim::kDp:
      return "dp";
    case MeshDim::kCp:
      return "cp";
    case MeshDim::kTp:
      return "tp";
  }
  ACC_THROW(InternalError, "mesh: no name for dimension ", static_cast<int>(d));
}

MeshDim parse_mesh_dim(const std::string& name) {
  for (MeshDim d : kMeshDims) {
    if (name == mesh_dim_name(d)) return d;
  }
  ACC_THROW(ValueError, "mesh: unknown dimension '", name, "' (expected pp, dp, cp or tp)");
}

int MeshCoord::at(MeshDim d) const {
  return const_cast<MeshCoord*>(this)->at(d);
}

int& MeshCoord::at(MeshDim d) {
  switch (d) {
    case MeshDim::kPp:
      return pp;
    case MeshDim::kDp:
      return dp;
    case MeshDim::kCp:
      return cp;
    case MeshDim::kTp:
      return tp;
  }
  ACC_THROW(InternalError, "mesh: no coordinate for dimension ", static_cast<int>(d));
}

int DeviceMesh::size(MeshDim d) const {
  switch (d) {
    case MeshDim::kPp:
      return pp;
    case MeshDim::kDp:
      return dp;
    case MeshDim::kCp:
      return cp;
    case MeshDim::kTp:
      return tp;
  }
  ACC_THROW(InternalError, "mesh: no size for dimension ", static_cast<int>(d));
}

std::string DeviceMesh::to_string() const {
  return "pp=" + std::to_string(pp) + " dp=" + std::to_string(dp) + " cp=" + std::to_string(cp) +
         " tp=" + std::to_string(tp);
}

void DeviceMesh::check(int world) const {
  ACC_CHECK(pp >= 1 && dp >= 1 && cp >= 1 && tp >= 1, "mesh ", to_string(),
            ": every size must be >= 1");
  // In 64 bits: four sizes of up to 2^31 each would overflow an int product.
  const int64_t need = int64_t{pp} * dp * cp * tp;
  ACC_CHECK(need == world, "mesh ", to_string(), " needs ", need, " ranks, the world has ", world);
}

int DeviceMesh::stride(MeshDim d) const {
  int s = 1;
  for (auto it = kMeshDims.rbegin(); *it != d; ++it) s *= size(*it);
  return s;
}

MeshCoord DeviceMesh::coordinate_of(int rank) const {
  ACC_CHECK(rank >= 0 && rank < product(), "mesh ", to_string(), ": rank ", rank,
            " is outside its ", product(), " ranks");
  MeshCoord c;
  c.tp = rank % tp;
  c.cp = (rank / tp) % cp;
  c.dp = (rank / (tp * cp)) % dp;
  c.pp = rank / (tp * cp * dp);
  return c;
}

int DeviceMesh::rank_of(const MeshCoord& c) const {
  for (MeshDim d : kMeshDims) {
    ACC_CHECK(c.at(d) >= 0 && c.at(d) < size(d), "mesh ", to_string(), ": coordinate ",
              mesh_dim_name(d), "=", c.at(d), " is outside it");
  }
  return ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp;
}

namespace {

// One group of this rank alone for the process: a dimension of size 1 communicates with nobody,
// so every context shares it (communicators are never freed: one per Trainer would pile up over
// a search's dry-runs).
const ProcessGroupPtr& self_group() {
  static const ProcessGroupPtr self = ProcessGroup::world()->alone("self");
  return self;
}

}  // namespace

ParallelContext::ParallelContext(DeviceMesh mesh, ProcessGroupPtr world)
    : mesh_(mesh), world_(std::move(world)) {
  ACC_CHECK(world_ != nullptr, "parallel context: no world group");
  mesh_.check(world_->size());
  coord_ = mesh_.coordinate_of(world_->rank());
  // The color of a rank's group along `dims`: its coordinates along every other dimension. Every
  // rank makes the same splits in the same order (each is collective over the world).
  auto split_along = [&](std::initializer_list<MeshDim> dims, const std::string& name) {
    int color = 0, key = 0;
    for (MeshDim d : kMeshDims) {
      const bool along = std::find(dims.begin(), dims.end(), d) != dims.end();
      if (along) {
        key = key * mesh_.size(d) + coord_.at(d);
      } else {
        color = color * mesh_.size(d) + coord_.at(d);
      }
    }
    // Named by its dimension and where it lies along the others ("tp of dp=1"), so a hang report
    // or a flight-recorder dump says which of the groups along a dimension stalled.
    std::string where;
    for (MeshDim d : kMeshDims) {
      if (std::find(dims.begin(), dims.end(), d) != dims.end() || mesh_.size(d) == 1) continue;
      where += (where.empty() ? " of " : " ") + std::string(mesh_dim_name(d)) + "=" +
               std::to_string(coord_.at(d));
    }
    // A meta world (ParallelContext::meta) has no communicator to split: its groups are meta
    // groups of the same sizes, names and ranks.
    if (world_->is_meta()) {
      int size = 1;
      for (MeshDim d : dims) size *= mesh_.size(d);
      return ProcessGroup::meta(size, key, name + where);
    }
    return world_->split(color, key, name + where);
  };
  for (MeshDim d : kMeshDims) {
    ProcessGroupPtr& g = groups_[static_cast<size_t>(d)];
    // pp gets a group of its own even over the whole world: named "pp", so a hang analysis names
    // a pipeline's stages (dp keeps 'world', the name data-parallel runs always had).
    if (mesh_.size(d) == world_->size() && d != MeshDim::kPp) {
      g = world_;
    } else if (mesh_.size(d) == 1) {
      g = world_->is_meta() ? ProcessGroup::meta(1, 0, "self") : self_group();
    } else {
      g = split_along({d}, mesh_dim_name(d));
    }
  }
  if (mesh_.dp == 1) {
    dp_cp_ = group(MeshDim::kCp);
  } else if (mesh_.cp == 1) {
    dp_cp_ = group(MeshDim::kDp);
  } else if (mesh_.dp * mesh_.cp == world_->size()) {
    dp_cp_ = world_;
  } else {
    dp_cp_ = split_along({MeshDim::kDp, MeshDim::kCp}, "dp_cp");
  }
}

std::shared_ptr<const ParallelContext> ParallelContext::data_parallel(ProcessGroupPtr group) {
  ACC_CHECK(group != nullptr, "parallel context: no group");
  const int n = group->size();
  return std::make_shared<const ParallelContext>(DeviceMesh::data_parallel(n), std::move(group));
}

std::shared_ptr<const ParallelContext> ParallelContext::meta(DeviceMesh mesh, int rank) {
  mesh.check(mesh.product());
  return std::make_shared<const ParallelContext>(mesh,
                                                 ProcessGroup::meta(mesh.product(), rank, "world"));
}

const ProcessGroupPtr& ParallelContext::group(MeshDim d) const {
  return groups_[static_cast<size_t>(d)];
}

}  // namespace acc::dist
