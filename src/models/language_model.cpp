#include "acc/models/language_model.hpp"
#include "acc/models/registry.hpp"

#include <cstring>

#include "acc/models/gpt.hpp"
#include "acc/models/llama.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json.hpp"

namespace acc::models {

Tensor LanguageModel::forward(const Tensor& idx) {
  Tensor x = embed(idx);
  for (const auto& block : blocks()) x = (*block)(x);
  return head(x);
}

Tensor LanguageModel::forward(const Tensor& idx, const nn::ForwardOptions& options) {
  nn::ForwardOptionsGuard guard(options);
  return forward(idx);
}

Tensor LanguageModel::loss(const Tensor& idx, const Tensor& targets,
                           const nn::ForwardOptions& options) {
  nn::ForwardOptionsGuard guard(options);
  return loss(idx, targets);
}

Tensor LanguageModel::loss_from_logits(const Tensor& logits, const Tensor& targets) const {
  ACC_CHECK_SHAPE(logits.dim() == 3 && targets.dim() == 2 && targets.size(0) == logits.size(0) &&
                      targets.size(1) == logits.size(1),
                  model_type(), ": targets ", targets.shape(), " do not match logits ",
                  logits.shape());
  return cross_entropy(logits, targets);
}

Tensor LanguageModel::loss(const Tensor& idx, const Tensor& targets) {
  ACC_CHECK_SHAPE(targets.shape() == idx.shape(), model_type(), ": targets ", targets.shape(),
                  " do not match inputs ", idx.shape());
  return loss_from_logits(forward(idx), targets);
}

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

void LanguageModel::check_tied_head(const Tensor& head, const nn::NamedTensors& tensors) const {
  const std::string wte = tied_embedding_name();
  const Tensor* emb = nullptr;
  for (const auto& [n, t] : tensors) {
    if (n == wte) emb = &t;
  }
  // Without the embedding the strict load below names what is missing.
  if (emb == nullptr) return;
  ACC_CHECK_SHAPE(head.shape() == emb->shape() && head.dtype() == emb->dtype(), model_type(),
                  ": pretrained lm_head.weight ", head.shape(), " ", head.dtype(),
                  " is not the tied ", wte, " ", emb->shape(), " ", emb->dtype(),
                  "; this model ties its output projection to the embedding, so a different "
                  "lm_head cannot be loaded");
  const Tensor a = head.contiguous(), b = emb->contiguous();
  const bool equal = std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
  ACC_CHECK(equal, model_type(), ": pretrained lm_head.weight differs from the tied ", wte,
            " (max abs difference ", max_abs_diff(a, b),
            "); this model ties its output projection to the embedding, so a different lm_head "
            "cannot be loaded");
}

void LanguageModel::load_pretrained(const nn::NamedTensors& tensors) {
  nn::NamedTensors own = state_dict();
  nn::NamedTensors picked;
  std::vector<std::string> unexpected;
  for (const auto& [name, t] : tensors) {
    bool known = false;
    for (const auto& [n, p] : own) known = known || n == name;
    if (known) {
      picked.emplace_back(name, t);
      continue;
    }
    if (name == "lm_head.weight" && !tied_embedding_name().empty()) {
      check_tied_head(t, tensors);
      continue;
    }
    const bool harmless = ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
                          ends_with(name, ".rotary_emb.inv_freq");
    if (!harmless) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < unexpected.size() && i < 8; ++i) list += (i ? ", " : "") + unexpected[i];
    ACC_THROW(ValueError, model_type(), ": pretrained weights hold ", unexpected.size(),
              " entries the model does not have: ", list);
  }
  const std::string non_finite = nn::describe_non_finite(picked);
  ACC_CHECK(non_finite.empty(), model_type(), ": pretrained weights are not finite: ", non_finite);
  load_state_dict(picked, /*strict=*/true);
}

void LanguageModel::check_tokens(const Tensor& idx) const {
  ACC_CHECK_TYPE(idx.dtype() == DType::kInt64 || idx.dtype() == DType::kInt32, model_type(),
                 ": token ids must be i32 or i64, got ", idx.dtype());
  ACC_CHECK_SHAPE(idx.dim() == 2, model_type(), ": token ids must be (B, T), got ", idx.shape());
  ACC_CHECK(idx.size(1) > 0 && idx.size(1) <= max_seq_len(), model_type(), ": sequence length ",
            idx.size(1), " is outside [1, ", max_seq_len(), "]");
  const int64_t k = nn::current_forward_options().position_offset, T = idx.size(1);
  ACC_CHECK(k >= 0 && k <= max_seq_len() - T, model_type(), ": position_offset ", k,
            " with sequence length ", T, " gives positions [", k, ", ", k + T,
            "), not within the model's ", max_seq_len(), " positions");
}

LanguageModelPtr create_model(const std::string& model_type, const nlohmann::json& config,
                              Generator& gen) {
  const ModelType& t = models::model_type(model_type);
  ACC_CHECK(t.language_model, "model type '", model_type,
            "' is not a language model (create_module builds it)");
  auto lm = std::dynamic_pointer_cast<LanguageModel>(t.create(config, gen));
  ACC_CHECK(lm != nullptr, "model type '", model_type,
            "' is registered as a language model, but its create() built another module");
  return lm;
}

nn::ModulePtr create_module(const std::string& model_type, const nlohmann::json& config,
                            Generator& gen) {
  return models::model_type(model_type).create(config, gen);
}

LanguageModelPtr clone_model(const LanguageModel& model) {
  Generator scratch(0);
  LanguageModelPtr copy = create_model(model.model_type(), model.config_json(), scratch);
  NoGradGuard ng;
  copy->load_state_dict(model.state_dict(), /*strict=*/true);  // copies into the copy's storage
  copy->set_fused_attention(model.fused_attention());
  copy->train(model.is_training());
  return copy;
}

nlohmann::json read_json_file(const std::string& path) {
  return ::acc::read_json_file(path, "config");
}

}  // namespace acc::models
