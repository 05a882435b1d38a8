#include "load_plan.hpp"

#include <algorithm>
#include <map>

#include "acc/util/error.hpp"
#include "entries.hpp"

namespace acc::ckpt::detail {
namespace {

using dist::PlacementEntry;
using Runs = std::vector<std::pair<dist::FlatRange, int64_t>>;  // global range, local start

Runs runs_of(const Shape& shape, const dist::Box& box, const std::optional<dist::FlatRange>& flat) {
  PlacementEntry e;
  e.global_shape = shape;
  e.box = box;
  e.flat = flat;
  return e.global_runs();
}

// Whether the boxes share an element (cheap, before the runs are made).
bool boxes_meet(const dist::Box& a, const dist::Box& b) {
  for (size_t k = 0; k < a.sizes.size(); ++k) {
    if (std::max(a.offsets[k], b.offsets[k]) >=
        std::min(a.offsets[k] + a.sizes[k], b.offsets[k] + b.sizes[k])) {
      return false;
    }
  }
  return true;
}

std::vector<Copy> merge(const Runs& from, const Runs& to) {
  std::vector<Copy> out;
  size_t i = 0, j = 0;
  while (i < from.size() && j < to.size()) {
    const auto& [a, a_at] = from[i];
    const auto& [b, b_at] = to[j];
    const int64_t lo = std::max(a.offset, b.offset), hi = std::min(a.end(), b.end());
    if (lo < hi) {
      const Copy c{a_at + (lo - a.offset), b_at + (lo - b.offset), hi - lo};
      if (!out.empty() && out.back().src + out.back().length == c.src &&
          out.back().dst + out.back().length == c.dst) {
        out.back().length += c.length;
      } else {
        out.push_back(c);
      }
    }
    if (a.end() <= b.end()) ++i;
    if (b.end() <= a.end()) ++j;
  }
  return out;
}

}  // namespace

std::vector<Copy> copies_between(const Shape& shape, const dist::Box& from_box,
                                 const std::optional<dist::FlatRange>& from_flat,
                                 const dist::Box& to_box,
                                 const std::optional<dist::FlatRange>& to_flat) {
  if (!boxes_meet(from_box, to_box)) return {};
  return merge(runs_of(shape, from_box, from_flat), runs_of(shape, to_box, to_flat));
}

bool Target::whole(const ChunkInfo& chunk) const {
  return copies.size() == 1 && copies[0].src == 0 && copies[0].length == chunk.numel();
}

std::vector<ChunkRead> plan_load(const std::string& step_dir, const Metadata& meta,
                                 const dist::PlacementTable& table) {
  std::vector<ChunkRead> reads;
  std::map<const ChunkInfo*, size_t> read_of;  // a chunk's read in `reads`
  for (const PlacementEntry& e : table) {
    if (!saved_kind(e.kind) || e.held_numel() == 0) continue;
    const TensorInfo* t = meta.find(e.name);
    ACC_CHECK(t != nullptr, "checkpoint '", step_dir, "' has no tensor '", e.name,
              "' (another model or optimizer?)");
    ACC_CHECK_SHAPE(t->shape == e.global_shape, "checkpoint '", step_dir, "': '", e.name,
                    "' has shape ", to_string(t->shape), ", this model's is ",
                    to_string(e.global_shape));
    ACC_CHECK_TYPE(t->dtype == e.dtype, "checkpoint '", step_dir, "': '", e.name, "' is ", t->dtype,
                   ", this run's is ", e.dtype);
    check_region(e);
    ACC_CHECK(e.local.defined() && e.local.numel() == e.held_numel() && e.local.is_contiguous(),
              "checkpoint: '", e.name, "' has no contiguous local tensor of ", e.held_numel(),
              " elements to load into");
    // The entry's runs once; a chunk's only when its box meets the entry's.
    const Runs mine = runs_of(e.global_shape, e.box, e.flat);
    for (const ChunkInfo& c : t->chunks) {
      if (!boxes_meet(c.box, e.box)) continue;
      std::vector<Copy> copies = merge(runs_of(t->shape, c.box, c.flat), mine);
      if (copies.empty()) continue;
      const auto [it, added] = read_of.emplace(&c, reads.size());
      if (added) reads.push_back({t, &c, {}});
      reads[it->second].targets.push_back({&e, std::move(copies)});
    }
  }
  return reads;
}

}  // namespace acc::ckpt::detail
