// The "checkpoint" method (ATorch's name, kept in strategy JSON): activation recomputation.
// Config: {"kind": "full" | "selective", "blocks": N | "all", "units": [...]} (defaults "full",
// "all").
//  - "full": the first N units keep only their input during forward and run again in backward.
//  - "selective" (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
//    Models"): inside the first N units only the attention cores (softmax(QK^T)V, and what they
//    save for backward) are recomputed, from their q, k, v (nn::recompute_attention_cores); the
//    projections, norms and MLP keep their activations. It saves less than "full" and recomputes
//    far less; "blocks" limits it as it limits "full", so the two kinds count units alike. A unit
//    without an attention core is refused, naming it.
// The units are the modules named in {"units": [...]} (a ModuleList stands for its children), else
// the model's repeated blocks (unit_names, i.e. trace::find_blocks: the blocks the tracer's
// recompute option wraps, through the same nn functions); a model with neither is refused, naming
// how to name units. N larger than the number of units is refused when the method is applied
// (issue 29: "blocks": 99 on a 2-block model was taken as "all" without a word; a count that does
// not fit is a config written for another model).
#include <algorithm>

#include "acc/nn/recompute.hpp"
#include "acc/trace/tracer.hpp"
#include "acc/util/error.hpp"
#include "method.hpp"

namespace acc::strategies {
namespace {

// {"kind": ...}: kBlock for "full" (the default), kSelective for "selective".
trace::Recompute kind_from(const nlohmann::json& c) {
  if (!c.contains("kind")) return trace::Recompute::kBlock;
  const auto& v = c["kind"];
  if (v == "full") return trace::Recompute::kBlock;
  if (v == "selective") return trace::Recompute::kSelective;
  ACC_THROW(ValueError, "checkpoint: kind must be \"full\" or \"selective\", got ", v.dump());
}

// {"blocks": ...}: a count, or -1 for "all" (the default).
int64_t blocks_from(const nlohmann::json& c) {
  if (!c.contains("blocks")) return -1;
  const auto& v = c["blocks"];
  if (v.is_string()) {
    ACC_CHECK(v == "all", "checkpoint: blocks must be a count >= 0 or \"all\", got ", v.dump());
    return -1;
  }
  ACC_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0,
            "checkpoint: blocks must be a count >= 0 or \"all\", got ", v.dump());
  return v.get<int64_t>();
}

}  // namespace

MethodSpec recompute_method() {
  return {.name = "checkpoint",
          .slot = "checkpoint",
          .exclusive_slot = false,
          .config_keys = {"kind", "blocks", "units"},
          .apply =
              [](const nlohmann::json& c, TrainingPlan& plan) {
                const trace::Recompute kind = kind_from(c);
                const int64_t n = blocks_from(c);
                check_units_config(c, "checkpoint");
                plan.model_transforms.push_back(
                    {"checkpoint", [kind, n, c](nn::Module& model) -> Undo {
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
                       return kind == trace::Recompute::kSelective
                                  ? nn::recompute_attention_cores(model, blocks)
                                  : nn::recompute_blocks(model, blocks);
                     }});
              },
          // Half of the blocks, all of them, and the attention cores of all of them (none: the
          // method left out).
          .search_choices =
              [](const SearchContext& ctx) {
                std::vector<nlohmann::json> out;
                if (ctx.num_blocks >= 2) out.push_back({{"blocks", ctx.num_blocks / 2}});
                if (ctx.num_blocks >= 1) {
                  out.push_back({{"blocks", "all"}});
                  if (ctx.has_attention) out.push_back({{"kind", "selective"}});
                }
                return out;
              },
          .effects =
              [](const nlohmann::json& c, const SearchContext& ctx, StepEffects& e) {
                int64_t n = ctx.num_blocks;
                const int64_t limit = blocks_from(c);
                if (limit >= 0) n = std::min(n, limit);
                e.recompute_blocks = n;
                e.selective_recompute = kind_from(c) == trace::Recompute::kSelective;
              }};
}

}  // namespace acc::strategies
