#pragma once
// The interface every causal language model in the zoo implements. A model is split into three
// stages, embed -> blocks -> head, so pipeline parallelism can cut it between blocks and FSDP /
// recompute can wrap each block.
//
// Sequence shards: forward(idx, {.position_offset = k}) runs idx (B, T) as the tokens at positions
// [k, k + T) of a longer sequence. The offset reaches the modules that use positions (GPT's learned
// wpe in embed, Llama's rotary q/k in every attention) as nn::current_forward_options(), installed
// for the call by an nn::ForwardOptionsGuard; code that runs the stages itself (a pipeline stage
// calling embed, blocks, head) installs the guard around them. A block recomputed in backward
// replays with the options of its forward (Module::operator()). Only the positions change: a chunk
// attends to itself (causal within [k, k + T)); attention across chunks is the strategy's.
// position_offset = 0 (the default, and forward(idx)) is the whole-sequence computation, bitwise.

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

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

  /// idx (B, T) integer ids -> hidden states (B, T, C), at positions position_offset + t of
  /// nn::current_forward_options() for the models with learned positions.
  virtual Tensor embed(const Tensor& idx) = 0;
  /// The transformer blocks, each (B, T, C) -> (B, T, C).
  virtual nn::ModuleList& blocks() = 0;
  /// Final norm and output projection: (B, T, C) -> logits (B, T, V).
  virtual Tensor head(const Tensor& x) = 0;

  /// logits (B, T, V) = head(blocks(embed(idx))), under the forward options current in this
  /// thread (the defaults: a whole sequence from position 0).
  Tensor forward(const Tensor& idx) override;
  /// forward(idx) with `options` installed for the call (nn::ForwardOptionsGuard): with
  /// {.position_offset = k}, idx is the chunk [k, k + T) of a longer sequence. Throws what
  /// forward throws, and acc::ValueError when k < 0 or k + T > max_seq_len().
  Tensor forward(const Tensor& idx, const nn::ForwardOptions& options);
  /// Mean cross-entropy of next-token prediction; targets (B, T).
  virtual Tensor loss(const Tensor& idx, const Tensor& targets);
  /// loss(idx, targets) with `options` installed for the call, as forward(idx, options).
  Tensor loss(const Tensor& idx, const Tensor& targets, const nn::ForwardOptions& options);
  /// Cross-entropy of logits against targets (B, T), used by loss() and by pipeline stages.
  Tensor loss_from_logits(const Tensor& logits, const Tensor& targets) const;

  /// The input embedding's weight when the output projection is tied to it ("" when untied).
  virtual std::string tied_embedding_name() const = 0;

  /// C of the (B, T, C) hidden states between embed, the blocks and head: what a pipeline stage
  /// receives from the one before it.
  virtual int64_t hidden_size() const = 0;
  /// The modules embed() uses and the modules head() uses, as dotted paths from the model (a tied
  /// embedding is in both): what pipeline parallelism keeps on its first and on its last stage
  /// beside their blocks. Every module of the model is one of these, a block, or holds them.
  virtual std::vector<std::string> embedding_modules() const = 0;
  virtual std::vector<std::string> head_modules() const = 0;

  /// Loads weights by name from a pretrained state (e.g. a safetensors file written by PyTorch).
  /// Every parameter of the model must be present with its shape. Entries PyTorch models carry
  /// but AutoAcc does not need are skipped: an "lm_head.weight" of a tied model when it equals
  /// the input embedding bitwise (PyTorch saves the tied tensor twice; any other content or shape
  /// is an acc::ValueError, since the model would silently train something else), causal-mask
  /// buffers ("*.attn.bias", "*.attn.masked_bias") and rotary "*.rotary_emb.inv_freq". Anything
  /// else unexpected is an acc::ValueError listing the names, and so is a NaN or infinite value
  /// (nn::describe_non_finite names the tensor).
  void load_pretrained(const nn::NamedTensors& tensors);

  /// Chooses the fused flash attention (default) or the reference matmul/softmax path.
  virtual void set_fused_attention(bool fused) = 0;
  bool fused_attention() const { return fused_attention_; }

 protected:
  /// Checks idx is (B, T) integer with 0 < T and its positions [k, k + T) within max_seq_len(),
  /// k the current position_offset (>= 0); throws acc::ShapeError/TypeError/ValueError.
  void check_tokens(const Tensor& idx) const;
  bool fused_attention_ = true;  // what set_fused_attention() chose last

 private:
  // A pretrained lm_head.weight of a tied model must equal the embedding in `tensors`.
  void check_tied_head(const Tensor& head, const nn::NamedTensors& tensors) const;
};

using LanguageModelPtr = std::shared_ptr<LanguageModel>;

/// Builds a language model of the registry (acc/models/registry.hpp: "gpt", "llama", and what the
/// program registered) from its JSON config; throws acc::ValueError for an unknown type (naming
/// the registered ones) or one that is not a language model.
LanguageModelPtr create_model(const std::string& model_type, const nlohmann::json& config,
                              Generator& gen = default_generator());
/// Any model type of the registry.
nn::ModulePtr create_module(const std::string& model_type, const nlohmann::json& config,
                            Generator& gen = default_generator());
/// An independent copy of `model`: the same type, config, parameter and buffer values, training
/// mode and attention path, in storage of its own. The default generator is not touched (the copy
/// is built with a scratch one, then overwritten), so a search that trains copies leaves the
/// user's RNG as it was. Gradients are not copied.
LanguageModelPtr clone_model(const LanguageModel& model);
/// Reads a model config file as acc::read_json_file does (duplicate keys refused, the path named).
nlohmann::json read_json_file(const std::string& path);

// ---- depth of a config (src/models/depth.cpp) ----
// What the tracer needs to estimate a deep model from shallow copies without building it.

/// The config field holding the number of blocks: "n_layer" (gpt), "num_hidden_layers" (llama).
/// Throws acc::ValueError for another model type.
const char* config_num_layers_key(const std::string& model_type);
/// The number of blocks a model built from `config` has, read as GPTConfig/LlamaConfig::from_json
/// read it (the whole config is validated). Throws acc::ValueError as from_json does or for
/// another model type.
int64_t config_num_layers(const std::string& model_type, const nlohmann::json& config);
/// `config` with its number of blocks set to `num_layers`, every other field as given. Throws
/// acc::ValueError when num_layers < 1 or the result is not a valid config.
nlohmann::json config_with_num_layers(const std::string& model_type, const nlohmann::json& config,
                                      int64_t num_layers);
/// A model of `config` cut to `num_layers` blocks, on the meta device (shapes only, no memory),
/// built with a generator of its own: a model the caller builds afterwards initialises exactly as
/// it would without this one. What the estimates trace, and how a caller reads a config's
/// max_seq_len() without building the model. Throws what config_with_num_layers throws.
LanguageModelPtr create_meta_model(const std::string& model_type, const nlohmann::json& config,
                                   int64_t num_layers);

}  // namespace acc::models
