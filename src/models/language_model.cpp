#include "acc/models/language_model.hpp"

#include <fstream>

#include "acc/models/gpt.hpp"
#include "acc/models/llama.hpp"
#include "acc/util/error.hpp"

namespace acc::models {

Tensor LanguageModel::forward(const Tensor& idx) {
  Tensor x = embed(idx);
  for (const auto& block : blocks()) x = (*block)(x);
  return head(x);
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
    const bool harmless = name == "lm_head.weight" || ends_with(name, ".attn.bias") ||
                          ends_with(name, ".attn.masked_bias") ||
                          ends_with(name, ".rotary_emb.inv_freq");
    if (!harmless) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < unexpected.size() && i < 8; ++i) list += (i ? ", " : "") + unexpected[i];
    ACC_THROW(ValueError, model_type(), ": pretrained weights hold ", unexpected.size(),
              " entries the model does not have: ", list);
  }
  load_state_dict(picked, /*strict=*/true);
}

void LanguageModel::check_tokens(const Tensor& idx) const {
  ACC_CHECK_TYPE(idx.dtype() == DType::kInt64 || idx.dtype() == DType::kInt32, model_type(),
                 ": token ids must be i32 or i64, got ", idx.dtype());
  ACC_CHECK_SHAPE(idx.dim() == 2, model_type(), ": token ids must be (B, T), got ", idx.shape());
  ACC_CHECK(idx.size(1) > 0 && idx.size(1) <= max_seq_len(), model_type(), ": sequence length ",
            idx.size(1), " is outside [1, ", max_seq_len(), "]");
}

LanguageModelPtr create_model(const std::string& model_type, const nlohmann::json& config,
                              Generator& gen) {
  if (model_type == "gpt") return std::make_shared<GPT>(GPTConfig::from_json(config), gen);
  if (model_type == "llama") return std::make_shared<Llama>(LlamaConfig::from_json(config), gen);
  ACC_THROW(ValueError, "unknown model type '", model_type, "' (expected gpt or llama)");
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  ACC_CHECK_AS(IoError, in.good(), "cannot open '", path, "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    ACC_THROW(IoError, "'", path, "' is not valid JSON: ", e.what());
  }
}

}  // namespace acc::models
