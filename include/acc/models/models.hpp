#pragma once
// Umbrella header of the model zoo.
#include "acc/models/gpt.hpp"
#include "acc/models/language_model.hpp"
#include "acc/models/llama.hpp"
#include "acc/models/mlp.hpp"
