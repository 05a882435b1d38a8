#pragma once
// GPT-2 style model with nanoGPT parameter names and tied input/output embeddings.

#include "acc/models/language_model.hpp"

namespace acc::models {

struct GPTConfig {
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  int64_t vocab_size = 50304;
  int64_t block_size = 1024;
  bool bias = true;
  std::string activation = "gelu_tanh";  // "gelu_tanh" | "gelu"
  double dropout = 0.0;

  /// Reads the fields above; missing ones keep their defaults. Throws acc::ValueError naming an
  /// unknown field, a field of the wrong type, or an invalid value (n_embd % n_head != 0, ...).
  static GPTConfig from_json(const nlohmann::json& j);
  static GPTConfig from_file(const std::string& path);
  nlohmann::json to_json() const;
  void validate() const;
};

class GPT : public LanguageModel {
 public:
  /// Weights initialised as nanoGPT: N(0, 0.02), residual projections N(0, 0.02/sqrt(2 n_layer)),
  /// zero biases, unit LayerNorm weights. Under a DefaultDeviceGuard(kMeta) nothing is allocated.
  explicit GPT(GPTConfig config, Generator& gen = default_generator());

  std::string model_type() const override { return "gpt"; }
  nlohmann::json config_json() const override { return config_.to_json(); }
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t max_seq_len() const override { return config_.block_size; }
  const GPTConfig& config() const { return config_; }

  /// wte(idx) + wpe(positions), positions [k, k + T) for position_offset k.
  Tensor embed(const Tensor& idx) override;
  nn::ModuleList& blocks() override { return *h_; }
  Tensor head(const Tensor& x) override;
  void set_fused_attention(bool fused) override;
  std::string tied_embedding_name() const override { return "transformer.wte.weight"; }
  int64_t hidden_size() const override { return config_.n_embd; }
  std::vector<std::string> embedding_modules() const override;
  std::vector<std::string> head_modules() const override {
    return {"transformer.ln_f", "transformer.wte"};
  }

 private:
  GPTConfig config_;
  nn::Child<nn::Module> transformer_, wpe_, drop_, ln_f_;
  nn::Child<nn::Embedding> wte_;  // typed: the tied output projection reads its weight
  nn::Child<nn::ModuleList> h_;
};

}  // namespace acc::models
