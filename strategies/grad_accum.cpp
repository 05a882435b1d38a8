// grad_accum: each rank's batch is split into k micro-batches; their gradients accumulate and are
// synchronised only after the last one. Config: {"steps": k} (k >= 1, must divide the batch).
#include "methods.hpp"

#include "acc/util/error.hpp"

namespace acc::strategies {

MethodSpec grad_accum_method() {
  return {"grad_accum", "grad_accum", [](const nlohmann::json& c, Plan& plan) {
            check_keys("grad_accum", c, {"steps"});
            ACC_CHECK(c.contains("steps") && c["steps"].is_number_integer(),
                      "grad_accum: config needs an integer \"steps\", got ", c.dump());
            const int64_t k = c["steps"].get<int64_t>();
            ACC_CHECK(k >= 1 && k <= 4096, "grad_accum: steps must be in [1, 4096], got ", k);
            plan.grad_accum = static_cast<int>(k);
          }};
}

}  // namespace acc::strategies
