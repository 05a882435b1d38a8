#pragma once
// Umbrella header of the optimizer layer: optimizers, gradient clipping and LR schedules.

#include "acc/optim/adam.hpp"          // IWYU pragma: export
#include "acc/optim/clip_grad.hpp"     // IWYU pragma: export
#include "acc/optim/lr_scheduler.hpp"  // IWYU pragma: export
#include "acc/optim/optimizer.hpp"     // IWYU pragma: export
#include "acc/optim/sgd.hpp"           // IWYU pragma: export
