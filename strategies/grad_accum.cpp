// grad_accum: each rank's batch is split into k micro-batches; their gradients accumulate and are
// synchronised only after the last one. Config: {"steps": k} (k >= 1, must divide the batch).
#include "acc/util/error.hpp"
#include "method.hpp"

namespace acc::strategies {

MethodSpec grad_accum_method() {
  return {.name = "grad_accum",
          .slot = "schedule",
          .exclusive_slot = true,
          .config_keys = {"steps"},
          .apply =
              [](const nlohmann::json& c, TrainingPlan& plan) {
                ACC_CHECK(c.contains("steps") && c["steps"].is_number_integer(),
                          "grad_accum: config needs an integer \"steps\", got ", c.dump());
                const int64_t k = c["steps"].get<int64_t>();
                ACC_CHECK(k >= 1 && k <= 4096, "grad_accum: steps must be in [1, 4096], got ", k);
                plan.micro_batches = static_cast<int>(k);
              },
          // Every k > 1 that divides the per-rank batch, up to the batch (micro-batches of one
          // sample): the memory-for-time trade the search prices.
          .search_choices =
              [](const SearchContext& ctx) {
                std::vector<nlohmann::json> out;
                for (int64_t k = 2; k <= ctx.per_rank_batch && k <= 4096; ++k) {
                  if (ctx.per_rank_batch % k == 0) out.push_back({{"steps", k}});
                }
                return out;
              },
          .effects =
              [](const nlohmann::json& c, const SearchContext&, StepEffects& e) {
                e.micro_batches = static_cast<int>(c.at("steps").get<int64_t>());
              }};
}

}  // namespace acc::strategies
