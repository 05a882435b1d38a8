// A dp=2 x tp=2 toy over 4 ranks under the elastic agent, for hang_test: each step every rank
// sums a tensor over its tp group (as a row-parallel layer does) and then over the world (as the
// loss average does), for 6 steps. With ACC_FAULT stalling rank 3 right before its collective at
// step 2, rank 2 waits in the all-reduce of its tp group that rank 3 never joins, while ranks 0
// and 1 complete theirs (the tp group of dp=0) and wait in the world's: what the hang detector
// must name as group 'tp' of dp=1.
//
//   mpirun -np 4 -x ACC_HANG_TIMEOUT_SEC=2
//     -x ACC_FAULT=stall:rank=3:step=2:phase=collective mesh_stall

#include <cstdio>
#include <exception>

#include "acc/dist/device_mesh.hpp"
#include "acc/dist/dist.hpp"
#include "acc/elastic/agent.hpp"
#include "acc/util/progress.hpp"

int main(int argc, char** argv) {
  using namespace acc;
  dist::Session session(argc, argv);
  auto world = dist::ProcessGroup::world();
  if (world->size() != 4) {
    std::fprintf(stderr, "mesh_stall: needs 4 ranks, got %d\n", world->size());
    return 2;
  }
  try {
    auto agent = elastic::Agent::start(world);
    const dist::ParallelContext ctx(dist::DeviceMesh{.dp = 2, .tp = 2}, world);
    const dist::ProcessGroupPtr& tp = ctx.group(dist::MeshDim::kTp);
    agent->watch(tp);
    for (int64_t step = 0; step < 6; ++step) {
      progress::step(step);
      progress::phase(progress::Phase::kForward);
      Tensor partial = full({4}, world->rank());
      tp->allreduce(partial)->wait();
      world->allreduce(partial)->wait();
    }
    std::printf("mesh_stall: rank %d done\n", world->rank());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mesh_stall: rank %d: %s\n", world->rank(), e.what());
    return 1;
  }
  return 0;
}
