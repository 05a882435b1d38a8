// The mesh at 4 ranks with no tensor-parallel method in the strategy: dp = 2 x tp = 2, where the tp
// dimension holds replicated parameters (its two ranks compute the same thing on the same data).
//  - every data-parallel method trains bitwise like dp = 2 alone (the reference runs on the two
//    ranks of each tp coordinate, the same ranks the mesh's dp group reduces over);
//  - the gradient norm equals one process's (within fp32 rounding): a tensor replicated along tp
//    is counted once, not tp times (sqrt(2) too large before: the trap Megatron users hit);
//  - the data each rank reads is what its dp coordinate says: tp peers read the same samples, the
//    two dp coordinates the two halves of the global batch;
//  - the placement table over the mesh covers every element once per replica (replicas along dp
//    and tp for whole tensors, along tp for the flat shards of zero and fsdp).
#include <gtest/gtest.h>

#include <cmath>

#include "acc/data/token_data.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/dist/device_mesh.hpp"
#include "acc/dist/dist.hpp"
#include "acc/dist/sharding.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/util/hash.hpp"
#include "every_rank_table.hpp"

namespace acc {
namespace {

constexpr int64_t kGlobalBatch = 8, kSeq = 16, kSteps = 5;

std::shared_ptr<const data::TokenFile> tokens() {
  static auto t = [] {
    std::vector<uint32_t> v(static_cast<size_t>((kSteps + 1) * kGlobalBatch * kSeq + kSeq + 1));
    uint32_t x = 777;
    for (auto& e : v) {
      x = x * 1103515245u + 12345u;
      e = (x >> 16) % 64;
    }
    return std::make_shared<const data::TokenFile>(std::move(v), "<synthetic>", 64);
  }();
  return t;
}

models::LanguageModelPtr make_model() {
  models::GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 64;
  c.block_size = kSeq;
  c.bias = false;
  manual_seed(5);
  return std::make_shared<models::GPT>(c);
}

data::BatchLoader loader_for(int rank, int world) {
  return data::BatchLoader(tokens(), {.batch_size = kGlobalBatch / world,
                                      .seq_len = kSeq,
                                      .order = data::SampleOrder::kSequential,
                                      .rank = rank,
                                      .world = world});
}

struct TrainRun {
  std::vector<double> losses, norms;
  std::vector<std::pair<std::string, Tensor>> params;
  dist::PlacementTable table;
};

// kSteps of AdamW with clipping on (the norm is used) on `ctx`'s mesh, each rank reading the
// samples of its dp coordinate.
TrainRun train(const std::string& strategy, const dist::ParallelContextPtr& ctx) {
  auto trainer = strategies::apply(make_model(), optim::AdamW::factory({.lr = 1e-2}),
                                   strategies::parse_strategy(nlohmann::json::parse(strategy)),
                                   {.context = ctx, .grad_clip = 0.5});
  data::BatchLoader loader = loader_for(ctx->data_rank(), ctx->data_world());
  TrainRun r;
  for (int64_t s = 0; s < kSteps; ++s) {
    r.losses.push_back(trainer->train_step(loader.next()));
    r.norms.push_back(trainer->last_grad_norm());
  }
  r.params = trainer->full_parameters();
  r.table = trainer->placements();
  return r;
}

class Mesh : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (dist::world_size() != 4) GTEST_SKIP() << "a 2 x 2 mesh needs 4 ranks";
  }
};

TEST_P(Mesh, Dp2Tp2WithReplicatedTpTrainsBitwiseLikeDp2) {
  auto world = dist::ProcessGroup::world();
  const int r = world->rank();
  auto mesh =
      std::make_shared<const dist::ParallelContext>(dist::DeviceMesh{.dp = 2, .tp = 2}, world);
  ASSERT_EQ(mesh->coordinate(dist::MeshDim::kTp), r % 2);
  ASSERT_EQ(mesh->coordinate(dist::MeshDim::kDp), r / 2);
  const TrainRun got = train(GetParam(), mesh);
  // dp = 2 alone: the two ranks of this tp coordinate (ranks r % 2 and r % 2 + 2).
  auto pair = world->split(r % 2, r / 2, "dp_only");
  const TrainRun ref = train(GetParam(), dist::ParallelContext::data_parallel(pair));
  EXPECT_EQ(got.losses, ref.losses);
  EXPECT_EQ(got.norms, ref.norms);
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_EQ(got.params[i].second.to_vector<float>(), ref.params[i].second.to_vector<float>())
        << got.params[i].first;
  }
}

TEST_P(Mesh, TheGradientNormCountsATpReplicatedTensorOnce) {
  auto world = dist::ProcessGroup::world();
  auto mesh =
      std::make_shared<const dist::ParallelContext>(dist::DeviceMesh{.dp = 2, .tp = 2}, world);
  const TrainRun got = train(GetParam(), mesh);
  // One process with the global batch (the strategy's grad_sync left out: one rank).
  auto self = world->split(world->rank(), 0, "self_ref");
  const TrainRun one = train("[]", dist::ParallelContext::data_parallel(self));
  ASSERT_EQ(got.norms.size(), one.norms.size());
  for (size_t s = 0; s < one.norms.size(); ++s) {
    EXPECT_NEAR(got.norms[s], one.norms[s], 1e-5 * one.norms[s]) << "step " << s;
  }
}

TEST_P(Mesh, ThePlacementTableCoversTheMeshOncePerReplica) {
  auto world = dist::ProcessGroup::world();
  auto mesh =
      std::make_shared<const dist::ParallelContext>(dist::DeviceMesh{.dp = 2, .tp = 2}, world);
  const TrainRun got = train(GetParam(), mesh);
  // Every rank's table, on every rank.
  const std::vector<dist::PlacementTable> tables = test::every_rank_table(*world, got.table);
  for (const auto& e : dist::coverage_errors(tables)) ADD_FAILURE() << e;
  // Replicated tensors (ddp, zero's parameters): one replica per rank. Flat shards (zero's state,
  // zero2's gradients, fsdp): one replica per tp coordinate, split over dp.
  for (const auto& e : got.table) {
    if (e.spec.any(dist::Placement::Kind::kShardFlat)) {
      EXPECT_EQ(e.replicas, 2) << e.name;
      EXPECT_EQ(e.replica, mesh->coordinate(dist::MeshDim::kTp)) << e.name;
    } else {
      EXPECT_EQ(e.replicas, 4) << e.name;
      EXPECT_EQ(e.replica, world->rank()) << e.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DataParallelMethods, Mesh,
                         testing::Values(R"([{"name": "ddp"}])",
                                         R"([{"name": "zero1", "config": {"bucket_mb": 0.01}}])",
                                         R"([{"name": "zero2", "config": {"bucket_mb": 0.01}}])",
                                         R"([{"name": "fsdp"}])"),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return std::string(
                               nlohmann::json::parse(info.param)[0]["name"].get<std::string>());
                         });

TEST(MeshData, EachRankReadsWhatItsDpCoordinateSays) {
  if (dist::world_size() != 4) GTEST_SKIP() << "a 2 x 2 mesh needs 4 ranks";
  auto world = dist::ProcessGroup::world();
  const dist::ParallelContext mesh(dist::DeviceMesh{.dp = 2, .tp = 2}, world);
  data::BatchLoader mine = loader_for(mesh.data_rank(), mesh.data_world());
  data::BatchLoader global = loader_for(0, 1);
  for (int64_t s = 0; s < 3; ++s) {
    const data::Batch b = mine.next();
    const data::Batch all = global.next();
    const int64_t B = b.idx().size(0), dp = mesh.coordinate(dist::MeshDim::kDp);
    EXPECT_EQ(b.idx().to_vector<int64_t>(), all.idx().narrow(0, dp * B, B).to_vector<int64_t>());
    // tp peers read the same samples, the two dp coordinates different ones.
    const auto ids = b.idx().to_vector<int64_t>();
    const std::string h = std::to_string(acc::fnv1a64(
        std::string_view(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int64_t))));
    const auto tp_peers = dist::allgather_text(*mesh.group(dist::MeshDim::kTp), h);
    EXPECT_EQ(tp_peers[0], tp_peers[1]);
    const auto dp_peers = dist::allgather_text(*mesh.group(dist::MeshDim::kDp), h);
    EXPECT_NE(dp_peers[0], dp_peers[1]);
  }
}

}  // namespace
}  // namespace acc
