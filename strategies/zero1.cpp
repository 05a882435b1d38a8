// zero1: optimizer state sharded (sharded_optimizer.cpp, stage 1). Config: {"bucket_mb": 25}.
#include "methods.hpp"

#include "acc/util/error.hpp"

namespace acc::strategies {

MethodSpec zero1_method() {
  return {"zero1", "data_parallel", [](const nlohmann::json& c, Plan& plan) {
            check_keys("zero1", c, {"bucket_mb"});
            plan.data_parallel = "zero1";
            plan.dp_options.bucket_bytes = bucket_bytes_from("zero1", c);
          }};
}

}  // namespace acc::strategies
