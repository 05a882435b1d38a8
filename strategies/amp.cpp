// amp: bf16 mixed precision with fp32 master weights and optimizer state. What is bf16 here:
//  - the activations ops save for backward inside each block are stored as bf16 copies
//    (autograd::SaveActivationsInBf16), about half the activation memory; the kernels still
//    compute in f32 and backward reads the stored values widened back to f32;
//  - block outputs are rounded to bf16 (and so are the gradients flowing back into them), the
//    numerics of keeping activations in bf16 between blocks;
//  - gradient communication (ddp/zero/fsdp buckets travel as bf16, half the bytes).
// Parameters, optimizer state and the reductions' final values stay fp32. The block wrapper is
// nn::bf16_activation_blocks, which the tracer's bf16_activations option uses too. The blocks are
// the units of unit_names (named in {"units": [...]}, else the repeated blocks); a model with
// neither has its top-level children as blocks.
// Config: {"dtype": "bf16"} (the only choice), "units".
#include "acc/nn/recompute.hpp"
#include "acc/util/error.hpp"
#include "method.hpp"

namespace acc::strategies {

MethodSpec amp_method() {
  return {.name = "amp",
          .slot = "amp",
          .exclusive_slot = false,
          .config_keys = {"dtype", "units"},
          .apply =
              [](const nlohmann::json& c, TrainingPlan& plan) {
                if (c.contains("dtype")) {
                  ACC_CHECK(c["dtype"] == "bf16", "amp: dtype must be \"bf16\", got ",
                            c["dtype"].dump());
                }
                check_units_config(c, "amp");
                plan.sync_options.bf16_communication = true;
                plan.model_transforms.push_back(
                    {"amp", [c](nn::Module& model) -> Undo {
                       std::vector<std::string> blocks = unit_names(model, c, "amp");
                       if (blocks.empty()) {
                         for (const auto& [name, child] : model.named_children()) {
                           blocks.push_back(name);
                         }
                       }
                       return nn::bf16_activation_blocks(model, blocks);
                     }});
              },
          .needs_bf16 = true,
          .search_choices =
              [](const SearchContext&) {
                return std::vector<nlohmann::json>{nlohmann::json::object()};
              },
          .effects =
              [](const nlohmann::json&, const SearchContext&, StepEffects& e) {
                e.bf16_activations = true;
                e.bf16_communication = true;
              }};
}

}  // namespace acc::strategies
