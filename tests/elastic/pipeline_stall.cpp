// A two-stage toy pipeline under the elastic agent, for hang_test: each step rank 0 computes
// y = x W^T and sends it (dist::send_to), rank 1 receives it (dist::recv_from), computes a loss and
// sends the gradient back through its backward, for 8 steps. With ACC_FAULT stalling rank 0 right
// before its send at step 3, rank 1 waits in a recv that rank 0 never matches: what the hang
// detector must name by the message's own sequence number and peer.
//
//   mpirun -np 2 -x ACC_HANG_TIMEOUT_SEC=3
//     -x ACC_FAULT=stall:rank=0:step=3:phase=collective pipeline_stall

#include <cstdio>
#include <exception>

#include "acc/autograd/ops.hpp"
#include "acc/dist/dist.hpp"
#include "acc/elastic/agent.hpp"
#include "acc/util/progress.hpp"

int main(int argc, char** argv) {
  using namespace acc;
  dist::Session session(argc, argv);
  auto world = dist::ProcessGroup::world();
  if (world->size() != 2) {
    std::fprintf(stderr, "pipeline_stall: needs 2 ranks, got %d\n", world->size());
    return 2;
  }
  try {
    auto agent = elastic::Agent::start(world);
    Tensor w = full({4, 4}, 0.125);
    w.set_requires_grad(true);
    for (int64_t step = 0; step < 8; ++step) {
      progress::step(step);
      progress::phase(progress::Phase::kForward);
      if (world->rank() == 0) {
        Tensor h = dist::send_to(linear(ones({2, 4}), w), 1, world);
        progress::phase(progress::Phase::kBackward);
        h.backward();
      } else {
        Tensor y = dist::recv_from({2, 4}, {.requires_grad = true}, 0, world);
        Tensor loss = sum(square(y));
        progress::phase(progress::Phase::kBackward);
        loss.backward();
      }
    }
    std::printf("pipeline_stall: rank %d done\n", world->rank());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_stall: rank %d: %s\n", world->rank(), e.what());
    return 1;
  }
  return 0;
}
