// The "sequence_parallel" method. Config {"kind": "megatron"}: Megatron's sequence parallelism
// (Korthikanti et al. 2022) on top of tensor_parallel, which it requires: between the
// tensor-parallel ops the activations (norms, residual adds, dropout) are split along the sequence
// over tp, the column-parallel linears all-gather their input and the row-parallel ones
// reduce-scatter their output instead of the all-reduces (tp_transform.hpp's
// TensorParallelOptions), and the replicated parameters inside the blocks, whose gradients are
// then partial, are summed over tp by the Trainer before the norm and the update.

#include "acc/util/error.hpp"
#include "method.hpp"

namespace acc::strategies {

MethodSpec sequence_parallel_method() {
  return {.name = "sequence_parallel",
          .slot = "sequence_parallel",
          .exclusive_slot = true,
          .config_keys = {"kind"},
          .apply =
              [](const nlohmann::json& c, TrainingPlan& plan) {
                ACC_CHECK(c.contains("kind") && c["kind"].is_string(),
                          "sequence_parallel: config needs \"kind\": \"megatron\", got ", c.dump());
                const std::string kind = c["kind"].get<std::string>();
                ACC_CHECK(kind == "megatron", "sequence_parallel: unknown kind '", kind,
                          "' (known: megatron)");
                if (!plan.context) return;  // validating the config only
                // make_plan applies tensor_parallel first, so its transform is in the plan.
                bool tp = false;
                for (const auto& t : plan.model_transforms)
                  tp = tp || t.method == "tensor_parallel";
                ACC_CHECK(tp || plan.context->size(dist::MeshDim::kTp) == 1,
                          "sequence_parallel: kind megatron needs tensor_parallel in the strategy");
                *plan.megatron_sp = true;
              },
          // Not searched yet, as tensor_parallel (tensor_parallel.cpp).
          .search_choices = [](const SearchContext&) { return std::vector<nlohmann::json>{}; },
          .effects =
              [](const nlohmann::json&, const SearchContext&, StepEffects&) {
                ACC_THROW(
                    InternalError,
                    "sequence_parallel: the search does not price it yet (it has no choices)");
              }};
}

}  // namespace acc::strategies
