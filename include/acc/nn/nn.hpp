#pragma once
// Umbrella header of the nn layer.
#include "acc/nn/head_split.hpp"
#include "acc/nn/layers.hpp"
#include "acc/nn/module.hpp"
#include "acc/nn/recompute.hpp"
#include "acc/nn/transformer.hpp"
