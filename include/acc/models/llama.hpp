#pragma once
// Llama style model with Hugging Face parameter names and config fields, so a real
// config.json and its weights (as safetensors) load unchanged.

#include "acc/models/language_model.hpp"

namespace acc::models {

struct LlamaConfig {
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;  // defaults to num_attention_heads when absent
  int64_t head_dim = 0;              // 0: hidden_size / num_attention_heads
  int64_t vocab_size = 32000;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;

  /// Reads a Hugging Face LlamaConfig JSON. Fields AutoAcc has no use for (architectures,
  /// torch_dtype, bos_token_id, ...) are ignored; features it does not implement (hidden_act other
  /// than silu, rope_scaling, attention_bias, mlp_bias) are rejected with acc::ValueError naming
  /// the field and value.
  static LlamaConfig from_json(const nlohmann::json& j);
  static LlamaConfig from_file(const std::string& path);
  nlohmann::json to_json() const;
  void validate() const;
  int64_t resolved_head_dim() const {
    return head_dim > 0 ? head_dim : hidden_size / num_attention_heads;
  }
};

class Llama : public LanguageModel {
 public:
  /// Weights N(0, 0.02) (HF initializer_range), unit RMSNorm weights.
  explicit Llama(LlamaConfig config, Generator& gen = default_generator());

  std::string model_type() const override { return "llama"; }
  nlohmann::json config_json() const override { return config_.to_json(); }
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t max_seq_len() const override { return config_.max_position_embeddings; }
  const LlamaConfig& config() const { return config_; }

  Tensor embed(const Tensor& idx) override;
  nn::ModuleList& blocks() override { return *layers_; }
  Tensor head(const Tensor& x) override;
  void set_fused_attention(bool fused) override;
  std::string tied_embedding_name() const override {
    return lm_head_ ? "" : "model.embed_tokens.weight";
  }
  int64_t hidden_size() const override { return config_.hidden_size; }
  std::vector<std::string> embedding_modules() const override { return {"model.embed_tokens"}; }
  std::vector<std::string> head_modules() const override {
    return {"model.norm", lm_head_ ? "lm_head" : "model.embed_tokens"};
  }

 private:
  LlamaConfig config_;
  nn::Child<nn::Module> model_, norm_, lm_head_;
  nn::Child<nn::Embedding> embed_tokens_;  // typed: a tied output projection reads its weight
  nn::Child<nn::ModuleList> layers_;
};

}  // namespace acc::models
