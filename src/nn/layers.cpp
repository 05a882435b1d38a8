#include "acc/nn/layers.hpp"

#include <cmath>

#include "acc/util/error.hpp"

namespace acc::nn {

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen)
    : Module("Linear"), in_(in_features), out_(out_features) {
  ACC_CHECK(in_features > 0 && out_features > 0,
            "Linear: features must be > 0, got in=", in_features, " out=", out_features);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  Tensor w = empty({out_features, in_features});
  uniform_(w, -bound, bound, gen);
  weight_ = register_parameter("weight", w);
  if (bias) {
    Tensor b = empty({out_features});
    uniform_(b, -bound, bound, gen);
    bias_ = register_parameter("bias", b);
  }
}

Tensor Linear::forward(const Tensor& x) {
  return linear(x, weight_, bias_);
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Generator& gen) : Module("Embedding") {
  ACC_CHECK(num_embeddings > 0 && dim > 0, "Embedding: sizes must be > 0, got ", num_embeddings,
            " x ", dim);
  Tensor w = empty({num_embeddings, dim});
  normal_(w, 0.0, 1.0, gen);
  weight_ = register_parameter("weight", w);
}

Embedding::Embedding(const std::string& type_name, Tensor weight) : Module(type_name) {
  ACC_CHECK_SHAPE(weight.dim() == 2, type_name, ": the table must be (rows, dim), got ",
                  weight.shape());
  weight_ = register_parameter("weight", std::move(weight));
}

Tensor Embedding::forward(const Tensor& idx) {
  return embedding(idx, weight_);
}

Tensor Embedding::attend(const Tensor& h) {
  return linear(h, weight_);
}

LayerNorm::LayerNorm(int64_t dim, double eps, bool bias) : Module("LayerNorm"), eps_(eps) {
  ACC_CHECK(dim > 0, "LayerNorm: dim must be > 0, got ", dim);
  ACC_CHECK(eps > 0, "LayerNorm: eps must be > 0, got ", eps);
  weight_ = register_parameter("weight", ones({dim}));
  if (bias) bias_ = register_parameter("bias", zeros({dim}));
}

Tensor LayerNorm::forward(const Tensor& x) {
  return layer_norm(x, weight_, bias_, eps_);
}

RMSNorm::RMSNorm(int64_t dim, double eps) : Module("RMSNorm"), eps_(eps) {
  ACC_CHECK(dim > 0, "RMSNorm: dim must be > 0, got ", dim);
  ACC_CHECK(eps > 0, "RMSNorm: eps must be > 0, got ", eps);
  weight_ = register_parameter("weight", ones({dim}));
}

Tensor RMSNorm::forward(const Tensor& x) {
  return rms_norm(x, weight_, eps_);
}

Dropout::Dropout(double p, Generator& gen) : Module("Dropout"), p_(p), gen_(&gen) {
  ACC_CHECK(p >= 0.0 && p < 1.0, "Dropout: p must be in [0, 1), got ", p);
}

Tensor Dropout::forward(const Tensor& x) {
  return dropout(x, p_, is_training(), *gen_, current_forward_options().sequence_chunk);
}

}  // namespace acc::nn
