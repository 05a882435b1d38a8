#include "acc/data/loader.hpp"

#include "acc/util/error.hpp"

namespace acc::data {

int64_t Shard::per_rank() const {
  ACC_CHECK(ranks >= 1, "data shard: ranks must be >= 1, got ", ranks);
  ACC_CHECK(rank >= 0 && rank < ranks, "data shard: rank ", rank, " is outside [0, ", ranks, ")");
  ACC_CHECK(global_batch >= 1, "data shard: global batch must be >= 1, got ", global_batch);
  ACC_CHECK(global_batch % ranks == 0, "data shard: global batch ", global_batch,
            " does not split over ", ranks, " data-parallel rank(s)");
  return global_batch / ranks;
}

std::vector<int64_t> Shard::sample_indices(int64_t step) const {
  const int64_t n = per_rank();
  ACC_CHECK(step >= 0, "data shard: step must be >= 0, got ", step);
  ACC_CHECK(step <= (INT64_MAX - global_batch) / global_batch, "data shard: step ", step,
            " is past the last sample index a 64-bit integer holds (global batch ", global_batch,
            ")");
  std::vector<int64_t> out(static_cast<size_t>(n));
  const int64_t first = step * global_batch + rank * n;
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = first + i;
  return out;
}

nlohmann::json Shard::to_json() const {
  return {{"rank", rank}, {"ranks", ranks}, {"global_batch", global_batch}};
}

}  // namespace acc::data
