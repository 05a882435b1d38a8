// Box-sharded placement tables, made by hand over real tensors, save and load into one another
// bitwise (under mpirun: 1, 2 and 4 ranks; a layout of n ranks runs on the world's first n). The
// layouts are those tensor and pipeline parallelism bring: a Megatron column block, a row block, a
// fused q|k|v block that is three boxes per rank, ZeRO's flat range inside a tensor-parallel box,
// column blocks replicated over dp, and the whole tensor on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>

#include "acc/checkpoint/checkpoint.hpp"
#include "acc/dist/dist.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"
#include "helpers.hpp"

namespace acc::ckpt {
namespace {

namespace fs = std::filesystem;
using dist::Box;
using dist::FlatRange;
using dist::MeshDim;
using dist::Placement;
using dist::ShardingSpec;

// Two tensors of one parameter, [12, 8]: 12 rows split 3 ways (q|k|v) and by 1, 2, 3 and 4; 8
// columns by 1, 2 and 4.
const Shape kShape = {12, 8};

// The global tensors: every element distinct, the state's unlike the parameter's.
Tensor global(const std::string& name) {
  const float base = name == "w" ? 1.0f : -1000.0f;
  std::vector<float> v(96);
  for (size_t i = 0; i < v.size(); ++i) v[i] = base + 0.25f * static_cast<float>(i);
  return from_vector(v, kShape);
}

// What a rank holds of one tensor: regions and its replica.
struct Held {
  Box box;
  std::optional<FlatRange> flat;
  ShardingSpec spec;
  int replica = 0, replicas = 1;
};

// A layout: the regions rank r of n holds (of each tensor alike).
using Layout = std::function<std::vector<Held>(int n, int r)>;

Box rows(int parts, int index, int64_t begin = 0, int64_t size = 12) {
  const FlatRange r = dist::split_dim(size, parts, index);
  return {{begin + r.offset, 0}, {r.length, 8}};
}

Box cols(int parts, int index) {
  const FlatRange c = dist::split_dim(8, parts, index);
  return {{0, c.offset}, {12, c.length}};
}

const ShardingSpec kReplicated = ShardingSpec::replicated();

const std::map<std::string, Layout>& layouts() {
  static const std::map<std::string, Layout> all = {
      // ddp: every rank the whole tensor, replica r of n (written once, by replica 0).
      {"whole",
       [](int n, int r) {
         return std::vector<Held>{{Box::whole(kShape), {}, kReplicated, r, n}};
       }},
      // Megatron row and column blocks over tp = n.
      {"rows",
       [](int n, int r) {
         return std::vector<Held>{
             {rows(n, r), {}, kReplicated.with(MeshDim::kTp, Placement::shard(0)), 0, 1}};
       }},
      {"cols",
       [](int n, int r) {
         return std::vector<Held>{
             {cols(n, r), {}, kReplicated.with(MeshDim::kTp, Placement::shard(1)), 0, 1}};
       }},
      // A fused q|k|v weight at tp = n: rank r holds its rows of q, of k and of v, three boxes.
      {"qkv",
       [](int n, int r) {
         const ShardingSpec s = kReplicated.with(MeshDim::kTp, Placement::shard(0));
         return std::vector<Held>{
             {rows(n, r, 0, 4), {}, s, 0, 1},
             {rows(n, r, 4, 4), {}, s, 0, 1},
             {rows(n, r, 8, 4), {}, s, 0, 1},
         };
       }},
      // ZeRO inside tensor parallelism: tp = min(2, n) column blocks, each split flat over
      // dp = n / tp (ranks: tp innermost).
      {"flat_in_cols",
       [](int n, int r) {
         const int tp = std::min(2, n), dp = n / tp;
         const Box box = cols(tp, r % tp);
         const FlatRange f = dist::split_dim(box.numel(), dp, r / tp);
         return std::vector<Held>{{box, f,
                                   kReplicated.with(MeshDim::kTp, Placement::shard(1))
                                       .with(MeshDim::kDp, Placement::shard_flat()),
                                   0, 1}};
       }},
      // Column blocks over tp = min(2, n), replicated over dp = n / tp: replica = the dp
      // coordinate; only replica 0's holders write.
      {"cols_replicated",
       [](int n, int r) {
         const int tp = std::min(2, n);
         return std::vector<Held>{{cols(tp, r % tp),
                                   {},
                                   kReplicated.with(MeshDim::kTp, Placement::shard(1)),
                                   r / tp,
                                   n / tp}};
       }},
  };
  return all;
}

// Rank r's table of layout `name` at n ranks: for 'w' and its exp_avg, an entry per region, its
// local tensor the global tensor's elements there (`fill`) or NaN (to be loaded).
dist::PlacementTable table_of(const std::string& name, int n, int r, bool fill) {
  dist::PlacementTable table;
  for (const auto& [tensor, kind] :
       {std::pair<std::string, dist::TensorKind>{"w", dist::TensorKind::kParameter},
        {"state.w.exp_avg", dist::TensorKind::kOptimizerState}}) {
    const Tensor g = global(tensor);
    for (const Held& h : layouts().at(name)(n, r)) {
      dist::PlacementEntry e;
      e.name = tensor;
      e.param = "w";
      e.kind = kind;
      e.field = kind == dist::TensorKind::kOptimizerState ? "exp_avg" : "";
      e.global_shape = kShape;
      e.box = h.box;
      e.flat = h.flat;
      e.spec = h.spec;
      e.replica = h.replica;
      e.replicas = h.replicas;
      std::vector<float> v(static_cast<size_t>(e.held_numel()),
                           std::numeric_limits<float>::quiet_NaN());
      if (fill) {
        for (const auto& [run, at] : e.global_runs()) {
          std::memcpy(v.data() + at, g.data<float>() + run.offset,
                      static_cast<size_t>(run.length) * sizeof(float));
        }
      }
      e.local = from_vector(v, {e.held_numel()});
      table.push_back(std::move(e));
    }
  }
  return table;
}

// A save of layout `name` at n ranks (the world's first n; the others wait), its step directory.
std::string save_layout(const std::string& root, const std::string& name, int n) {
  auto world = dist::ProcessGroup::world();
  std::string dir;
  if (world->rank() < n) {
    // 40-byte chunks: boxes and flat ranges are split into several chunks each, so loads take
    // parts of chunks and parts of boxes.
    dir = save(root, 1, table_of(name, n, world->rank(), true), {.model_trace_hash = "boxes"},
               *test::first(n), {.chunk_bytes = 40});
  }
  return dist::broadcast_text(*world, dir, 0);
}

std::map<std::string, Tensor> globals() {
  return {{"w", global("w").reshape({96})},
          {"state.w.exp_avg", global("state.w.exp_avg").reshape({96})}};
}

// Each layout covers each tensor once per replica (the test's own layouts checked first).
TEST(BoxLayouts, TheLayoutsCoverTheirTensors) {
  for (const auto& [name, layout] : layouts()) {
    for (int n : {1, 2, 4}) {
      std::vector<dist::PlacementTable> tables;
      for (int r = 0; r < n; ++r) tables.push_back(table_of(name, n, r, true));
      const auto errors = dist::coverage_errors(tables);
      EXPECT_TRUE(errors.empty()) << name << " at " << n << ": " << errors.front();
    }
  }
}

// Every layout saved at 1, 2 and 4 ranks loads into every layout at 1 to 4 ranks (those the world
// has) bitwise, and into one rank reading everything whole; among them a column split saved at 2
// loaded as a row split at 4, the q|k|v block, and the flat range inside a box.
TEST(BoxLayouts, EveryLayoutLoadsIntoEveryOtherBitwise) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size(), rank = world->rank();
  const std::string base = test::job_dir("boxes");
  for (int n = 1; n <= W; ++n) test::first(n);  // collective: made by every rank first
  const auto want = globals();
  int loads = 0;
  for (int src : {1, 2, 4}) {
    if (src > W) continue;
    for (const auto& [from, layout] : layouts()) {
      const std::string dir = save_layout(base + "/" + std::to_string(src) + "-" + from, from, src);
      const Metadata meta = read_metadata(dir);
      EXPECT_EQ(meta.version, kFormatVersion);
      EXPECT_EQ(meta.world, src);
      // Every rank reads everything whole.
      {
        const dist::PlacementTable t = table_of("whole", 1, 0, false);
        load(dir, meta, t);
        test::expect_regions_equal(t, want, std::to_string(src) + " x " + from + " -> whole");
      }
      for (int dst = 1; dst <= W; ++dst) {
        if (rank >= dst) continue;
        for (const auto& [to, unused] : layouts()) {
          if (to == "flat_in_cols" && dst == 3) continue;  // tp 2 does not divide 3 ranks
          if (to == "cols_replicated" && dst == 3) continue;
          const std::string what =
              std::to_string(src) + " x " + from + " -> " + std::to_string(dst) + " x " + to;
          const dist::PlacementTable t = table_of(to, dst, rank, false);
          load(dir, meta, t);
          test::expect_regions_equal(t, want, what);
          ++loads;
        }
      }
      world->barrier()->wait();
    }
  }
  if (rank == 0) std::printf("%d box layout loads checked on rank 0 (world %d)\n", loads, W);
  test::remove_job_dir(base);
}

// Replicas are written once across the mesh, by replica 0's holders: the shards of ranks holding
// only replica 1 are empty, and the chunks are boxes of the tensor (a column split's are columns).
TEST(BoxLayouts, AReplicaIsWrittenOnceAndBoxesAreStoredAsBoxes) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size();
  if (W < 4) GTEST_SKIP() << "needs 4 ranks (tp 2 x dp 2)";
  const std::string base = test::job_dir("replicas");
  for (int n = 1; n <= W; ++n) test::first(n);
  const std::string dir = save_layout(base + "/r", "cols_replicated", 4);
  const Metadata meta = read_metadata(dir);
  for (const TensorInfo& t : meta.tensors) {
    for (const ChunkInfo& c : t.chunks) {
      EXPECT_LT(c.file, 2) << t.name << ": written by rank " << c.file << ", a replica 1 holder";
      EXPECT_EQ(c.box, cols(2, c.file)) << t.name;
    }
  }
  if (world->rank() == 0) {
    EXPECT_EQ(fs::file_size(fs::path(dir) / shard_file_name(2)), 0u);
    EXPECT_EQ(fs::file_size(fs::path(dir) / shard_file_name(3)), 0u);
  }
  test::remove_job_dir(base);
}

// A load reads only the chunks that overlap what it holds: with rank 1's shard gone, rank 0's
// column block of a column split still loads, and rank 1's is refused naming the missing file.
TEST(BoxLayouts, ALoadReadsOnlyTheChunksItNeeds) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size();
  if (W < 2) GTEST_SKIP() << "needs 2 ranks";
  const std::string base = test::job_dir("only");
  for (int n = 1; n <= W; ++n) test::first(n);
  const std::string dir = save_layout(base + "/c", "cols", 2);
  world->barrier()->wait();
  if (world->rank() == 0) {
    fs::remove(fs::path(dir) / shard_file_name(1));
    const Metadata meta = read_metadata(dir);
    const dist::PlacementTable left = table_of("cols", 2, 0, false);
    load(dir, meta, left);
    test::expect_regions_equal(left, globals(), "column 0 without shard 1");
    const std::string msg =
        test::error_of<IoError>([&] { load(dir, meta, table_of("cols", 2, 1, false)); });
    EXPECT_NE(msg.find("'shard-00001.bin' is missing"), std::string::npos) << msg;
  }
  test::remove_job_dir(base);
}

// A table whose ranks do not cover a tensor exactly once is refused on every rank, naming it, and
// nothing is committed; an entry whose box lies outside its tensor is named.
TEST(BoxLayouts, ATableThatDoesNotCoverItsTensorsIsRefused) {
  auto world = dist::ProcessGroup::world();
  const std::string base = test::job_dir("refused");
  // Rank 0 holds column block 0 of 2, the others nothing: column block 1 is held by no rank.
  const dist::PlacementTable half =
      world->rank() == 0 ? table_of("cols", 2, 0, true) : dist::PlacementTable{};
  const std::string msg =
      test::error_of<IoError>([&] { save(base + "/half", 1, half, {}, *world); });
  EXPECT_NE(msg.find("checkpoint: 'state.w.exp_avg': its chunks leave indices [4, 8) of "
                     "dimension 1 (size 8) in no chunk"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(committed_steps(base + "/half").empty());
  // A box outside its tensor, named before anything is read.
  Metadata meta;
  TensorInfo w;
  w.name = "w";
  w.shape = kShape;
  meta.tensors = {w};
  dist::PlacementTable outside = table_of("cols", 2, 1, false);
  outside[0].box.offsets[1] = 5;  // [0:12, 5:9] of [12, 8]
  const std::string out = test::error_of<ValueError>([&] { load(base + "/none", meta, outside); });
  EXPECT_NE(out.find("checkpoint: 'w' holds box [0:12, 5:9], which is not inside its tensor of "
                     "shape [12, 8]"),
            std::string::npos)
      << out;
  test::remove_job_dir(base);
}

}  // namespace
}  // namespace acc::ckpt
