#pragma once
// AutoAcc umbrella header.
#include "acc/autograd/engine.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/models/models.hpp"
#include "acc/nn/nn.hpp"
#include "acc/optim/optim.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/tensor.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/timer.hpp"
#if __has_include("acc/io/safetensors.hpp")
#include "acc/io/safetensors.hpp"
#endif
#if __has_include("acc/data/token_data.hpp")
#include "acc/data/token_data.hpp"
#endif
