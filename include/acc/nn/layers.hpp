#pragma once
// Basic layers. Parameter names and layouts follow torch.nn, so state dicts move between AutoAcc
// and PyTorch unchanged: Linear.weight is (out, in).

#include "acc/autograd/ops.hpp"
#include "acc/nn/module.hpp"
#include "acc/tensor/random.hpp"

namespace acc::nn {

/// y = x W^T + b. Initialised as torch.nn.Linear: U(-1/sqrt(in), 1/sqrt(in)) for W and b.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         Generator& gen = default_generator());
  Tensor forward(const Tensor& x) override;
  Tensor& weight() { return weight_; }
  Tensor& bias() { return bias_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

 private:
  int64_t in_, out_;
  Tensor weight_, bias_;
};

/// Rows of weight (V, C) picked by integer ids. Initialised N(0, 1) as torch.nn.Embedding.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator& gen = default_generator());
  Tensor forward(const Tensor& idx) override;
  /// The tied output projection: h (..., dim) -> logits (..., num_embeddings) = h W^T, what a
  /// language model whose head is tied to its input embedding computes (GPT, Llama tied). A
  /// vocabulary-parallel embedding gives its own columns of the logits.
  virtual Tensor attend(const Tensor& h);
  Tensor& weight() { return weight_; }

 protected:
  /// A subclass's table: `weight` is registered as "weight" as it is.
  Embedding(const std::string& type_name, Tensor weight);

 private:
  Tensor weight_;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool bias = true);
  Tensor forward(const Tensor& x) override;
  Tensor& weight() { return weight_; }
  Tensor& bias() { return bias_; }

 private:
  double eps_;
  Tensor weight_, bias_;
};

class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6);
  Tensor forward(const Tensor& x) override;
  Tensor& weight() { return weight_; }

 private:
  double eps_;
  Tensor weight_;
};

/// Zeroes elements with probability p while training (scaling the rest by 1/(1-p)).
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.0, Generator& gen = default_generator());
  Tensor forward(const Tensor& x) override;
  double p() const { return p_; }

 private:
  double p_;
  Generator* gen_;
};

}  // namespace acc::nn
