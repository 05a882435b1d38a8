// The layer count of a model config, read and rewritten without building the model: the tracer
// estimates a model of 10^9 blocks from copies of 1 and 2 blocks.

#include "acc/models/gpt.hpp"
#include "acc/models/language_model.hpp"
#include "acc/models/llama.hpp"
#include "acc/models/registry.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"

namespace acc::models {

const char* config_num_layers_key(const std::string& model_type) {
  const ModelType& t = models::model_type(model_type);
  ACC_CHECK(!t.layers_key.empty(), "model type '", model_type,
            "' has no layer count in its config (registered without layers_key)");
  return t.layers_key.c_str();  // the registry's entries never move
}

int64_t config_num_layers(const std::string& model_type, const nlohmann::json& config) {
  // Through the type's own reading of the config (from_json for the built-in ones), which
  // validates the rest: the count is the one a model built from this config would have, and a bad
  // config is refused before any estimate is made of it.
  (void)config_num_layers_key(model_type);
  return models::model_type(model_type).num_layers(config);
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
