#pragma once
// The checkpoint MPI tests' helpers: jobs of n ranks inside one world, their directories, a
// checkpoint read whole, and a trainer's regions compared with it.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "acc/checkpoint/checkpoint.hpp"
#include "acc/data/batch.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/dist/dist.hpp"

namespace acc::test {

/// The first n ranks of the world as a group (the others get a group of their own they never use).
/// split is collective: every rank asks for every n in the same order.
inline dist::ProcessGroupPtr first(int n) {
  static std::map<int, dist::ProcessGroupPtr> groups;
  auto& g = groups[n];
  if (!g) {
    auto w = dist::ProcessGroup::world();
    g = w->split(w->rank() < n ? 0 : 1, w->rank(), "first" + std::to_string(n));
  }
  return g;
}

/// Step `step`'s global batch of `global_batch` sequences of `seq` ids below `vocab` (a fixed
/// function of the position and the step), rank r's share of it among n (data-parallel) ranks.
inline data::Batch batch_share(int64_t step, int n, int r, int64_t global_batch, int64_t seq,
                               int64_t vocab) {
  const int64_t b = global_batch / n;
  std::vector<int64_t> idx(static_cast<size_t>(b * seq)), tgt(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) {
    const int64_t g = (r * b) * seq + static_cast<int64_t>(i);  // position in the global batch
    idx[i] = (g * 7 + step * 13) % vocab;
    tgt[i] = (g * 11 + step * 5 + 3) % vocab;
  }
  return {from_vector(idx, {b, seq}), from_vector(tgt, {b, seq})};
}

/// A directory for this test named by rank 0, the same on every rank.
inline std::string job_dir(const std::string& tag) {
  auto world = dist::ProcessGroup::world();
  const std::string mine =
      world->rank() == 0 ? testing::TempDir() + "ckpt-" + tag + "-" + std::to_string(::getpid())
                         : std::string();
  return dist::broadcast_text(*world, mine, 0);
}

/// Every rank past its use of `dir`, then rank 0 removes it.
inline void remove_job_dir(const std::string& dir) {
  auto world = dist::ProcessGroup::world();
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
}

/// Every tensor of a checkpoint, whole (read through load() itself, with whole-tensor placements).
inline std::map<std::string, Tensor> read_whole(const std::string& dir) {
  const ckpt::Metadata meta = ckpt::read_metadata(dir);
  dist::PlacementTable table;
  std::map<std::string, Tensor> out;
  for (const ckpt::TensorInfo& t : meta.tensors) {
    dist::PlacementEntry e;
    e.name = t.name;
    e.param = t.param;
    e.kind = t.kind;
    e.field = t.field;
    e.global_shape = t.shape;
    e.dtype = t.dtype;
    e.box = dist::Box::whole(t.shape);
    e.local = empty({t.numel()}, {t.dtype});
    out[t.name] = e.local;
    table.push_back(e);
  }
  ckpt::load(dir, meta, table);
  return out;
}

/// Every region of `table` (parameters and optimizer state) equals `whole`'s tensor of its name
/// there, bitwise.
inline void expect_regions_equal(const dist::PlacementTable& table,
                                 const std::map<std::string, Tensor>& whole,
                                 const std::string& what) {
  for (const auto& e : table) {
    if (e.kind == dist::TensorKind::kGradient || e.held_numel() == 0) continue;
    const Tensor mine = e.local.contiguous();
    const size_t es = element_size(e.dtype);
    ASSERT_EQ(whole.count(e.name), 1u) << what << ": " << e.name;
    for (const auto& [run, at] : e.global_runs()) {
      ASSERT_EQ(std::memcmp(static_cast<const char*>(mine.raw_data()) + at * es,
                            static_cast<const char*>(whole.at(e.name).raw_data()) + run.offset * es,
                            static_cast<size_t>(run.length) * es),
                0)
          << what << ": " << e.name << " [" << run.offset << ", +" << run.length << ")";
    }
  }
}

/// Every parameter and optimizer-state region `t` holds equals the saved tensor's, bitwise.
inline void expect_holds(strategies::Trainer& t, const std::map<std::string, Tensor>& saved,
                         const std::string& what) {
  expect_regions_equal(t.placements(), saved, what);
}

}  // namespace acc::test
