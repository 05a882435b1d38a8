// zero2: optimizer state and gradients sharded (sharded_optimizer.cpp, stage 2).
// Config: {"bucket_mb": 25}.
#include "methods.hpp"

#include "acc/util/error.hpp"

namespace acc::strategies {

MethodSpec zero2_method() {
  return {"zero2", "data_parallel", [](const nlohmann::json& c, Plan& plan) {
            check_keys("zero2", c, {"bucket_mb"});
            plan.data_parallel = "zero2";
            plan.dp_options.bucket_bytes = bucket_bytes_from("zero2", c);
          }};
}

}  // namespace acc::strategies
