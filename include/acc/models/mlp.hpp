#pragma once
// A plain multi-layer perceptron classifier for quick tests: Linear -> ReLU -> ... -> Linear.

#include "acc/nn/nn.hpp"

namespace acc::models {

struct MLPConfig {
  int64_t in_features = 16;
  std::vector<int64_t> hidden_sizes = {32};
  int64_t num_classes = 4;
};

class MLP : public nn::Module {
 public:
  explicit MLP(MLPConfig config, Generator& gen = default_generator());
  /// x (N, in_features) -> logits (N, num_classes)
  Tensor forward(const Tensor& x) override;
  /// Mean cross-entropy against integer labels (N).
  Tensor loss(const Tensor& x, const Tensor& labels);
  nn::ModuleList& layers() { return *layers_; }

 private:
  MLPConfig config_;
  std::shared_ptr<nn::ModuleList> layers_;
};

}  // namespace acc::models
