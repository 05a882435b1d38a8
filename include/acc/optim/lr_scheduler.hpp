#pragma once
// Learning-rate schedules as pure functions of the step, so a resumed run needs only the step
// number: `optimizer.set_lr(schedule.lr_at(step))` (or `schedule.apply(optimizer, step)`) before
// each optimizer.step(). Steps count from 0.

#include <cstdint>

#include "acc/optim/optimizer.hpp"

namespace acc::optim {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  /// The learning rate of step `step`. Throws acc::ValueError when step < 0.
  virtual double lr_at(int64_t step) const = 0;
  /// Sets every group's learning rate to lr_at(step) and returns it. Throws as lr_at.
  double apply(Optimizer& optimizer, int64_t step) const;
};

/// The same learning rate at every step (not torch's ConstantLR, which scales by a factor).
class ConstantLR final : public LRScheduler {
 public:
  /// Throws acc::ValueError unless lr >= 0.
  explicit ConstantLR(double lr);
  double lr_at(int64_t step) const override;

 private:
  double lr_;
};

/// Linear warmup then cosine decay, the nanoGPT / llm.c schedule:
///   step < warmup:            max_lr * (step + 1) / warmup_steps
///   warmup <= step <= total:  min_lr + 0.5 * (1 + cos(pi * (step - warmup) / (total - warmup)))
///                                      * (max_lr - min_lr)
///   step > total:             min_lr
/// so step 0 runs at max_lr / warmup_steps, step warmup_steps at max_lr and step total_steps at
/// min_lr.
class WarmupCosineLR final : public LRScheduler {
 public:
  /// Throws acc::ValueError unless 0 <= min_lr <= max_lr, warmup_steps >= 0 and
  /// total_steps > warmup_steps.
  WarmupCosineLR(double max_lr, int64_t warmup_steps, int64_t total_steps, double min_lr = 0.0);
  double lr_at(int64_t step) const override;

 private:
  double max_lr_;
  int64_t warmup_steps_;
  int64_t total_steps_;
  double min_lr_;
};

}  // namespace acc::optim
