#include "acc/models/llama.hpp"

#include "acc/util/error.hpp"
#include "config_util.hpp"

namespace acc::models {

LlamaConfig LlamaConfig::from_json(const nlohmann::json& j) {
  detail::require_object(j, "llama");
  // What Hugging Face's config.json always holds; other fields default as there.
  detail::require_fields(j, "llama",
                         {"hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "vocab_size"});
  LlamaConfig c;
  detail::read_field(j, "llama", "hidden_size", c.hidden_size);
  detail::read_field(j, "llama", "intermediate_size", c.intermediate_size);
  detail::read_field(j, "llama", "num_hidden_layers", c.num_hidden_layers);
  detail::read_field(j, "llama", "num_attention_heads", c.num_attention_heads);
  c.num_key_value_heads = c.num_attention_heads;
  detail::read_field(j, "llama", "num_key_value_heads", c.num_key_value_heads);
  detail::read_field(j, "llama", "head_dim", c.head_dim);
  detail::read_field(j, "llama", "vocab_size", c.vocab_size);
  detail::read_field(j, "llama", "rms_norm_eps", c.rms_norm_eps);
  detail::read_field(j, "llama", "rope_theta", c.rope_theta);
  detail::read_field(j, "llama", "max_position_embeddings", c.max_position_embeddings);
  detail::read_field(j, "llama", "tie_word_embeddings", c.tie_word_embeddings);
  std::string act = "silu";
  detail::read_field(j, "llama", "hidden_act", act);
  ACC_CHECK(act == "silu", "llama config: hidden_act '", act, "' is not supported (only silu)");
  if (j.contains("rope_scaling")) {
    ACC_CHECK(j["rope_scaling"].is_null(), "llama config: rope_scaling ", j["rope_scaling"].dump(),
              " is not supported");
  }
  for (const char* flag : {"attention_bias", "mlp_bias"}) {
    bool on = false;
    detail::read_field(j, "llama", flag, on);
    ACC_CHECK(!on, "llama config: ", flag, "=true is not supported");
  }
  c.validate();
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  return from_json(read_json_file(path));
}

nlohmann::json LlamaConfig::to_json() const {
  nlohmann::json j = {{"hidden_size", hidden_size},
                      {"intermediate_size", intermediate_size},
                      {"num_hidden_layers", num_hidden_layers},
                      {"num_attention_heads", num_attention_heads},
                      {"num_key_value_heads", num_key_value_heads},
                      {"vocab_size", vocab_size},
                      {"rms_norm_eps", rms_norm_eps},
                      {"rope_theta", rope_theta},
                      {"max_position_embeddings", max_position_embeddings},
                      {"tie_word_embeddings", tie_word_embeddings},
                      {"hidden_act", "silu"}};
  if (head_dim > 0) j["head_dim"] = head_dim;
  return j;
}

void LlamaConfig::validate() const {
  ACC_CHECK(hidden_size > 0, "llama config: hidden_size must be > 0, got ", hidden_size);
  ACC_CHECK(intermediate_size > 0, "llama config: intermediate_size must be > 0, got ",
            intermediate_size);
  ACC_CHECK(num_hidden_layers > 0, "llama config: num_hidden_layers must be > 0, got ",
            num_hidden_layers);
  ACC_CHECK(num_attention_heads > 0, "llama config: num_attention_heads must be > 0, got ",
            num_attention_heads);
  ACC_CHECK(num_key_value_heads > 0 && num_attention_heads % num_key_value_heads == 0,
            "llama config: num_attention_heads ", num_attention_heads,
            " must be a multiple of num_key_value_heads ", num_key_value_heads);
  ACC_CHECK(head_dim > 0 || hidden_size % num_attention_heads == 0, "llama config: hidden_size ",
            hidden_size, " must be a multiple of num_attention_heads ", num_attention_heads);
  ACC_CHECK(resolved_head_dim() % 2 == 0, "llama config: head dimension ", resolved_head_dim(),
            " must be even for rotary embeddings");
  ACC_CHECK(vocab_size > 0, "llama config: vocab_size must be > 0, got ", vocab_size);
  ACC_CHECK(rms_norm_eps > 0, "llama config: rms_norm_eps must be > 0, got ", rms_norm_eps);
  ACC_CHECK(rope_theta > 0, "llama config: rope_theta must be > 0, got ", rope_theta);
  ACC_CHECK(max_position_embeddings > 0, "llama config: max_position_embeddings must be > 0, got ",
            max_position_embeddings);
}

Llama::Llama(LlamaConfig config, Generator& gen)
    : LanguageModel("Llama"), config_(std::move(config)) {
  config_.validate();
  const auto& c = config_;
  const int64_t hd = c.resolved_head_dim();
  model_ = register_module("model", std::make_shared<nn::Module>("LlamaModel"));
  embed_tokens_ = model_->register_module(
      "embed_tokens", std::make_shared<nn::Embedding>(c.vocab_size, c.hidden_size, gen));
  auto rope = rope_cache(c.max_position_embeddings, hd, c.rope_theta, default_device());
  // One table for all layers; not part of the state dict (HF does not save it either).
  model_->register_buffer("rope_cos", rope.first, /*persistent=*/false);
  model_->register_buffer("rope_sin", rope.second, /*persistent=*/false);
  layers_ = model_->register_module("layers", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers_->push_back(
        std::make_shared<nn::LlamaBlock>(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                         c.num_key_value_heads, hd, rope, c.rms_norm_eps, gen));
  }
  norm_ =
      model_->register_module("norm", std::make_shared<nn::RMSNorm>(c.hidden_size, c.rms_norm_eps));
  if (!c.tie_word_embeddings) {
    lm_head_ = register_module(
        "lm_head", std::make_shared<nn::Linear>(c.hidden_size, c.vocab_size, false, gen));
  }
  NoGradGuard ng;
  for (auto& [name, p] : named_parameters()) {
    if (name.find("norm") != std::string::npos) continue;  // RMSNorm weights stay 1
    normal_(p, 0.0, 0.02, gen);
  }
}

Tensor Llama::embed(const Tensor& idx) {
  check_tokens(idx);
  return embed_tokens_(idx);
}

Tensor Llama::head(const Tensor& x) {
  Tensor h = norm_(x);
  if (lm_head_) return lm_head_(h);
  auto s = embed_tokens_->scope();
  return embed_tokens_->attend(h);
}

void Llama::set_fused_attention(bool fused) {
  fused_attention_ = fused;
  // Every attention in the tree, also one a replacement of its block or of itself holds.
  for (const auto& [name, m] : named_modules()) {
    if (auto* attn = dynamic_cast<nn::LlamaAttention*>(m.get())) attn->set_fused(fused);
  }
}

}  // namespace acc::models
