#include "acc/nn/head_split.hpp"

#include "acc/tensor/node.hpp"
#include "acc/util/error.hpp"

namespace acc::nn {

HeadShard shard_heads(int64_t num_heads, int64_t num_kv_heads, int tp, int rank) {
  ACC_CHECK(tp >= 1, "shard_heads: tp must be >= 1, got ", tp);
  ACC_CHECK(rank >= 0 && rank < tp, "shard_heads: rank ", rank, " is outside [0, ", tp, ")");
  ACC_CHECK(num_heads >= 1 && num_kv_heads >= 1, "shard_heads: head counts must be >= 1, got ",
            num_heads, " query and ", num_kv_heads, " key/value heads");
  ACC_CHECK(num_heads % num_kv_heads == 0, "shard_heads: num_heads ", num_heads,
            " is not a multiple of num_kv_heads ", num_kv_heads);
  ACC_CHECK(num_heads % tp == 0, "shard_heads: num_heads ", num_heads, " is not a multiple of tp ",
            tp, " (each rank holds whole query heads, the same number)");
  ACC_CHECK(num_kv_heads % tp == 0 || tp % num_kv_heads == 0, "shard_heads: num_kv_heads ",
            num_kv_heads, " and tp ", tp,
            ": neither is a multiple of the other, so a rank's query heads would use parts of two "
            "key/value groups");
  HeadShard s;
  const int64_t per_rank = num_heads / tp;
  s.q = {rank * per_rank, per_rank};
  if (num_kv_heads >= tp) {
    const int64_t kv_per_rank = num_kv_heads / tp;
    s.kv = {rank * kv_per_rank, kv_per_rank};
  } else {
    // tp/NKV consecutive ranks cover one kv head's group of query heads.
    s.kv_replicas = tp / num_kv_heads;
    s.kv = {rank / s.kv_replicas, 1};
  }
  return s;
}

RowBlock head_rows(const HeadRange& heads, int64_t head_dim, int64_t base) {
  ACC_CHECK(head_dim >= 1, "head_rows: head_dim must be >= 1, got ", head_dim);
  ACC_CHECK(heads.first >= 0 && heads.count >= 0 && base >= 0, "head_rows: heads [", heads.first,
            ", ", heads.first + heads.count, ") from row ", base, " are not a range of heads");
  return {base + heads.first * head_dim, heads.count * head_dim};
}

std::array<RowBlock, 3> fused_qkv_rows(int64_t num_heads, int64_t head_dim, int tp, int rank) {
  const HeadShard s = shard_heads(num_heads, num_heads, tp, rank);
  const RowBlock q = head_rows(s.q, head_dim);
  const int64_t C = num_heads * head_dim;
  return {q, RowBlock{C + q.offset, q.size}, RowBlock{2 * C + q.offset, q.size}};
}

QkvRows qkv_rows(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int tp, int rank) {
  const HeadShard s = shard_heads(num_heads, num_kv_heads, tp, rank);
  const RowBlock kv = head_rows(s.kv, head_dim);
  return {head_rows(s.q, head_dim), kv, kv};
}

Tensor gather_rows(const Tensor& t, const std::vector<RowBlock>& blocks) {
  ACC_CHECK_SHAPE(t.defined() && t.dim() >= 1, "gather_rows: expects a tensor with rows, got ",
                  t.defined() ? to_string(t.shape()) : std::string("an undefined tensor"));
  int64_t rows = 0;
  for (const RowBlock& b : blocks) {
    ACC_CHECK_SHAPE(b.offset >= 0 && b.size >= 0 && b.offset <= t.size(0) - b.size,
                    "gather_rows: rows [", b.offset, ", ", b.offset + b.size,
                    ") are not within the ", t.size(0), " rows of ", t.shape());
    rows += b.size;
  }
  Shape shape = t.shape();
  shape[0] = rows;
  NoGradGuard ng;
  Tensor out = empty(shape, {t.dtype(), t.device(), false});
  int64_t at = 0;
  for (const RowBlock& b : blocks) {
    out.narrow(0, at, b.size).copy_(t.narrow(0, b.offset, b.size));
    at += b.size;
  }
  return out;
}

}  // namespace acc::nn
