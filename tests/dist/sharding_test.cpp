// Sharding specs, boxes and the placement table's coverage rule, on hand-made layouts of the
// kinds tensor and sequence parallelism produce (no MPI: tables of several ranks built by hand).
#include "acc/dist/sharding.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "acc/util/error.hpp"

namespace acc::dist {
namespace {

using Kind = Placement::Kind;

TEST(SplitDim, CutsAsTorchChunkDoes) {
  auto lengths = [](int64_t size, int parts) {
    std::vector<int64_t> out;
    int64_t next = 0;
    for (int i = 0; i < parts; ++i) {
      const FlatRange r = split_dim(size, parts, i);
      if (r.length > 0) {
        EXPECT_EQ(r.offset, next) << size << " / " << parts << " part " << i;
      }
      next += r.length;
      out.push_back(r.length);
    }
    EXPECT_EQ(next, size) << size << " / " << parts;
    return out;
  };
  EXPECT_EQ(lengths(10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(lengths(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(lengths(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(lengths(0, 3), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(lengths(7, 1), (std::vector<int64_t>{7}));
  EXPECT_THROW(split_dim(8, 0, 0), ValueError);
  EXPECT_THROW(split_dim(8, 2, 2), ValueError);
  EXPECT_THROW(split_dim(-1, 2, 0), ValueError);
}

TEST(BoxOf, ShardsNarrowTheirDimensionOutermostFirst) {
  const DeviceMesh mesh{.dp = 2, .tp = 2};
  const Shape w = {8, 6};
  // Column-parallel weight (out, in): rows split over tp.
  const ShardingSpec column = ShardingSpec::replicated().with(MeshDim::kTp, Placement::shard(0));
  EXPECT_EQ(box_of(w, column, mesh, {.tp = 1}).to_string(), "[4:8, 0:6]");
  // Row-parallel: columns split over tp.
  const ShardingSpec row = ShardingSpec::replicated().with(MeshDim::kTp, Placement::shard(1));
  EXPECT_EQ(box_of(w, row, mesh, {.tp = 1}).to_string(), "[0:8, 3:6]");
  // Split along dp, then what is left along tp (dp is the outer dimension).
  const ShardingSpec both = column.with(MeshDim::kDp, Placement::shard(0));
  EXPECT_EQ(box_of(w, both, mesh, {.dp = 1, .tp = 0}).to_string(), "[4:6, 0:6]");
  EXPECT_EQ(box_of(w, both, mesh, {.dp = 1, .tp = 1}).to_string(), "[6:8, 0:6]");
  EXPECT_THROW(
      box_of(w, ShardingSpec::replicated().with(MeshDim::kTp, Placement::shard(2)), mesh, {}),
      ValueError);
  EXPECT_EQ(column.to_string(), "pp:Replicate() dp:Replicate() cp:Replicate() tp:Shard(0)");
}

TEST(ReplicaOf, CountsTheReplicatedDimensionsAmongDpCpTp) {
  const DeviceMesh mesh{.pp = 2, .dp = 2, .cp = 1, .tp = 3};
  const ShardingSpec rep = ShardingSpec::replicated();
  EXPECT_EQ(replicas_of(rep, mesh), 6);  // dp x tp (pipeline stages are not replicas)
  EXPECT_EQ(replica_of(rep, mesh, {.pp = 1, .dp = 1, .tp = 2}), 5);
  const ShardingSpec tp_sharded = rep.with(MeshDim::kTp, Placement::shard(0));
  EXPECT_EQ(replicas_of(tp_sharded, mesh), 2);
  EXPECT_EQ(replica_of(tp_sharded, mesh, {.dp = 1, .tp = 2}), 1);
  const ShardingSpec zero = rep.with(MeshDim::kDp, Placement::shard_flat());
  EXPECT_EQ(replicas_of(zero, mesh), 3);
  EXPECT_EQ(replica_of(zero, mesh, {.dp = 1, .tp = 2}), 2);
}

PlacementEntry entry(const std::string& name, const Shape& shape, Box box,
                     std::optional<FlatRange> flat = std::nullopt, int replica = 0,
                     int replicas = 1) {
  PlacementEntry e;
  e.name = e.param = name;
  e.global_shape = shape;
  e.box = std::move(box);
  e.flat = flat;
  e.replica = replica;
  e.replicas = replicas;
  return e;
}

Box box(std::vector<int64_t> offsets, std::vector<int64_t> sizes) {
  return {std::move(offsets), std::move(sizes)};
}

TEST(GlobalRuns, AColumnBlockIsARunPerRowAndARowBlockOneRun) {
  const Shape w = {4, 6};
  const auto rows = entry("w", w, box({2, 0}, {2, 6})).global_runs();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].first, (FlatRange{12, 12}));
  EXPECT_EQ(rows[0].second, 0);
  const auto cols = entry("w", w, box({0, 3}, {4, 3})).global_runs();
  ASSERT_EQ(cols.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(cols[i].first, (FlatRange{static_cast<int64_t>(6 * i + 3), 3}));
    EXPECT_EQ(cols[i].second, static_cast<int64_t>(3 * i));
  }
  // A flat range inside the column block: elements 2..6 of its 12 (row 0's last, row 1, row 2's
  // first two).
  const auto inside = entry("w", w, box({0, 3}, {4, 3}), FlatRange{2, 5}).global_runs();
  ASSERT_EQ(inside.size(), 3u);
  EXPECT_EQ(inside[0].first, (FlatRange{5, 1}));
  EXPECT_EQ(inside[1].first, (FlatRange{9, 3}));
  EXPECT_EQ(inside[2].first, (FlatRange{15, 1}));
  EXPECT_EQ(inside[2].second, 4);
  EXPECT_TRUE(entry("w", w, Box::whole(w)).is_whole());
  EXPECT_FALSE(entry("w", w, Box::whole(w), FlatRange{0, 23}).is_whole());
}

// Two tensor-parallel ranks of a [12, 4] fused q|k|v weight (C = 4, 2 heads of 2): each holds its
// head's rows of q, of k and of v, three boxes.
std::vector<PlacementTable> fused_qkv_tables() {
  const Shape qkv = {12, 4};
  std::vector<PlacementTable> tables(2);
  for (int r = 0; r < 2; ++r) {
    for (int part = 0; part < 3; ++part) {
      tables[static_cast<size_t>(r)].push_back(
          entry("attn.c_attn.weight", qkv, box({part * 4 + r * 2, 0}, {2, 4})));
    }
  }
  return tables;
}

TEST(Coverage, HandMadeTensorParallelLayoutsCoverEveryElementOnce) {
  const Shape w = {8, 6};
  const DeviceMesh tp2{.tp = 2};
  for (int dim : {0, 1}) {  // column- and row-parallel
    const ShardingSpec spec = ShardingSpec::replicated().with(MeshDim::kTp, Placement::shard(dim));
    std::vector<PlacementTable> tables(2);
    for (int r = 0; r < 2; ++r) {
      tables[static_cast<size_t>(r)].push_back(entry("w", w, box_of(w, spec, tp2, {.tp = r})));
    }
    EXPECT_TRUE(coverage_errors(tables).empty()) << "Shard(" << dim << ")";
  }
  EXPECT_TRUE(coverage_errors(fused_qkv_tables()).empty());
  // ZeRO over a tensor-parallel shard: dp 2 x tp 2, tp's row block split in two flat ranges
  // over dp; replicated nowhere, so one replica.
  std::vector<PlacementTable> zero(4);
  const ShardingSpec spec = ShardingSpec::replicated()
                                .with(MeshDim::kTp, Placement::shard(0))
                                .with(MeshDim::kDp, Placement::shard_flat());
  const DeviceMesh mesh{.dp = 2, .tp = 2};
  for (int rank = 0; rank < 4; ++rank) {
    const MeshCoord c = mesh.coordinate_of(rank);
    const Box b = box_of(w, spec, mesh, c);
    const FlatRange half = split_dim(b.numel(), 2, c.dp);
    zero[static_cast<size_t>(rank)].push_back(entry("w", w, b, half, 0, replicas_of(spec, mesh)));
  }
  EXPECT_TRUE(coverage_errors(zero).empty());
  // Replicated over dp x tp: four replicas of a whole tensor.
  std::vector<PlacementTable> ddp(4);
  for (int rank = 0; rank < 4; ++rank) {
    ddp[static_cast<size_t>(rank)].push_back(entry("w", w, Box::whole(w), std::nullopt, rank, 4));
  }
  EXPECT_TRUE(coverage_errors(ddp).empty());
}

TEST(Coverage, GapsOverlapsAndOutsideBoxesAreNamed) {
  struct Case {
    std::string what;
    std::vector<PlacementTable> tables;
    std::string words;
  };
  std::vector<Case> cases;
  {
    auto t = fused_qkv_tables();
    t[1].erase(t[1].begin() + 1);  // rank 1's k rows
    cases.push_back({"a missing box", t, "elements [24, 32) are held by no rank"});
  }
  {
    auto t = fused_qkv_tables();
    t[1][2].box = box({6, 0}, {2, 4});  // rank 1's v rows moved onto rank 0's k rows
    cases.push_back({"an overlap", t, "is held twice (again by rank 1)"});
  }
  {
    auto t = fused_qkv_tables();
    t[0][0].box = box({11, 0}, {2, 4});
    cases.push_back({"a box outside", t, "lies outside shape [12, 4]"});
  }
  {
    auto t = fused_qkv_tables();
    t[1][0].replicas = 2;
    cases.push_back({"replica counts that disagree", t, "2 replica(s), unlike rank 0's"});
  }
  {
    const Shape w = {4, 6};
    std::vector<PlacementTable> t(2);
    t[0].push_back(entry("w", w, Box::whole(w), FlatRange{0, 12}));
    t[1].push_back(entry("w", w, Box::whole(w), FlatRange{13, 11}));
    cases.push_back({"a gap between flat ranges", t, "elements [12, 13) are held by no rank"});
  }
  for (const Case& c : cases) {
    const auto errors = coverage_errors(c.tables);
    ASSERT_FALSE(errors.empty()) << c.what;
    bool found = false;
    for (const auto& e : errors) found |= e.find(c.words) != std::string::npos;
    EXPECT_TRUE(found) << c.what << ": " << errors.front();
  }
}

}  // namespace
}  // namespace acc::dist
