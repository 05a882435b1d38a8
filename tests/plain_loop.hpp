#pragma once
// The plain loop as the strategy tests run it beside train_step: Trainer::loss on each
// micro-batch, backward (scaled by 1/k with k micro-batches), Trainer::step; the step's loss
// averaged over the micro-batches and the group's ranks, as train_step averages it.

#include <vector>

#include "acc/autograd/ops.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc::test {

inline double plain_loop_step(strategies::Trainer& trainer, const data::Batch& batch,
                              dist::ProcessGroup& group) {
  const int k = trainer.grad_accum_steps();
  double sum = 0;
  for (const data::Batch& micro : batch.split(k, "plain loop")) {
    Tensor l = trainer.loss(micro);
    sum += l.item();
    (k > 1 ? scale(l, 1.0 / k) : l).backward();
  }
  trainer.step();
  double avg = sum / k;
  if (group.size() > 1) {
    Tensor t = from_vector(std::vector<float>{static_cast<float>(avg)}, {1});
    group.allreduce(t, dist::ReduceOp::kAvg)->wait();
    avg = t.item();
  }
  return avg;
}

}  // namespace acc::test
