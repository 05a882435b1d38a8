// The "checkpoint" method (ATorch's name, kept in strategy JSON): activation recomputation. The
// first N units keep only their input during forward and run again in backward. The units are
// the modules named in {"units": [...]} (a ModuleList stands for its children), else the model's
// repeated blocks (unit_names, i.e. trace::find_blocks: the blocks the tracer's recompute option
// wraps, through the same nn::recompute_blocks); a model with neither is refused, naming how to
// name units. Config: {"blocks": N | "all", "units": [...]} (default "all"). N larger than
// the number of blocks is refused when the method is applied (issue 29: "blocks": 99 on a 2-block
// model was taken as "all" without a word; a count that does not fit is a config written for
// another model).
#include <algorithm>

#include "acc/nn/recompute.hpp"
#include "acc/util/error.hpp"
#include "method.hpp"

namespace acc::strategies {

MethodSpec recompute_method() {
  return {.name = "checkpoint",
          .slot = "checkpoint",
          .exclusive_slot = false,
          .config_keys = {"blocks", "units"},
          .apply =
              [](const nlohmann::json& c, TrainingPlan& plan) {
                int64_t n = -1;  // all
                if (c.contains("blocks")) {
                  const auto& v = c["blocks"];
                  if (v.is_string()) {
                    ACC_CHECK(v == "all",
                              "checkpoint: blocks must be a count >= 0 or \"all\", got ", v.dump());
                  } else {
                    ACC_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0,
                              "checkpoint: blocks must be a count >= 0 or \"all\", got ", v.dump());
                    n = v.get<int64_t>();
                  }
                }
                check_units_config(c, "checkpoint");
                plan.model_transforms.push_back(
                    {"checkpoint", [n, c](nn::Module& model) -> Undo {
                       std::vector<std::string> blocks = unit_names(model, c, "checkpoint");
                       ACC_CHECK(!blocks.empty(), "checkpoint: the model (", model.type_name(),
                                 ") has no repeated blocks to recompute: name its units, e.g. "
                                 "{\"units\": [\"encoder.layers\"]}");
                       const auto have = static_cast<int64_t>(blocks.size());
                       ACC_CHECK(n <= have, "checkpoint: blocks ", n, " is more than the ", have,
                                 c.contains("units") ? " unit(s)" : " repeated block(s)",
                                 " of the model (", blocks.front(), " ... ", blocks.back(),
                                 "): give at most ", have, " or \"all\"");
                       if (n >= 0) blocks.resize(static_cast<size_t>(n));
                       return nn::recompute_blocks(model, blocks);
                     }});
              },
          // Half of the blocks, and all of them (none: the method left out).
          .search_choices =
              [](const SearchContext& ctx) {
                std::vector<nlohmann::json> out;
                if (ctx.num_blocks >= 2) out.push_back({{"blocks", ctx.num_blocks / 2}});
                if (ctx.num_blocks >= 1) out.push_back({{"blocks", "all"}});
                return out;
              },
          .effects =
              [](const nlohmann::json& c, const SearchContext& ctx, StepEffects& e) {
                int64_t n = ctx.num_blocks;
                if (c.contains("blocks") && c["blocks"].is_number_integer()) {
                  n = std::min(n, c["blocks"].get<int64_t>());
                }
                e.recompute_blocks = n;
              }};
}

}  // namespace acc::strategies
