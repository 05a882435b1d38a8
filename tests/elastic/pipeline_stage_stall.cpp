// A GPT cut into two pipeline stages (pipeline_parallel, 1F1B, 2 micro-batches) under the elastic
// agent, for hang_test: with ACC_FAULT stalling rank 0 before its first message of step 3, rank 1
// waits in the receive of that step's first activation, and the hang analysis names both ranks by
// their stage.
//
//   mpirun -np 2 -x ACC_HANG_TIMEOUT_SEC=3
//     -x ACC_FAULT=stall:rank=0:step=3:phase=collective pipeline_stage_stall

#include <cstdio>
#include <exception>

#include "acc/data/batch.hpp"
#include "acc/dist/dist.hpp"
#include "acc/elastic/agent.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/util/progress.hpp"

int main(int argc, char** argv) {
  using namespace acc;
  dist::Session session(argc, argv);
  auto world = dist::ProcessGroup::world();
  if (world->size() != 2) {
    std::fprintf(stderr, "pipeline_stage_stall: needs 2 ranks, got %d\n", world->size());
    return 2;
  }
  try {
    auto agent = elastic::Agent::start(world);
    manual_seed(1);
    auto model = models::create_model(
        "gpt",
        {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 16}, {"vocab_size", 32}, {"block_size", 8}});
    auto trainer = strategies::apply(
        model, optim::AdamW::factory({}),
        strategies::parse_strategy(nlohmann::json::parse(
            R"([{"name": "pipeline_parallel", "config": {"size": 2, "micro_batches": 2}}])")));
    agent->watch(trainer->context()->group(dist::MeshDim::kPp));  // as acc::Session watches it
    const Tensor idx = zeros({2, 8}, {DType::kInt64});
    for (int64_t step = 0; step < 8; ++step) {
      progress::step(step);
      trainer->train_step(data::Batch(idx, idx));
    }
    std::printf("pipeline_stage_stall: rank %d done\n", world->rank());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_stage_stall: rank %d: %s\n", world->rank(), e.what());
    return 1;
  }
  return 0;
}
