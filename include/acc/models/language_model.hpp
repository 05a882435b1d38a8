#pragma once
// The interface every causal language model in the zoo implements. A model is split into three
// stages, embed -> blocks -> head, so pipeline parallelism can cut it between blocks and FSDP /
// recompute can wrap each block.

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "acc/nn/nn.hpp"

namespace acc::models {

class LanguageModel : public nn::Module {
 public:
  using nn::Module::Module;

  /// "gpt" or "llama".
  virtual std::string model_type() const = 0;
  /// The configuration, in the same JSON the model was built from.
  virtual nlohmann::json config_json() const = 0;
  virtual int64_t vocab_size() const = 0;
  /// The longest sequence the model accepts.
  virtual int64_t max_seq_len() const = 0;

  /// idx (B, T) integer ids -> hidden states (B, T, C).
  virtual Tensor embed(const Tensor& idx) = 0;
  /// The transformer blocks, each (B, T, C) -> (B, T, C).
  virtual nn::ModuleList& blocks() = 0;
  /// Final norm and output projection: (B, T, C) -> logits (B, T, V).
  virtual Tensor head(const Tensor& x) = 0;

  /// logits (B, T, V) = head(blocks(embed(idx))).
  Tensor forward(const Tensor& idx) override;
  /// Mean cross-entropy of next-token prediction; targets (B, T).
  virtual Tensor loss(const Tensor& idx, const Tensor& targets);
  /// Cross-entropy of logits against targets (B, T), used by loss() and by pipeline stages.
  Tensor loss_from_logits(const Tensor& logits, const Tensor& targets) const;

  /// Loads weights by name from a pretrained state (e.g. a safetensors file written by PyTorch).
  /// Every parameter of the model must be present with its shape. Entries PyTorch models carry
  /// but AutoAcc does not need are skipped: a tied "lm_head.weight" equal in shape to the input
  /// embedding, causal-mask buffers ("*.attn.bias" of shape (1,1,T,T), "*.attn.masked_bias") and
  /// rotary "*.rotary_emb.inv_freq". Anything else unexpected is an acc::ValueError listing the
  /// names.
  void load_pretrained(const nn::NamedTensors& tensors);

  /// Chooses the fused flash attention (default) or the reference matmul/softmax path.
  virtual void set_fused_attention(bool fused) = 0;

 protected:
  /// Checks idx is (B, T) integer with 0 < T <= max_seq_len(); throws acc::ShapeError/ValueError.
  void check_tokens(const Tensor& idx) const;
};

using LanguageModelPtr = std::shared_ptr<LanguageModel>;

/// Builds "gpt" or "llama" from its JSON config; throws acc::ValueError for another type.
LanguageModelPtr create_model(const std::string& model_type, const nlohmann::json& config,
                              Generator& gen = default_generator());
/// Reads a JSON file; throws acc::IoError when it is missing or not valid JSON.
nlohmann::json read_json_file(const std::string& path);

}  // namespace acc::models
