#pragma once
// The model registry: model types that programs build by name. train_gpt --model, acc-search
// --model, acc-trace and acc-ckpt import look models up here, and so do models::create_model and
// the depth functions (config_num_layers, create_meta_model). Built in: "gpt" and "llama". A
// program registers its own type before it parses its command line (examples/custom_model.cpp
// registers "residual_mlp" and runs acc-search's command line over it: search::acc_search_main).
//
// A type that is not a language model says how to make a sample batch (what the search traces and
// dry-runs) and its loss; both take and give the batch as named tensors (data::Batch holds the
// same vector: Batch(tensors) and batch.tensors() convert).

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "acc/nn/module.hpp"
#include "acc/tensor/random.hpp"

namespace acc::models {

struct ModelType {
  std::string name;         // what --model takes
  std::string description;  // one line for --help
  /// A small config for a quick start (train_gpt without --config; may be empty).
  nlohmann::json default_config = nlohmann::json::object();
  /// Builds the model from its JSON config; throws acc::ValueError naming a bad field.
  std::function<nn::ModulePtr(const nlohmann::json& config, Generator& gen)> create = nullptr;
  /// The config field holding the number of repeated blocks ("" : none; the model is then always
  /// traced whole), and the count a config gives (validating the config as create does).
  std::string layers_key;
  std::function<int64_t(const nlohmann::json& config)> num_layers = nullptr;
  /// A language model (create returns a models::LanguageModel): its batches are token windows
  /// (B, seq_len) and its loss the next-token loss.
  bool language_model = false;
  /// Other models: `n` samples as the model reads them (seq_len is passed on, for models that
  /// have one), and the mean loss of such a batch.
  std::function<nn::NamedTensors(const nlohmann::json& config, int64_t n, int64_t seq_len,
                                 Generator& gen)>
      sample_batch = nullptr;
  std::function<Tensor(nn::Module&, const nn::NamedTensors& batch)> loss = nullptr;
};

/// Adds a type. Throws acc::ValueError for an empty name, a name registered already, no create,
/// a layers_key without num_layers, or a model that is not a language model without sample_batch
/// and loss.
void register_model_type(ModelType type);
/// The type registered as `name`. Throws acc::ValueError naming it and the registered names.
const ModelType& model_type(const std::string& name);
/// Registered names, in registration order ("gpt", "llama", then the program's).
std::vector<std::string> model_type_names();
/// "gpt | llama | residual_mlp": for --help.
std::string model_type_choices();
/// The registered language models' names as a message lists them: "gpt or llama".
std::string language_model_names();

}  // namespace acc::models
