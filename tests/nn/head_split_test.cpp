// The per-head split of attention projections over tensor-parallel ranks (head_split.hpp): tables
// of what each rank holds, the refusals, and the local fused weight gathered from the blocks.

#include <gtest/gtest.h>

#include "acc/nn/head_split.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc {
namespace {

using nn::HeadRange;
using nn::HeadShard;
using nn::RowBlock;
using test::error_of;

TEST(HeadSplit, ShardHeadsTable) {
  struct Row {
    int64_t nh, nkv;
    int tp, rank;
    HeadShard want;
  };
  const std::vector<Row> rows = {
      // No split.
      {4, 4, 1, 0, {{0, 4}, {0, 4}, 1}},
      // Multi-head attention: a rank's kv heads are its query heads.
      {4, 4, 2, 0, {{0, 2}, {0, 2}, 1}},
      {4, 4, 2, 1, {{2, 2}, {2, 2}, 1}},
      {12, 12, 4, 3, {{9, 3}, {9, 3}, 1}},
      // GQA, NKV >= tp: NKV/tp kv heads each (8 query heads, groups of 2).
      {8, 4, 2, 0, {{0, 4}, {0, 2}, 1}},
      {8, 4, 2, 1, {{4, 4}, {2, 2}, 1}},
      {8, 4, 4, 3, {{6, 2}, {3, 1}, 1}},
      // GQA, NKV < tp: the one kv head a rank's query heads share, held by tp/NKV ranks.
      {8, 2, 4, 0, {{0, 2}, {0, 1}, 2}},
      {8, 2, 4, 1, {{2, 2}, {0, 1}, 2}},
      {8, 2, 4, 2, {{4, 2}, {1, 1}, 2}},
      {8, 2, 4, 3, {{6, 2}, {1, 1}, 2}},
      // Multi-query attention: every rank holds the single kv head.
      {4, 1, 4, 2, {{2, 1}, {0, 1}, 4}},
      {32, 8, 8, 5, {{20, 4}, {5, 1}, 1}},
      {32, 8, 16, 11, {{22, 2}, {5, 1}, 2}},
  };
  for (const auto& r : rows) {
    EXPECT_EQ(nn::shard_heads(r.nh, r.nkv, r.tp, r.rank), r.want)
        << "nh " << r.nh << " nkv " << r.nkv << " tp " << r.tp << " rank " << r.rank;
  }
  // Every query head on exactly one rank, and a rank's kv heads are those its query heads use.
  for (const auto& [nh, nkv, tp] : std::vector<std::tuple<int64_t, int64_t, int>>{
           {8, 4, 2}, {8, 2, 4}, {8, 8, 8}, {16, 4, 8}, {16, 1, 4}, {24, 6, 3}}) {
    std::vector<int> owners(static_cast<size_t>(nh), 0);
    for (int r = 0; r < tp; ++r) {
      const HeadShard s = nn::shard_heads(nh, nkv, tp, r);
      // The local attention maps local query head i to local kv head i / (local group size):
      // that must be the kv head the global query head uses.
      ASSERT_EQ(s.q.count % s.kv.count, 0);
      const int64_t local_group = s.q.count / s.kv.count;
      for (int64_t h = s.q.first; h < s.q.first + s.q.count; ++h) {
        ++owners[static_cast<size_t>(h)];
        const int64_t kv = h / (nh / nkv);
        EXPECT_EQ(s.kv.first + (h - s.q.first) / local_group, kv)
            << "query head " << h << " of rank " << r << " (nh " << nh << " nkv " << nkv << " tp "
            << tp << ")";
      }
    }
    EXPECT_EQ(owners, std::vector<int>(static_cast<size_t>(nh), 1));
  }
}

TEST(HeadSplit, FusedQkvRowsOfGpt) {
  // 4 heads of 8 features: c_attn (96, C) = q rows [0, 32) | k [32, 64) | v [64, 96).
  using Blocks = std::array<RowBlock, 3>;
  EXPECT_EQ(nn::fused_qkv_rows(4, 8, 1, 0), (Blocks{{{0, 32}, {32, 32}, {64, 32}}}));
  EXPECT_EQ(nn::fused_qkv_rows(4, 8, 2, 0), (Blocks{{{0, 16}, {32, 16}, {64, 16}}}));
  EXPECT_EQ(nn::fused_qkv_rows(4, 8, 2, 1), (Blocks{{{16, 16}, {48, 16}, {80, 16}}}));
  EXPECT_EQ(nn::fused_qkv_rows(4, 8, 4, 3), (Blocks{{{24, 8}, {56, 8}, {88, 8}}}));
  // GPT-2 small: 12 heads of 64, tp 4, rank 1: heads 3..5.
  EXPECT_EQ(nn::fused_qkv_rows(12, 64, 4, 1),
            (Blocks{{{192, 192}, {768 + 192, 192}, {1536 + 192, 192}}}));
}

TEST(HeadSplit, QkvRowsOfLlama) {
  // 8 query heads, 2 kv heads of 4 features: q_proj 32 rows, k_proj / v_proj 8 rows.
  EXPECT_EQ(nn::qkv_rows(8, 2, 4, 2, 1), (nn::QkvRows{{16, 16}, {4, 4}, {4, 4}}));
  // tp 4 > 2 kv heads: ranks 0 and 1 hold kv head 0, ranks 2 and 3 kv head 1.
  EXPECT_EQ(nn::qkv_rows(8, 2, 4, 4, 0), (nn::QkvRows{{0, 8}, {0, 4}, {0, 4}}));
  EXPECT_EQ(nn::qkv_rows(8, 2, 4, 4, 1), (nn::QkvRows{{8, 8}, {0, 4}, {0, 4}}));
  EXPECT_EQ(nn::qkv_rows(8, 2, 4, 4, 2), (nn::QkvRows{{16, 8}, {4, 4}, {4, 4}}));
  EXPECT_EQ(nn::qkv_rows(8, 8, 4, 8, 7), (nn::QkvRows{{28, 4}, {28, 4}, {28, 4}}));
  EXPECT_EQ(nn::head_rows(HeadRange{3, 2}, 16), (RowBlock{48, 32}));
  EXPECT_EQ(nn::head_rows(HeadRange{3, 2}, 16, 100), (RowBlock{148, 32}));
}

TEST(HeadSplit, RefusalsNameTheValues) {
  struct Row {
    std::function<void()> call;
    std::string expect;
  };
  const std::vector<Row> rows = {
      {[] { nn::shard_heads(6, 6, 4, 0); },
       "shard_heads: num_heads 6 is not a multiple of tp 4 (each rank holds whole query heads"},
      {[] { nn::fused_qkv_rows(12, 64, 5, 0); }, "num_heads 12 is not a multiple of tp 5"},
      {[] { nn::qkv_rows(12, 4, 8, 6, 0); },
       "num_kv_heads 4 and tp 6: neither is a multiple of the other"},
      {[] { nn::shard_heads(8, 3, 2, 0); }, "num_heads 8 is not a multiple of num_kv_heads 3"},
      {[] { nn::shard_heads(8, 8, 0, 0); }, "tp must be >= 1, got 0"},
      {[] { nn::shard_heads(8, 8, 2, 2); }, "rank 2 is outside [0, 2)"},
      {[] { nn::shard_heads(8, 8, 2, -1); }, "rank -1 is outside [0, 2)"},
      {[] { nn::shard_heads(0, 1, 1, 0); }, "head counts must be >= 1, got 0 query and 1"},
      {[] { nn::fused_qkv_rows(4, 0, 2, 0); }, "head_rows: head_dim must be >= 1, got 0"},
      {[] {
         nn::head_rows(HeadRange{-1, 2}, 8);
       },
       "heads [-1, 1) from row 0 are not a range"},
  };
  for (const auto& r : rows) {
    const std::string msg = error_of<ValueError>(r.call);
    EXPECT_NE(msg.find(r.expect), std::string::npos) << msg;
  }
}

TEST(HeadSplit, GatherRowsBuildsTheLocalFusedWeight) {
  // c_attn of 4 heads of 2 features over C = 3 inputs: row i holds i everywhere.
  const int64_t NH = 4, HS = 2, C = NH * HS;
  std::vector<float> w;
  for (int64_t i = 0; i < 3 * C; ++i) w.insert(w.end(), 3, static_cast<float>(i));
  const Tensor weight = from_vector(w, {3 * C, 3});
  const auto blocks = nn::fused_qkv_rows(NH, HS, 2, 1);
  const Tensor local = nn::gather_rows(weight, {blocks.begin(), blocks.end()});
  ASSERT_EQ(local.shape(), (Shape{3 * C / 2, 3}));
  std::vector<float> first_column;
  for (int64_t i = 0; i < local.size(0); ++i) first_column.push_back(local.data<float>()[i * 3]);
  // q heads 2, 3 (rows 4..7), k heads 2, 3 (rows 12..15), v heads 2, 3 (rows 20..23).
  EXPECT_EQ(first_column, (std::vector<float>{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23}));
  const Tensor bias = from_vector(std::vector<float>{0, 1, 2, 3, 4, 5}, {6});
  EXPECT_EQ(nn::gather_rows(bias, {{4, 2}, {0, 1}}).to_vector<float>(),
            (std::vector<float>{4, 5, 0}));
  const std::string msg = error_of<ShapeError>([&] { nn::gather_rows(bias, {{5, 2}}); });
  EXPECT_NE(msg.find("gather_rows: rows [5, 7) are not within the 6 rows of [6]"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace acc
