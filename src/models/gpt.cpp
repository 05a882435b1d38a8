#include "acc/models/gpt.hpp"

#include <cmath>

#include "acc/util/error.hpp"
#include "config_util.hpp"

namespace acc::models {

GPTConfig GPTConfig::from_json(const nlohmann::json& j) {
  detail::require_object(j, "gpt");
  static const char* known[] = {"n_layer",    "n_head", "n_embd",     "vocab_size",
                                "block_size", "bias",   "activation", "dropout"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool ok = false;
    for (const char* k : known) ok = ok || it.key() == k;
    ACC_CHECK(ok, "gpt config: unknown field '", it.key(),
              "' (known: n_layer, n_head, n_embd, vocab_size, block_size, bias, activation, "
              "dropout)");
  }
  detail::require_fields(j, "gpt", {"n_layer", "n_head", "n_embd"});
  GPTConfig c;
  detail::read_field(j, "gpt", "n_layer", c.n_layer);
  detail::read_field(j, "gpt", "n_head", c.n_head);
  detail::read_field(j, "gpt", "n_embd", c.n_embd);
  detail::read_field(j, "gpt", "vocab_size", c.vocab_size);
  detail::read_field(j, "gpt", "block_size", c.block_size);
  detail::read_field(j, "gpt", "bias", c.bias);
  detail::read_field(j, "gpt", "activation", c.activation);
  detail::read_field(j, "gpt", "dropout", c.dropout);
  c.validate();
  return c;
}

GPTConfig GPTConfig::from_file(const std::string& path) {
  return from_json(read_json_file(path));
}

nlohmann::json GPTConfig::to_json() const {
  return {{"n_layer", n_layer},       {"n_head", n_head},         {"n_embd", n_embd},
          {"vocab_size", vocab_size}, {"block_size", block_size}, {"bias", bias},
          {"activation", activation}, {"dropout", dropout}};
}

void GPTConfig::validate() const {
  ACC_CHECK(n_layer > 0, "gpt config: n_layer must be > 0, got ", n_layer);
  ACC_CHECK(n_head > 0, "gpt config: n_head must be > 0, got ", n_head);
  ACC_CHECK(n_embd > 0 && n_embd % n_head == 0, "gpt config: n_embd ", n_embd,
            " must be a positive multiple of n_head ", n_head);
  ACC_CHECK(vocab_size > 0, "gpt config: vocab_size must be > 0, got ", vocab_size);
  ACC_CHECK(block_size > 0, "gpt config: block_size must be > 0, got ", block_size);
  ACC_CHECK(dropout >= 0 && dropout < 1, "gpt config: dropout must be in [0, 1), got ", dropout);
  nn::Activation a = nn::parse_activation(activation);
  ACC_CHECK(a == nn::Activation::kGeluTanh || a == nn::Activation::kGelu,
            "gpt config: activation must be gelu_tanh or gelu, got '", activation, "'");
}

GPT::GPT(GPTConfig config, Generator& gen) : LanguageModel("GPT"), config_(std::move(config)) {
  config_.validate();
  const auto& c = config_;
  const nn::Activation act = nn::parse_activation(c.activation);
  transformer_ = register_module("transformer", std::make_shared<nn::Module>("Transformer"));
  wte_ = transformer_->register_module(
      "wte", std::make_shared<nn::Embedding>(c.vocab_size, c.n_embd, gen));
  wpe_ = transformer_->register_module(
      "wpe", std::make_shared<nn::Embedding>(c.block_size, c.n_embd, gen));
  if (c.dropout > 0) {
    drop_ = transformer_->register_module("drop", std::make_shared<nn::Dropout>(c.dropout, gen));
  }
  h_ = transformer_->register_module("h", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.n_layer; ++i) {
    h_->push_back(std::make_shared<nn::GPTBlock>(c.n_embd, c.n_head, c.bias, act, c.dropout, gen));
  }
  ln_f_ = transformer_->register_module("ln_f",
                                        std::make_shared<nn::LayerNorm>(c.n_embd, 1e-5, c.bias));

  // nanoGPT initialisation.
  NoGradGuard ng;
  const double resid_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
  for (auto& [name, p] : named_parameters()) {
    const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    const bool is_norm = name.find(".ln_") != std::string::npos;
    if (is_norm) continue;  // LayerNorm keeps ones / zeros
    if (is_bias) {
      p.zero_();
    } else if (name.size() >= 14 && name.compare(name.size() - 14, 14, "c_proj.weight") == 0) {
      normal_(p, 0.0, resid_std, gen);
    } else {
      normal_(p, 0.0, 0.02, gen);
    }
  }
}

Tensor GPT::embed(const Tensor& idx) {
  check_tokens(idx);
  const int64_t T = idx.size(1), k = nn::current_forward_options().position_offset;
  // Positions k ... k + T - 1 of a sequence shard; the rows of wpe a whole sequence uses there.
  Tensor pos = arange(k + T, {DType::kInt64, idx.device(), false});
  if (k > 0) pos = pos.narrow(0, k, T);
  Tensor x = add(wte_(idx), wpe_(pos));  // (B,T,C) + (T,C)
  return drop_ ? drop_(x) : x;
}

Tensor GPT::head(const Tensor& x) {
  Tensor h = ln_f_(x);
  auto s = wte_->scope();  // the tied output projection belongs to wte
  return wte_->attend(h);
}

std::vector<std::string> GPT::embedding_modules() const {
  std::vector<std::string> out = {"transformer.wte", "transformer.wpe"};
  if (drop_) out.push_back("transformer.drop");
  return out;
}

void GPT::set_fused_attention(bool fused) {
  fused_attention_ = fused;
  // Every attention in the tree, also one a replacement of its block or of itself holds.
  for (const auto& [name, m] : named_modules()) {
    if (auto* attn = dynamic_cast<nn::CausalSelfAttention*>(m.get())) attn->set_fused(fused);
  }
}

}  // namespace acc::models
