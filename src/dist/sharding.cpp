#include "acc/dist/sharding.hpp"

#include <algorithm>
#include <map>
#include <tuple>

#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"

namespace acc::dist {

const char* tensor_kind_name(TensorKind k) {
  switch (k) {
    case TensorKind::kParameter:
      return "parameter";
    case TensorKind::kGradient:
      return "gradient";
    case TensorKind::kOptimizerState:
      return "optimizer_state";
  }
  ACC_THROW(InternalError, "sharding: no name for tensor kind ", static_cast<int>(k));
}

TensorKind parse_tensor_kind(const std::string& name, const std::string& what) {
  for (TensorKind k :
       {TensorKind::kParameter, TensorKind::kGradient, TensorKind::kOptimizerState}) {
    if (name == tensor_kind_name(k)) return k;
  }
  ACC_THROW(ValueError, what, ": unknown tensor kind '", name,
            "' (expected parameter, gradient or optimizer_state)");
}

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::kReplicate:
      return "Replicate()";
    case Kind::kShard:
      return "Shard(" + std::to_string(dim) + ")";
    case Kind::kShardFlat:
      return "ShardFlat()";
    case Kind::kPartial:
      return "Partial(sum)";
  }
  ACC_THROW(InternalError, "sharding: no name for placement kind ", static_cast<int>(kind));
}

ShardingSpec ShardingSpec::with(MeshDim d, Placement p) const {
  ShardingSpec s = *this;
  s[d] = p;
  return s;
}

bool ShardingSpec::any(Placement::Kind k) const {
  return std::any_of(dims.begin(), dims.end(), [k](const Placement& p) { return p.kind == k; });
}

std::string ShardingSpec::to_string() const {
  std::string out;
  for (MeshDim d : kMeshDims) {
    if (!out.empty()) out += ' ';
    out += mesh_dim_name(d);
    out += ':';
    out += (*this)[d].to_string();
  }
  return out;
}

FlatRange intersect(const FlatRange& a, const FlatRange& b) {
  const int64_t lo = std::max(a.offset, b.offset);
  const int64_t hi = std::min(a.end(), b.end());
  return hi > lo ? FlatRange{lo, hi - lo} : FlatRange{lo, 0};
}

Box Box::whole(const Shape& shape) {
  Box b;
  b.offsets.assign(shape.size(), 0);
  b.sizes.assign(shape.begin(), shape.end());
  return b;
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::string Box::to_string() const {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    out +=
        (i ? ", " : "") + std::to_string(offsets[i]) + ":" + std::to_string(offsets[i] + sizes[i]);
  }
  return out + "]";
}

Box intersect(const Box& a, const Box& b) {
  ACC_CHECK_AS(ShapeError, a.sizes.size() == b.sizes.size(), "sharding: boxes ", a.to_string(),
               " and ", b.to_string(), " have different ranks");
  Box out;
  bool empty = false;
  for (size_t i = 0; i < a.sizes.size(); ++i) {
    const int64_t lo = std::max(a.offsets[i], b.offsets[i]);
    const int64_t hi = std::min(a.offsets[i] + a.sizes[i], b.offsets[i] + b.sizes[i]);
    out.offsets.push_back(lo);
    out.sizes.push_back(std::max<int64_t>(0, hi - lo));
    empty |= hi <= lo;
  }
  if (empty) std::fill(out.sizes.begin(), out.sizes.end(), 0);
  return out;
}

FlatRange split_dim(int64_t size, int parts, int index) {
  ACC_CHECK(parts >= 1, "split_dim: parts must be >= 1, got ", parts);
  ACC_CHECK(size >= 0, "split_dim: size must be >= 0, got ", size);
  ACC_CHECK(index >= 0 && index < parts, "split_dim: index ", index, " is outside [0, ", parts,
            ")");
  const int64_t chunk = (size + parts - 1) / parts;
  const int64_t begin = std::min(size, chunk * index);
  const int64_t end = std::min(size, begin + chunk);
  return {begin, end - begin};
}

Box box_of(const Shape& shape, const ShardingSpec& spec, const DeviceMesh& mesh,
           const MeshCoord& coord) {
  Box b = Box::whole(shape);
  for (MeshDim d : kMeshDims) {
    const Placement& p = spec[d];
    if (p.kind != Placement::Kind::kShard) continue;
    ACC_CHECK(p.dim >= 0 && p.dim < static_cast<int>(shape.size()), "sharding: ", mesh_dim_name(d),
              ":", p.to_string(), " names a dimension outside shape ", to_string(shape));
    const auto k = static_cast<size_t>(p.dim);
    const FlatRange r = split_dim(b.sizes[k], mesh.size(d), coord.at(d));
    b.offsets[k] += r.offset;
    b.sizes[k] = r.length;
  }
  return b;
}

FlatRange shard_range(int64_t padded, int world, int rank) {
  ACC_CHECK(world >= 1 && padded % world == 0, "shard_range: ", padded,
            " elements do not split into ", world, " equal chunks");
  ACC_CHECK(rank >= 0 && rank < world, "shard_range: rank ", rank, " out of range for world ",
            world);
  const int64_t chunk = padded / world;
  return {chunk * rank, chunk};
}

namespace {

// The replicated dimensions a replica index runs over (pipeline stages are not replicas).
constexpr std::array<MeshDim, 3> kReplicaDims = {MeshDim::kDp, MeshDim::kCp, MeshDim::kTp};

}  // namespace

int replica_of(const ShardingSpec& spec, const DeviceMesh& mesh, const MeshCoord& coord) {
  int r = 0;
  for (MeshDim d : kReplicaDims) {
    if (spec[d].kind == Placement::Kind::kReplicate) r = r * mesh.size(d) + coord.at(d);
  }
  return r;
}

int replicas_of(const ShardingSpec& spec, const DeviceMesh& mesh) {
  int n = 1;
  for (MeshDim d : kReplicaDims) {
    if (spec[d].kind == Placement::Kind::kReplicate) n *= mesh.size(d);
  }
  return n;
}

bool PlacementEntry::is_whole() const {
  return box == Box::whole(global_shape) && (!flat || flat->length == box.numel());
}

std::vector<std::pair<FlatRange, int64_t>> PlacementEntry::global_runs() const {
  std::vector<std::pair<FlatRange, int64_t>> runs;
  const size_t n = global_shape.size();
  const int64_t total = box.numel();
  const FlatRange held = flat ? intersect(*flat, {0, total}) : FlatRange{0, total};
  if (held.length == 0) return runs;
  // Strides of the tensor and of the box, and the run length: the box is contiguous in the tensor
  // over its innermost dimension j and every dimension after j that it holds whole.
  std::vector<int64_t> tensor_stride(n, 1), box_stride(n, 1);
  for (size_t k = n; k-- > 1;) {
    tensor_stride[k - 1] = tensor_stride[k] * global_shape[k];
    box_stride[k - 1] = box_stride[k] * box.sizes[k];
  }
  int64_t run = 1;
  for (size_t k = n; k-- > 0;) {
    run *= box.sizes[k];
    if (box.sizes[k] != global_shape[k]) break;
  }
  if (n == 0) run = 1;
  for (int64_t b = held.offset; b < held.end();) {
    // Where box-flat index b lies in the tensor.
    int64_t g = 0;
    for (size_t k = 0; k < n; ++k) {
      const int64_t c = (b / box_stride[k]) % box.sizes[k];
      g += (box.offsets[k] + c) * tensor_stride[k];
    }
    const int64_t len = std::min(run - b % run, held.end() - b);
    if (!runs.empty() && runs.back().first.end() == g &&
        runs.back().second + runs.back().first.length == b - held.offset) {
      runs.back().first.length += len;
    } else {
      runs.push_back({{g, len}, b - held.offset});
    }
    b += len;
  }
  return runs;
}

PlacementEntry whole_entry(const std::string& name, const std::string& param, TensorKind kind,
                           const Shape& shape, const Tensor& local, int replica, int replicas) {
  PlacementEntry e;
  e.name = name;
  e.param = param;
  e.kind = kind;
  e.global_shape = shape;
  e.dtype = local.defined() ? local.dtype() : DType::kFloat32;
  e.box = Box::whole(shape);
  e.replica = replica;
  e.replicas = replicas;
  e.local = local;
  return e;
}

bool any_sharded(const PlacementTable& table) {
  return std::any_of(table.begin(), table.end(),
                     [](const PlacementEntry& e) { return !e.is_whole(); });
}

bool any_sharded(const PlacementTable& table, TensorKind kind) {
  return std::any_of(table.begin(), table.end(),
                     [kind](const PlacementEntry& e) { return e.kind == kind && !e.is_whole(); });
}

std::vector<std::string> coverage_errors(const std::vector<PlacementTable>& tables) {
  std::vector<std::string> errors;
  struct Held {
    int rank;
    const PlacementEntry* entry;
  };
  std::map<std::pair<std::string, TensorKind>, std::vector<Held>> by_tensor;
  for (size_t r = 0; r < tables.size(); ++r) {
    for (const PlacementEntry& e : tables[r]) {
      by_tensor[{e.name, e.kind}].push_back({static_cast<int>(r), &e});
    }
  }
  for (const auto& [key, held] : by_tensor) {
    const std::string what = std::string(tensor_kind_name(key.second)) + " '" + key.first + "'";
    const PlacementEntry& first = *held.front().entry;
    const int64_t numel = numel_of(first.global_shape);
    bool consistent = true;
    for (const Held& h : held) {
      const PlacementEntry& e = *h.entry;
      const std::string at = what + " on rank " + std::to_string(h.rank);
      if (e.global_shape != first.global_shape || e.dtype != first.dtype ||
          e.replicas != first.replicas) {
        errors.push_back(at + ": shape " + to_string(e.global_shape) + ", " +
                         std::to_string(e.replicas) + " replica(s), unlike rank " +
                         std::to_string(held.front().rank) + "'s " + to_string(first.global_shape) +
                         ", " + std::to_string(first.replicas));
        consistent = false;
        continue;
      }
      bool inside =
          e.box.sizes.size() == e.global_shape.size() && e.replica >= 0 && e.replica < e.replicas;
      for (size_t k = 0; inside && k < e.box.sizes.size(); ++k) {
        inside = e.box.offsets[k] >= 0 && e.box.sizes[k] >= 0 &&
                 e.box.offsets[k] + e.box.sizes[k] <= e.global_shape[k];
      }
      if (inside && e.flat) {
        inside = e.flat->offset >= 0 && e.flat->length >= 0 && e.flat->end() <= e.box.numel();
      }
      if (!inside) {
        errors.push_back(at + ": box " + e.box.to_string() +
                         (e.flat ? " flat [" + std::to_string(e.flat->offset) + ", " +
                                       std::to_string(e.flat->end()) + ")"
                                 : "") +
                         " or replica " + std::to_string(e.replica) + " lies outside shape " +
                         to_string(e.global_shape) + " x " + std::to_string(e.replicas));
        consistent = false;
        continue;
      }
      if (e.local.defined() && e.local.numel() != e.held_numel()) {
        errors.push_back(at + ": holds " + std::to_string(e.local.numel()) + " element(s) for a " +
                         "region of " + std::to_string(e.held_numel()));
      }
    }
    if (!consistent) continue;
    for (int replica = 0; replica < first.replicas; ++replica) {
      std::vector<std::tuple<int64_t, int64_t, int>> runs;  // global offset, length, rank
      for (const Held& h : held) {
        if (h.entry->replica != replica) continue;
        for (const auto& [r, at] : h.entry->global_runs())
          runs.emplace_back(r.offset, r.length, h.rank);
      }
      std::sort(runs.begin(), runs.end());
      int64_t next = 0;
      for (const auto& [offset, length, rank] : runs) {
        if (offset > next) {
          errors.push_back(what + " replica " + std::to_string(replica) + ": elements [" +
                           std::to_string(next) + ", " + std::to_string(offset) +
                           ") are held by no rank");
        } else if (offset < next) {
          errors.push_back(what + " replica " + std::to_string(replica) + ": element " +
                           std::to_string(offset) + " is held twice (again by rank " +
                           std::to_string(rank) + ")");
        }
        next = std::max(next, offset + length);
      }
      if (next < numel) {
        errors.push_back(what + " replica " + std::to_string(replica) + ": elements [" +
                         std::to_string(next) + ", " + std::to_string(numel) +
                         ") are held by no rank");
      }
    }
  }
  return errors;
}

}  // namespace acc::dist
