#pragma once
// A model of the user's own, not a language model: a residual-MLP classifier, its loss, and a
// synthetic dataset it learns, as a user would write them. examples/custom_model.cpp trains it
// with auto_accelerate and a TrainingSession; tests/strategies/custom_model_test.cpp checks every
// strategy on it against one process.
//
// The dataset: sample g has features x_g (uniform in [-1, 1), from Philox keyed by the seed at
// counter g: a pure function of g, so any rank count reads the same samples) and the label
// argmax(T x_g) of a fixed random "teacher" matrix T (classes x features).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "acc/autograd/ops.hpp"
#include "acc/data/batch.hpp"
#include "acc/data/loader.hpp"
#include "acc/nn/layers.hpp"
#include "acc/nn/module.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"

namespace custom {

struct NetConfig {
  int64_t features = 32;
  int64_t width = 64;
  int64_t hidden = 128;
  int64_t layers = 4;
  int64_t classes = 8;
};

/// x + fc2(gelu(fc1(norm(x)))).
class ResidualBlock : public acc::nn::Module {
 public:
  ResidualBlock(int64_t width, int64_t hidden, acc::Generator& gen) : Module("ResidualBlock") {
    norm = register_module("norm", std::make_shared<acc::nn::LayerNorm>(width));
    fc1 = register_module("fc1", std::make_shared<acc::nn::Linear>(width, hidden, true, gen));
    fc2 = register_module("fc2", std::make_shared<acc::nn::Linear>(hidden, width, true, gen));
  }
  acc::Tensor forward(const acc::Tensor& x) override {
    return acc::add(x, fc2(acc::gelu(fc1(norm(x)))));
  }
  acc::nn::Child<acc::nn::LayerNorm> norm;
  acc::nn::Child<acc::nn::Linear> fc1, fc2;
};

/// features -> width, `layers` residual blocks, norm, -> classes logits.
class Net : public acc::nn::Module {
 public:
  explicit Net(const NetConfig& c, acc::Generator& gen = acc::default_generator()) : Module("Net") {
    ACC_CHECK(c.features >= 1 && c.width >= 1 && c.hidden >= 1 && c.layers >= 0 && c.classes >= 2,
              "Net: needs features, width, hidden >= 1, layers >= 0 and classes >= 2, got ",
              c.features, ", ", c.width, ", ", c.hidden, ", ", c.layers, ", ", c.classes);
    input =
        register_module("input", std::make_shared<acc::nn::Linear>(c.features, c.width, true, gen));
    blocks = register_module("blocks", std::make_shared<acc::nn::ModuleList>());
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks->push_back(std::make_shared<ResidualBlock>(c.width, c.hidden, gen));
    }
    norm = register_module("norm", std::make_shared<acc::nn::LayerNorm>(c.width));
    head =
        register_module("head", std::make_shared<acc::nn::Linear>(c.width, c.classes, true, gen));
  }
  acc::Tensor forward(const acc::Tensor& x) override {
    acc::Tensor h = input(x);
    for (const auto& b : *blocks) h = (*b)(h);
    return head(norm(h));
  }
  acc::nn::Child<acc::nn::Linear> input, head;
  acc::nn::Child<acc::nn::ModuleList> blocks;
  acc::nn::Child<acc::nn::LayerNorm> norm;
};

/// The user's loss: mean cross-entropy of the logits of batch["x"] against batch["label"].
inline acc::Tensor classification_loss(acc::nn::Module& model, const acc::data::Batch& batch) {
  return acc::cross_entropy(model(batch["x"]), batch["label"]);
}

/// Features of sample g (see the top of this file).
inline void features_of(uint64_t seed, int64_t g, int64_t features, float* out) {
  for (int64_t j = 0; j < features; j += 4) {
    uint32_t w[4];
    acc::Generator::philox(seed, static_cast<uint64_t>(g) * 4096 + static_cast<uint64_t>(j / 4), w);
    for (int64_t k = 0; k < 4 && j + k < features; ++k) {
      out[j + k] = static_cast<float>(w[k] >> 8) * (2.0f / 16777216.0f) - 1.0f;
    }
  }
}

/// The batch of these samples: "x" (n, features) f32 and "label" (n) i64.
inline acc::data::Batch synthetic_batch(const std::vector<int64_t>& samples, const NetConfig& c,
                                        uint64_t seed) {
  ACC_CHECK(c.features <= 4 * 4096, "synthetic data: at most ", 4 * 4096, " features, got ",
            c.features);
  const auto n = static_cast<int64_t>(samples.size());
  std::vector<float> teacher(static_cast<size_t>(c.classes * c.features));
  for (int64_t k = 0; k < c.classes; ++k) {
    features_of(seed ^ 0x7eac4e5ULL, k, c.features, &teacher[static_cast<size_t>(k * c.features)]);
  }
  std::vector<float> x(static_cast<size_t>(n * c.features));
  std::vector<int64_t> label(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float* xi = &x[static_cast<size_t>(i * c.features)];
    features_of(seed, samples[static_cast<size_t>(i)], c.features, xi);
    double best = -1e300;
    for (int64_t k = 0; k < c.classes; ++k) {
      double s = 0;
      for (int64_t j = 0; j < c.features; ++j) {
        s += static_cast<double>(teacher[static_cast<size_t>(k * c.features + j)]) * xi[j];
      }
      if (s > best) {
        best = s;
        label[static_cast<size_t>(i)] = k;
      }
    }
  }
  return acc::data::Batch(
      {{"x", acc::from_vector(x, {n, c.features})}, {"label", acc::from_vector(label, {n})}});
}

/// This rank's batches, step after step: the samples its data shard names (AccelerateResult::data).
class SyntheticLoader : public acc::data::Loader {
 public:
  SyntheticLoader(acc::data::Shard shard, NetConfig config, uint64_t seed)
      : shard_(shard), config_(config), seed_(seed) {
    (void)shard_.per_rank();  // validates the shard
  }
  acc::data::Batch next() override {
    acc::data::Batch b = synthetic_batch(shard_.sample_indices(step_), config_, seed_);
    ++step_;
    return b;
  }
  nlohmann::json state() const override {
    return {{"step", step_}, {"seed", seed_}, {"global_batch", shard_.global_batch}};
  }
  void load_state(const nlohmann::json& s) override {
    ACC_CHECK(s.is_object() && s.contains("step") && s["step"].is_number_integer() &&
                  s["step"].get<int64_t>() >= 0,
              "SyntheticLoader: state needs a step >= 0, got ", s.dump());
    ACC_CHECK(s.value("seed", seed_ + 1) == seed_, "SyntheticLoader: state of seed ",
              s.value("seed", nlohmann::json()).dump(), ", this loader's is ", seed_);
    ACC_CHECK(s.value("global_batch", int64_t{-1}) == shard_.global_batch,
              "SyntheticLoader: state of global batch ",
              s.value("global_batch", nlohmann::json()).dump(), ", this loader's is ",
              shard_.global_batch);
    step_ = s["step"].get<int64_t>();
  }
  int64_t step() const { return step_; }

 private:
  acc::data::Shard shard_;
  NetConfig config_;
  uint64_t seed_;
  int64_t step_ = 0;
};

}  // namespace custom
