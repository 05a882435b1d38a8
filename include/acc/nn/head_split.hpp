#pragma once
// Which attention heads, and which rows of the attention's projections, tensor-parallel rank r of
// tp holds when the heads are split over the tp ranks (Megatron's column-parallel q/k/v): pure
// index arithmetic, for the transform that builds the shards and for the placement table's boxes.
//
// Query heads are split evenly: rank r holds NH/tp consecutive heads. Key/value heads follow the
// query heads that use them (grouped-query attention, query head h uses kv head h / (NH/NKV)):
// NKV/tp of them when NKV >= tp, and when NKV < tp the one kv head the rank's query heads share,
// which tp/NKV ranks then hold alike. Head h of a projection is rows [h HS, (h + 1) HS) of its
// weight (out, in) and of its bias.

#include <array>
#include <cstdint>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc::nn {

/// Heads [first, first + count).
struct HeadRange {
  int64_t first = 0;
  int64_t count = 0;
  bool operator==(const HeadRange&) const = default;
};

/// Rows [offset, offset + size) of a projection's weight (out, in), whole along `in` (a box of
/// offsets {offset, 0} and sizes {size, in}), or of its bias (out).
struct RowBlock {
  int64_t offset = 0;
  int64_t size = 0;
  bool operator==(const RowBlock&) const = default;
};

/// The heads rank `rank` of `tp` holds of an attention with `num_heads` query heads and
/// `num_kv_heads` key/value heads (= num_heads without grouped-query attention).
struct HeadShard {
  HeadRange q;   // [rank NH/tp, (rank + 1) NH/tp)
  HeadRange kv;  // the kv heads of those query heads: NKV/tp of them, or 1 when NKV < tp
  /// How many ranks hold each of this rank's kv heads: tp/NKV when NKV < tp, else 1.
  int64_t kv_replicas = 1;
  bool operator==(const HeadShard&) const = default;
};

/// Throws acc::ValueError naming the values when tp < 1, rank is outside [0, tp), a head count is
/// < 1, num_heads is not a multiple of num_kv_heads, num_heads is not a multiple of tp, or neither
/// of num_kv_heads and tp is a multiple of the other (a rank's query heads would use parts of
/// two kv heads' groups).
HeadShard shard_heads(int64_t num_heads, int64_t num_kv_heads, int tp, int rank);

/// The rows of `heads` of `head_dim` features in a projection whose head 0 starts at row `base`.
/// Throws acc::ValueError when head_dim < 1 or the range or base is negative.
RowBlock head_rows(const HeadRange& heads, int64_t head_dim, int64_t base = 0);

/// GPT's fused c_attn: weight (3C, C) and bias (3C) are q | k | v, C = num_heads * head_dim rows
/// each. Rank r's three blocks are the rows of its q heads, of its k heads and of its v heads, in
/// that order: concatenated along dim 0 (gather_rows) they are the local c_attn (3 C/tp, C) that
/// CausalSelfAttention splits into q | k | v of num_heads/tp heads. Throws acc::ValueError as
/// shard_heads (num_heads % tp != 0 named) or when head_dim < 1.
std::array<RowBlock, 3> fused_qkv_rows(int64_t num_heads, int64_t head_dim, int tp, int rank);

/// Llama's separate projections: rank r's rows of q_proj (NH HS rows), of k_proj and of v_proj
/// (NKV HS rows each; the same block on every rank that shares the kv head). o_proj's weight
/// (C, NH HS) takes the q block as columns. Throws as shard_heads and head_rows.
struct QkvRows {
  RowBlock q, k, v;
  bool operator==(const QkvRows&) const = default;
};
QkvRows qkv_rows(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int tp, int rank);

/// A new tensor of the rows `blocks` of `t` (dimension 0), concatenated in order: a rank's local
/// weight or bias from the whole one. No autograd history. Throws acc::ShapeError when a block is
/// not within t's rows or t has no dimension.
Tensor gather_rows(const Tensor& t, const std::vector<RowBlock>& blocks);

}  // namespace acc::nn
