#pragma once
// The header of a Trainer's checkpoint, for save_trainer() and AsyncSaver.

#include <nlohmann/json.hpp>

#include <string>

#include "acc/checkpoint/save.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc::ckpt::detail {

/// The step counts of every rank's optimizer (a rank may hold no piece of some parameter) in
/// extra["optimizer_steps"], the model's hash and the strategy. Collective over the trainer's
/// world. Throws acc::ValueError when the trainer has no context or `extra` is not an object.
Header trainer_header(strategies::Trainer& trainer, const std::string& model_trace_hash,
                      nlohmann::json extra);

}  // namespace acc::ckpt::detail
