#include "acc/models/registry.hpp"

#include <deque>
#include <mutex>

#include "acc/models/gpt.hpp"
#include "acc/models/llama.hpp"
#include "acc/util/error.hpp"

namespace acc::models {
namespace {

struct Registry {
  std::mutex mutex;
  std::deque<ModelType> types;  // a deque: references handed out stay valid as types are added

  Registry() {
    types.push_back(
        {.name = "gpt",
         .description = "GPT-2 (learned positions, LayerNorm, GELU MLP, tied embeddings)",
         // A small byte-level model.
         .default_config = {{"n_layer", 4},
                            {"n_head", 4},
                            {"n_embd", 128},
                            {"vocab_size", 256},
                            {"block_size", 256},
                            {"bias", true},
                            {"activation", "gelu_tanh"}},
         .create = [](const nlohmann::json& c, Generator& gen) -> nn::ModulePtr {
           return std::make_shared<GPT>(GPTConfig::from_json(c), gen);
         },
         .layers_key = "n_layer",
         .num_layers = [](const nlohmann::json& c) { return GPTConfig::from_json(c).n_layer; },
         .language_model = true});
    types.push_back(
        {.name = "llama",
         .description = "Llama (rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention)",
         .default_config = {{"hidden_size", 128},
                            {"intermediate_size", 352},
                            {"num_hidden_layers", 4},
                            {"num_attention_heads", 4},
                            {"num_key_value_heads", 2},
                            {"vocab_size", 256},
                            {"rms_norm_eps", 1e-5},
                            {"rope_theta", 10000.0},
                            {"max_position_embeddings", 256}},
         .create = [](const nlohmann::json& c, Generator& gen) -> nn::ModulePtr {
           return std::make_shared<Llama>(LlamaConfig::from_json(c), gen);
         },
         .layers_key = "num_hidden_layers",
         .num_layers =
             [](const nlohmann::json& c) { return LlamaConfig::from_json(c).num_hidden_layers; },
         .language_model = true});
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

// "gpt or llama", "gpt, llama or residual_mlp": the names of the types `keep` keeps.
std::string names_text(
    const std::deque<ModelType>& types,
    bool (*keep)(const ModelType&) = [](const ModelType&) { return true; }) {
  std::vector<std::string> names;
  for (const auto& t : types) {
    if (keep(t)) names.push_back(t.name);
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    out += names[i];
  }
  return out;
}

}  // namespace

void register_model_type(ModelType type) {
  ACC_CHECK(!type.name.empty(), "register_model_type: the name is empty");
  ACC_CHECK(static_cast<bool>(type.create), "register_model_type '", type.name,
            "': no create function");
  ACC_CHECK(type.layers_key.empty() || static_cast<bool>(type.num_layers), "register_model_type '",
            type.name, "': layers_key '", type.layers_key, "' without a num_layers function");
  ACC_CHECK(type.language_model || (type.sample_batch && type.loss), "register_model_type '",
            type.name, "': a model that is not a language model needs sample_batch and loss");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& t : r.types) {
    ACC_CHECK(t.name != type.name, "register_model_type: '", type.name, "' is registered already");
  }
  r.types.push_back(std::move(type));
}

const ModelType& model_type(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& t : r.types) {
    if (t.name == name) return t;
  }
  ACC_THROW(ValueError, "unknown model type '", name, "' (expected ", names_text(r.types), ")");
}

std::vector<std::string> model_type_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& t : r.types) out.push_back(t.name);
  return out;
}

std::string language_model_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return names_text(r.types, [](const ModelType& t) { return t.language_model; });
}

std::string model_type_choices() {
  std::string out;
  for (const auto& n : model_type_names()) out += (out.empty() ? "" : " | ") + n;
  return out;
}

}  // namespace acc::models
