// amp: bf16 mixed precision with fp32 master weights and optimizer state. What is bf16 here:
//  - block outputs are rounded to bf16 (and so are the gradients flowing back into them), the
//    numerics of keeping activations in bf16 between blocks;
//  - gradient communication (ddp/zero/fsdp buckets travel as bf16, half the bytes);
// Parameters, optimizer state and the reductions' final values stay fp32. The CPU kernels compute
// in f32, so activations are rounded, not stored, in bf16: the memory saving of bf16 activations
// is not realised yet (README, "What is and is not there yet"). Config: {}.
#include "methods.hpp"

#include "acc/util/error.hpp"

#include "acc/tensor/node.hpp"

namespace acc::strategies {

MethodSpec amp_method() {
  return {"amp", "amp", [](const nlohmann::json& c, Plan& plan) {
            check_keys("amp", c, {"dtype"});
            if (c.contains("dtype")) {
              ACC_CHECK(c["dtype"] == "bf16", "amp: dtype must be \"bf16\", got ",
                        c["dtype"].dump());
            }
            plan.amp = true;
            plan.dp_options.bf16_communication = true;
          }};
}

void install_amp(models::LanguageModel& model) {
  for (const auto& block : model.blocks()) {
    nn::Module::ForwardWrapper inner = block->forward_wrapper();
    block->set_forward_wrapper(
        [inner](nn::Module& m, const Tensor& x, const std::function<Tensor(const Tensor&)>& fwd) {
          Tensor y = inner ? inner(m, x, fwd) : fwd(x);
          return y.to(DType::kBFloat16).to(DType::kFloat32);
        });
  }
}

}  // namespace acc::strategies
