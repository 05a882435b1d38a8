#pragma once
// One entry per optimisation method: its config keys (validated) and how it shapes a Trainer.
// Each method's file defines its spec; registry.cpp lists them and holds the composition rules.

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "data_parallel.hpp"

namespace acc::strategies {

/// What the methods of a strategy decide, filled in by each method's `configure`.
struct Plan {
  std::string data_parallel = "local";  // local | ddp | zero1 | zero2 | fsdp
  DataParallelOptions dp_options;
  bool amp = false;
  int grad_accum = 1;
};

struct MethodSpec {
  std::string name;
  /// "data_parallel" methods exclude each other.
  std::string family;
  /// Validates the config (acc::ValueError naming the key) and records its choices in the plan.
  std::function<void(const nlohmann::json& config, Plan& plan)> configure;
};

MethodSpec ddp_method();
MethodSpec zero1_method();
MethodSpec zero2_method();
MethodSpec fsdp_method();
MethodSpec amp_method();
MethodSpec grad_accum_method();

/// Throws acc::ValueError naming `method` and the first key of `config` not in `allowed`.
void check_keys(const std::string& method, const nlohmann::json& config,
                const std::vector<std::string>& allowed);
/// The bucket size from {"bucket_mb": x} (default 25), validated.
int64_t bucket_bytes_from(const std::string& method, const nlohmann::json& config);

/// Installs the amp block wrappers (bf16 rounding of block outputs and of their gradients).
void install_amp(models::LanguageModel& model);

}  // namespace acc::strategies
