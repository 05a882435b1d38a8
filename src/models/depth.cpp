// The layer count of a model config, read and rewritten without building the model: the tracer
// estimates a model of 10^9 blocks from copies of 1 and 2 blocks.

#include "acc/models/gpt.hpp"
#include "acc/models/language_model.hpp"
#include "acc/models/llama.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"

namespace acc::models {

const char* config_num_layers_key(const std::string& model_type) {
  if (model_type == "gpt") return "n_layer";
  if (model_type == "llama") return "num_hidden_layers";
  ACC_THROW(ValueError, "unknown model type '", model_type, "' (expected gpt or llama)");
}

int64_t config_num_layers(const std::string& model_type, const nlohmann::json& config) {
  // Through from_json, which validates the rest: the count is the one a model built from this
  // config would have, and a bad config is refused before any estimate is made of it.
  if (model_type == "gpt") return GPTConfig::from_json(config).n_layer;
  if (model_type == "llama") return LlamaConfig::from_json(config).num_hidden_layers;
  ACC_THROW(ValueError, "unknown model type '", model_type, "' (expected gpt or llama)");
}

nlohmann::json config_with_num_layers(const std::string& model_type, const nlohmann::json& config,
                                      int64_t num_layers) {
  const char* key = config_num_layers_key(model_type);
  ACC_CHECK(num_layers >= 1, model_type, " config: ", key, " must be > 0, got ", num_layers);
  ACC_CHECK(config.is_object(), model_type, " config must be a JSON object, got ", config.dump());
  nlohmann::json out = config;
  out[key] = num_layers;
  (void)config_num_layers(model_type, out);
  return out;
}

LanguageModelPtr create_meta_model(const std::string& model_type, const nlohmann::json& config,
                                   int64_t num_layers) {
  DefaultDeviceGuard meta(Device::kMeta);
  Generator scratch(0);
  return create_model(model_type, config_with_num_layers(model_type, config, num_layers), scratch);
}

}  // namespace acc::models
