#include "acc/optim/lr_scheduler.hpp"

#include <cmath>
#include <numbers>

#include "acc/util/error.hpp"
#include "optim_util.hpp"

namespace acc::optim {

double LRScheduler::apply(Optimizer& optimizer, int64_t step) const {
  const double lr = lr_at(step);
  optimizer.set_lr(lr);
  return lr;
}

ConstantLR::ConstantLR(double lr) : lr_(lr) {
  detail::check_non_negative("ConstantLR", "lr", lr);
}

double ConstantLR::lr_at(int64_t step) const {
  ACC_CHECK(step >= 0, "ConstantLR: step must be >= 0, got ", step);
  return lr_;
}

WarmupCosineLR::WarmupCosineLR(double max_lr, int64_t warmup_steps, int64_t total_steps,
                               double min_lr)
    : max_lr_(max_lr), warmup_steps_(warmup_steps), total_steps_(total_steps), min_lr_(min_lr) {
  detail::check_non_negative("WarmupCosineLR", "min_lr", min_lr);
  ACC_CHECK(max_lr >= min_lr, "WarmupCosineLR: max_lr must be >= min_lr, got max_lr ", max_lr,
            " and min_lr ", min_lr);
  ACC_CHECK(warmup_steps >= 0, "WarmupCosineLR: warmup_steps must be >= 0, got ", warmup_steps);
  ACC_CHECK(total_steps > warmup_steps,
            "WarmupCosineLR: total_steps must be > warmup_steps, got total_steps ", total_steps,
            " and warmup_steps ", warmup_steps);
}

double WarmupCosineLR::lr_at(int64_t step) const {
  ACC_CHECK(step >= 0, "WarmupCosineLR: step must be >= 0, got ", step);
  if (step < warmup_steps_) {
    return max_lr_ * static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
  }
  if (step > total_steps_) return min_lr_;
  const double decay_ratio =
      static_cast<double>(step - warmup_steps_) / static_cast<double>(total_steps_ - warmup_steps_);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * decay_ratio));
  return min_lr_ + coeff * (max_lr_ - min_lr_);
}

}  // namespace acc::optim
