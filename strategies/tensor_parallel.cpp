// The "tensor_parallel" method: Megatron 1D tensor parallelism over the mesh dimension tp
// (innermost). Config: {"size": t}. The run's mesh gets tp = t (the Trainer builds it: dp = the
// ranks / t); the model transform traces the model, finds its attention and MLP patterns and
// swaps their linears for column/row-parallel shards (tp_transform.hpp), recording each shard's
// layout so that the placement table, the gradient norm, full_parameters() and checkpoints see the
// global parameters. Composes with any data-parallel method over the dp group (they shard the
// local tensors: ZeRO's and fsdp's flat ranges fall inside the tp boxes), with amp, checkpoint
// and grad_accum.
//
// Config {"size": t, "vocab_parallel": true | false}. With a language model and its own loss, the
// vocabulary is split too (vocab_parallel, on unless false): the token embedding and an untied
// output projection over the padded vocabulary, and the loss becomes the vocabulary-parallel
// cross-entropy. A loss of the user's (ApplyOptions::loss) receives whole logits, so the
// vocabulary stays whole then (and "vocab_parallel": true is refused, naming why).
//
// The patterns come from a trace of the model's step: a language model is traced on a one-sample
// meta batch of 4 tokens; any other module on ApplyOptions::sample_batch's shapes through the
// loss (acc::ValueError naming the module when there is none).

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "acc/trace/model_ref.hpp"
#include "acc/util/error.hpp"
#include "method.hpp"
#include "tp_layers.hpp"
#include "tp_transform.hpp"

namespace acc::strategies {
namespace {

int size_from(const nlohmann::json& c) {
  ACC_CHECK(c.contains("size"),
            "tensor_parallel: config needs \"size\" (ranks per tensor-parallel "
            "group, e.g. {\"size\": 2})");
  return int_from("tensor_parallel", c, "size", 1, 1024);
}

// The trace the patterns are found in: the model's forward on meta tensors (the attention and MLP
// patterns are forward ops; the backward would double the trace's cost, which the search pays for
// every tensor-parallel candidate it traces).
trace::Trace trace_for_patterns(nn::Module& model, const data::Batch& sample, const LossFn& loss) {
  const trace::TraceOptions forward_only{.backward = false};
  if (auto* lm = dynamic_cast<models::LanguageModel*>(&model)) {
    const Tensor idx =
        empty({1, std::min<int64_t>(4, lm->max_seq_len())}, {DType::kInt64, Device::kMeta});
    return trace::trace(*lm, {idx, idx}, forward_only);
  }
  ACC_CHECK(!sample.tensors().empty() && loss, "tensor_parallel: the model (", model.type_name(),
            ") is no language model, so its attention and MLP patterns are found by tracing it on "
            "a sample batch: give ApplyOptions::sample_batch (auto_accelerate passes its own)");
  return trace::trace_on_batch(model, sample, loss, 0, forward_only);
}

// The pattern trace of a language model over a meta group, shared by every copy of one config.
// Decision: the search traces fresh meta copies of a registry model (trace::ModelRef::registry,
// at_depth) over meta groups (ParallelContext::meta), thousands of times for one model, and
// copies of one type and config build the same modules: their forward is traced once per
// (type, config) and its trace shared. Tracing it each time was a quarter of a tensor-parallel
// rank's trace, 4.7 % of GPT-3 175B's plan-only search on 1024 devices (2026-11-29). A run's
// model (real groups) is traced each time: its modules may have been changed since it was built.
// The configs a search meets are a few depths of one model; the map is emptied past 256 of them.
std::shared_ptr<const trace::Trace> meta_pattern_trace(models::LanguageModel& lm) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const trace::Trace>> traces;
  const std::string key = lm.model_type() + " " + lm.config_json().dump();
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = traces.find(key); it != traces.end()) return it->second;
  }
  auto made = std::make_shared<const trace::Trace>(
      trace_for_patterns(lm, data::Batch{}, LossFn{}));  // traced unlocked: milliseconds
  const std::lock_guard<std::mutex> lock(mutex);
  if (traces.size() >= 256) traces.clear();
  return traces.emplace(key, std::move(made)).first->second;
}

}  // namespace

MethodSpec tensor_parallel_method() {
  return {
      .name = "tensor_parallel",
      .slot = "tensor_parallel",
      .exclusive_slot = true,
      .config_keys = {"size", "vocab_parallel"},
      .apply =
          [](const nlohmann::json& c, TrainingPlan& plan) {
            const int t = size_from(c);
            std::optional<bool> vocab;  // absent: on where it can be
            if (c.contains("vocab_parallel")) {
              ACC_CHECK(c["vocab_parallel"].is_boolean(),
                        "tensor_parallel: vocab_parallel must be true or false, got ",
                        c["vocab_parallel"].dump());
              vocab = c["vocab_parallel"].get<bool>();
            }
            if (!plan.context) return;  // validating the config only
            ACC_CHECK(plan.context->size(dist::MeshDim::kTp) == t, "tensor_parallel: size ", t,
                      " but the run's mesh is ", plan.context->mesh().to_string());
            plan.tensor_parallel = t;
            if (t == 1) return;
            const dist::ProcessGroupPtr tp = plan.context->group(dist::MeshDim::kTp);
            std::shared_ptr<ParamLayouts> layouts = plan.layouts;
            // Whether the transform split the vocabulary (then the loss is vocab-parallel).
            auto split_vocab = std::make_shared<bool>(false);
            const bool default_loss = plan.default_loss;
            std::shared_ptr<bool> megatron_sp = plan.megatron_sp;
            std::shared_ptr<std::vector<std::string>> partial = plan.partial_over_tp;
            // The user's loss as it is now: the trace only needs the step's shapes.
            plan.model_transforms.push_back(
                {"tensor_parallel",
                 [tp, layouts, sample = plan.sample_batch, loss = plan.loss, vocab, default_loss,
                  split_vocab, megatron_sp, partial](nn::Module& model) -> Undo {
                   auto* lm = dynamic_cast<models::LanguageModel*>(&model);
                   if (vocab.value_or(false)) {
                     ACC_CHECK(lm != nullptr,
                               "tensor_parallel: vocab_parallel needs a language "
                               "model, the model is a ",
                               model.type_name());
                     ACC_CHECK(default_loss,
                               "tensor_parallel: vocab_parallel replaces the language model's "
                               "loss with the vocabulary-parallel cross-entropy, but the "
                               "strategy was given a loss function of the user's (whose "
                               "logits would be split): drop ApplyOptions::loss or set "
                               "\"vocab_parallel\": false");
                   }
                   const std::shared_ptr<const trace::Trace> tr =
                       lm != nullptr && tp->is_meta()
                           ? meta_pattern_trace(*lm)
                           : std::make_shared<const trace::Trace>(
                                 trace_for_patterns(model, sample, loss));
                   partial->clear();
                   Undo layers =
                       shard_tensor_parallel(model, *tr, tp, layouts.get(),
                                             {.sequence_parallel = *megatron_sp}, partial.get());
                   if (lm == nullptr || !default_loss || !vocab.value_or(true)) return layers;
                   Undo table;
                   try {
                     table = shard_vocab_parallel(*lm, tp, layouts.get());
                   } catch (...) {
                     layers();
                     throw;
                   }
                   *split_vocab = true;
                   return [layers, table, split_vocab] {
                     *split_vocab = false;
                     table();
                     layers();
                   };
                 }});
            // With the vocabulary split, the model's forward gives this rank's columns of the
            // logits: the loss is Megatron's vocabulary-parallel cross-entropy (the logits
            // never gathered), the language model's next-token loss otherwise.
            plan.loss = [inner = plan.loss, split_vocab, tp](nn::Module& m, const data::Batch& b) {
              if (!*split_vocab) return inner(m, b);
              auto& lm = dynamic_cast<models::LanguageModel&>(m);
              return vocab_parallel_cross_entropy(lm.forward(b.idx()), b.targets(), lm.vocab_size(),
                                                  tp);
            };
            plan.logits_loss = [inner = plan.logits_loss, split_vocab, tp](
                                   models::LanguageModel& lm, const Tensor& logits,
                                   const Tensor& targets) {
              if (!*split_vocab) return inner(lm, logits, targets);
              return vocab_parallel_cross_entropy(logits, targets, lm.vocab_size(), tp);
            };
          },
      // The search tries every size that divides the world (2, 4, ... ranks per group); the
      // head, kv-head, ffn and vocabulary splits are the transform's own checks, which the
      // search meets when it traces the candidate (layout_rewrite) and lists with their reason.
      // Nothing to add to a step's effects: the candidate is priced from the trace of the model
      // as its rank runs it (its shards, its tp collectives), and the data-parallel methods act
      // on that rank's shards over dp.
      .search_choices =
          [](const SearchContext& ctx) {
            std::vector<nlohmann::json> out;
            for (int t = 2; t <= ctx.world; t *= 2) {
              if (ctx.world % t == 0) out.push_back({{"size", t}});
            }
            return out;
          },
      .effects = [](const nlohmann::json&, const SearchContext&, StepEffects&) {},
      .mesh = [](const nlohmann::json& c, dist::DeviceMesh& mesh) { mesh.tp = size_from(c); },
      .layout = true};
}

}  // namespace acc::strategies
