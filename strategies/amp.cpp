// amp: bf16 mixed precision with fp32 master weights and optimizer state. What is bf16 here:
//  - block outputs are rounded to bf16 (and so are the gradients flowing back into them), the
//    numerics of keeping activations in bf16 between blocks;
//  - gradient communication (ddp/zero/fsdp buckets travel as bf16, half the bytes).
// Parameters, optimizer state and the reductions' final values stay fp32. The CPU kernels compute
// in f32 and the tensors saved for backward inside a block are still f32: the activation memory of
// bf16 storage is not realised yet (README, "What is and is not there yet").
// Config: {"dtype": "bf16"} (the only choice).
#include "acc/nn/recompute.hpp"
#include "acc/util/error.hpp"
#include "method.hpp"

namespace acc::strategies {

MethodSpec amp_method() {
  return {
      .name = "amp",
      .slot = "amp",
      .exclusive_slot = false,
      .config_keys = {"dtype"},
      .apply = [](const nlohmann::json& c, TrainingPlan& plan) {
        if (c.contains("dtype")) {
          ACC_CHECK(c["dtype"] == "bf16", "amp: dtype must be \"bf16\", got ", c["dtype"].dump());
        }
        plan.sync_options.bf16_communication = true;
        plan.model_transforms.push_back(
            {"amp", [](models::LanguageModel& model) -> Undo {
               std::vector<nn::ModulePtr> blocks(model.blocks().begin(), model.blocks().end());
               return nn::wrap_forward(blocks, [](nn::Module&, const Tensor& x,
                                                  const std::function<Tensor(const Tensor&)>& fwd) {
                 return fwd(x).to(DType::kBFloat16).to(DType::kFloat32);
               });
             }});
      }};
}

}  // namespace acc::strategies
