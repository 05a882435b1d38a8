#include "acc/models/mlp.hpp"

#include "acc/util/error.hpp"

namespace acc::models {

MLP::MLP(MLPConfig config, Generator& gen) : nn::Module("MLP"), config_(std::move(config)) {
  ACC_CHECK(config_.in_features > 0 && config_.num_classes > 0,
            "mlp config: in_features and num_classes must be > 0, got ", config_.in_features,
            " and ", config_.num_classes);
  layers_ = register_module("layers", std::make_shared<nn::ModuleList>());
  int64_t in = config_.in_features;
  for (int64_t h : config_.hidden_sizes) {
    ACC_CHECK(h > 0, "mlp config: hidden size must be > 0, got ", h);
    layers_->push_back(std::make_shared<nn::Linear>(in, h, true, gen));
    in = h;
  }
  layers_->push_back(std::make_shared<nn::Linear>(in, config_.num_classes, true, gen));
}

Tensor MLP::forward(const Tensor& x) {
  Tensor h = x;
  for (size_t i = 0; i < layers_->size(); ++i) {
    h = (*(*layers_)[i])(h);
    if (i + 1 < layers_->size()) h = relu(h);
  }
  return h;
}

Tensor MLP::loss(const Tensor& x, const Tensor& labels) {
  return cross_entropy(forward(x), labels);
}

}  // namespace acc::models
