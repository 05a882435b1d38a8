// The "sequence_parallel" method: the sequence split over ranks. Config {"kind": "ulysses",
// "size": s} (DeepSpeed-Ulysses, as TorchAcc has it) over the mesh dimension cp; {"kind":
// "megatron"} (Megatron-SP over tensor_parallel's ranks; apply_megatron below).
//
// Ulysses: each of the s cp ranks holds T/s tokens of every sample everywhere except inside the
// attention core, where an all-to-all over the cp group trades sequence for heads and another
// trades them back afterwards:
//
//   q (B, H, T/s, HS) -> (B, H/s, T, HS)      k, v (B, HKV, T/s, HS) -> (B, HKV/s, T, HS)
//   core: causal attention of H/s heads over the whole sequence -> y (B, H/s, T, HS)
//   y -> (B, H, T/s, HS)
//
// Rank r gets query heads [r H/s, (r + 1) H/s) and kv heads [r HKV/s, (r + 1) HKV/s): the kv heads
// its query heads use (grouped-query attention keeps query head h on kv head h / (H / HKV)). So
// H and HKV must be multiples of s (after tensor_parallel's split, which runs first: H/tp), and T
// a multiple of s.
//
// Communication per layer and micro-batch: 4 all-to-alls forward (q, k, v, y) and 4 backward
// (each one's inverse), each moving (s - 1)/s of its tensor; a recomputed block adds its forward
// 4 again in backward.
//
// The loss: the micro-batch's "idx" and "targets" are cut along dimension 1 by the cp
// coordinate, and the model runs the chunk at position_offset = rank_cp T/s (learned positions
// and rotary angles of the tokens it holds). Every cp rank reads the same samples (the data is
// split by the dp coordinate only) and returns the mean loss of its chunk; the Trainer averages
// the loss and the gradients over dp x cp, which is the mean over the micro-batch's tokens when
// every cp rank counts the same tokens. Targets equal to the ignore index (-100,
// acc::cross_entropy's) make the counts differ: each rank then weighs its chunk's mean by
// s n_r / N (n_r its chunk's counted tokens, N the micro-batch's, known to every rank since each
// holds the whole micro-batch), so the cp average is again the micro-batch's token mean; a chunk
// with no counted token at all is refused by name (its mean is 0/0). This assumes the loss is
// the token mean a language model's next-token loss is.

#include <algorithm>
#include <string>
#include <vector>

#include "acc/autograd/ops.hpp"
#include "acc/dist/functional.hpp"
#include "acc/nn/transformer.hpp"
#include "acc/util/error.hpp"
#include "method.hpp"

namespace acc::strategies {
namespace {

enum class SequenceParallelKind { kUlysses, kMegatron };

const char* kind_name(SequenceParallelKind k) {
  switch (k) {
    case SequenceParallelKind::kUlysses:
      return "ulysses";
    case SequenceParallelKind::kMegatron:
      return "megatron";
  }
  return "?";
}

struct SequenceParallelConfig {
  SequenceParallelKind kind = SequenceParallelKind::kUlysses;
  int size = 1;  // ulysses: ranks along cp
};

SequenceParallelConfig config_from(const nlohmann::json& c) {
  ACC_CHECK(c.contains("kind"),
            "sequence_parallel: config needs \"kind\": \"ulysses\" (with \"size\") or "
            "\"megatron\", e.g. {\"kind\": \"ulysses\", \"size\": 2}");
  const auto& k = c["kind"];
  SequenceParallelConfig out;
  if (k == kind_name(SequenceParallelKind::kUlysses)) {
    out.kind = SequenceParallelKind::kUlysses;
  } else if (k == kind_name(SequenceParallelKind::kMegatron)) {
    out.kind = SequenceParallelKind::kMegatron;
  } else {
    ACC_THROW(ValueError, "sequence_parallel: kind must be \"ulysses\" or \"megatron\", got ",
              k.dump());
  }
  switch (out.kind) {
    case SequenceParallelKind::kUlysses: {
      ACC_CHECK(c.contains("size"),
                "sequence_parallel: ulysses needs \"size\" (ranks the sequence is split over, the "
                "mesh dimension cp), e.g. {\"kind\": \"ulysses\", \"size\": 2}");
      out.size = int_from("sequence_parallel", c, "size", 1, 1024);
      break;
    }
    case SequenceParallelKind::kMegatron:
      // Megatron-SP splits the sequence over tensor_parallel's ranks: no size of its own.
      ACC_CHECK(!c.contains("size"),
                "sequence_parallel: megatron runs over tensor_parallel's ranks and takes no "
                "\"size\", got ",
                c["size"].dump());
      break;
  }
  return out;
}

// The local head counts of an attention (after tensor_parallel, which replaced its projections
// with shards of whole heads): from the widths of its projections, as the attention reads them.
struct HeadCounts {
  int64_t heads = 0, kv_heads = 0;
};

bool head_counts(nn::Module& m, HeadCounts& out) {
  if (auto* a = dynamic_cast<nn::CausalSelfAttention*>(&m)) {
    const int64_t width = m.find_tensor("c_attn.weight").size(0);
    out.heads = out.kv_heads = width / (3 * a->head_dim());
    return true;
  }
  if (auto* a = dynamic_cast<nn::LlamaAttention*>(&m)) {
    out.heads = m.find_tensor("q_proj.weight").size(0) / a->head_dim();
    out.kv_heads = m.find_tensor("k_proj.weight").size(0) / a->head_dim();
    return true;
  }
  return false;
}

// The core of the attention `name` run with its heads split over `cp` and the whole sequence.
nn::AttentionCoreWrapper ulysses_core(const std::string& name, dist::ProcessGroupPtr cp) {
  return [name, cp](const nn::AttentionCore& inner, const Tensor& q, const Tensor& k,
                    const Tensor& v) {
    const int64_t s = cp->size();
    // Checked again here (the transform checked the projections): the shapes the core gets.
    ACC_CHECK(q.size(1) % s == 0 && k.size(1) % s == 0, "ulysses: '", name, "' runs ", q.size(1),
              " heads and ", k.size(1), " kv heads, not multiples of ", s);
    // (B, H, T/s, HS) -> (B, H/s, T, HS): heads scattered, the sequence gathered in rank order.
    const Tensor qh = dist::alltoall_along(q, 1, 2, cp);
    const Tensor kh = dist::alltoall_along(k, 1, 2, cp);
    const Tensor vh = dist::alltoall_along(v, 1, 2, cp);
    const Tensor y = inner(qh, kh, vh);
    return dist::alltoall_along(y, 2, 1, cp);  // (B, H/s, T, HS) -> (B, H, T/s, HS)
  };
}

// Wraps every attention core under `model` (heads and kv heads checked first, the model untouched
// when one does not divide).
Undo wrap_ulysses(nn::Module& model, const dist::ProcessGroupPtr& cp) {
  const int s = cp->size();
  ACC_CHECK(dynamic_cast<models::LanguageModel*>(&model) != nullptr, "ulysses: the model (",
            model.type_name(),
            ") is not a models::LanguageModel; the sequence split is built for language models "
            "only (their idx and targets, their position offsets)");
  std::vector<std::pair<std::string, nn::AttentionCoreHooks*>> cores;
  for (const auto& [path, m] : model.named_modules()) {
    HeadCounts hc;
    if (!head_counts(*m, hc)) continue;
    const std::string name = path.empty() ? model.type_name() : path;
    ACC_CHECK(hc.heads % s == 0, "ulysses: '", name, "' has ", hc.heads,
              " heads, not a multiple of ", s);
    ACC_CHECK(hc.kv_heads % s == 0, "ulysses: '", name, "' has ", hc.kv_heads,
              " kv heads, not a multiple of ", s,
              " (each cp rank needs the kv heads of its query heads)");
    cores.emplace_back(name, dynamic_cast<nn::AttentionCoreHooks*>(m.get()));
  }
  ACC_CHECK(!cores.empty(), "ulysses: the model (", model.type_name(),
            ") has no attention (nn::CausalSelfAttention or nn::LlamaAttention) whose core to "
            "wrap");
  std::vector<Undo> undos;
  for (const auto& entry : cores)
    undos.push_back(entry.second->wrap_core(ulysses_core(entry.first, cp)));
  return nn::undo_all(std::move(undos));
}

// Counted targets (not acc::cross_entropy's ignore index) in columns [from, from + n).
int64_t counted_targets(const Tensor& targets, int64_t from, int64_t n) {
  constexpr int64_t kIgnoreIndex = -100;
  const Tensor t = targets.narrow(1, from, n).contiguous();
  int64_t count = 0;
  if (t.dtype() == DType::kInt64) {
    for (int64_t v : t.to_vector<int64_t>()) count += v != kIgnoreIndex;
  } else {
    for (int32_t v : t.to_vector<int32_t>()) count += v != kIgnoreIndex;
  }
  return count;
}

// This rank's chunk of a micro-batch and the weight of its mean loss that makes the Trainer's
// average over cp the micro-batch's token mean (the file comment).
SequenceChunk ulysses_chunk(const data::Batch& batch, int rank, int s) {
  for (const auto& entry : batch.tensors()) {
    ACC_CHECK(entry.first == "idx" || entry.first == "targets", "ulysses: the batch holds '",
              entry.first, "' (", batch.describe(),
              "); only a language model's idx and targets are split along the sequence");
  }
  const Tensor& idx = batch.idx();
  const Tensor& targets = batch.targets();
  ACC_CHECK_SHAPE(idx.dim() == 2 && targets.shape() == idx.shape(),
                  "ulysses: expects idx and targets (B, T), got ", batch.describe());
  const int64_t T = idx.size(1);
  ACC_CHECK(T % s == 0, "ulysses: the sequence has ", T, " tokens, not a multiple of ", s,
            " (each cp rank holds T/", s, " of them)");
  const int64_t chunk = T / s;
  SequenceChunk out{
      data::Batch(idx.narrow(1, rank * chunk, chunk), targets.narrow(1, rank * chunk, chunk)),
      rank * chunk, 1.0};
  if (targets.is_meta()) return out;  // a trace (the search's): shapes only, every target counted
  const int64_t n = counted_targets(targets, rank * chunk, chunk);
  const int64_t total = counted_targets(targets, 0, T);
  for (int r = 0; r < s; ++r) {
    ACC_CHECK(counted_targets(targets, r * chunk, chunk) > 0, "ulysses: chunk ", r, " (tokens [",
              r * chunk, ", ", (r + 1) * chunk,
              ")) of the micro-batch has only ignored targets (-100): its mean loss is 0/0");
  }
  // Equal counts (no ignored target, or as many in every chunk): the plain mean, untouched.
  if (n * s != total) out.loss_weight = static_cast<double>(n) * s / static_cast<double>(total);
  return out;
}

// The loss of this rank's chunk of the sequence, weighed by ulysses_chunk.
LossFn ulysses_loss(LossFn inner, int rank, int s) {
  return [inner = std::move(inner), rank, s](nn::Module& model, const data::Batch& batch) {
    const SequenceChunk mine = ulysses_chunk(batch, rank, s);
    Tensor l;
    {
      nn::ForwardOptionsGuard guard(mine.options());
      l = inner(model, mine.batch);
    }
    return mine.weigh(l);
  };
}

void apply_ulysses(const SequenceParallelConfig& config, TrainingPlan& plan) {
  const int s = config.size;
  ACC_CHECK(plan.context->size(dist::MeshDim::kCp) == s, "sequence_parallel: ulysses size ", s,
            " but the run's mesh is ", plan.context->mesh().to_string());
  if (s == 1) return;
  const dist::ProcessGroupPtr cp = plan.context->group(dist::MeshDim::kCp);
  plan.model_transforms.push_back(
      {"sequence_parallel", [cp](nn::Module& model) -> Undo { return wrap_ulysses(model, cp); }});
  const int rank = plan.context->coordinate(dist::MeshDim::kCp);
  plan.loss = ulysses_loss(plan.loss, rank, s);
  plan.sequence_split->chunk = [rank, s](const data::Batch& b) {
    return ulysses_chunk(b, rank, s);
  };
}

// Megatron-SP (Korthikanti et al. 2022) over tensor_parallel's ranks: its transform does the
// work (tp_transform.hpp's TensorParallelOptions: blocks on sequence chunks, all-gathers and
// reduce-scatters instead of all-reduces, dropout masks of the whole sequence), and the Trainer
// sums the then partial gradients of the replicated parameters inside the blocks over tp.
void apply_megatron(TrainingPlan& plan) {
  // make_plan applies tensor_parallel first, so it has said its size by now.
  ACC_CHECK(plan.tensor_parallel > 0,
            "sequence_parallel: kind megatron splits the sequence over tensor_parallel's ranks: "
            "add tensor_parallel to the strategy");
  *plan.megatron_sp = true;
}

}  // namespace

nn::ForwardOptions SequenceChunk::options() const {
  nn::ForwardOptions o = nn::current_forward_options();
  o.position_offset = position_offset;
  return o;
}

Tensor SequenceChunk::weigh(const Tensor& mean_loss) const {
  return loss_weight == 1.0 ? mean_loss : scale(mean_loss, loss_weight);
}

MethodSpec sequence_parallel_method() {
  return {.name = "sequence_parallel",
          .slot = "sequence_parallel",
          .exclusive_slot = true,
          .config_keys = {"kind", "size"},
          .apply =
              [](const nlohmann::json& c, TrainingPlan& plan) {
                const SequenceParallelConfig config = config_from(c);
                // One case per kind: Megatron-SP becomes one more.
                switch (config.kind) {
                  case SequenceParallelKind::kUlysses:
                    if (plan.context) apply_ulysses(config, plan);
                    return;
                  case SequenceParallelKind::kMegatron:
                    if (plan.context) apply_megatron(plan);
                    return;
                }
              },
          // The search tries Megatron-SP (a candidate with tensor_parallel: the composition
          // rule below drops the others) and Ulysses over every size that divides the world; the
          // transforms' own checks (heads, kv heads, the sequence, a language model) exclude a
          // candidate with their reason when the search traces it. As tensor_parallel, no
          // effects of its own: the trace of the rank's model holds its all-to-alls,
          // all-gathers and reduce-scatters and its activations split along the sequence.
          .search_choices =
              [](const SearchContext& ctx) {
                std::vector<nlohmann::json> out;
                if (ctx.world > 1) out.push_back({{"kind", "megatron"}});
                for (int s = 2; s <= ctx.world; s *= 2) {
                  if (ctx.world % s == 0) out.push_back({{"kind", "ulysses"}, {"size", s}});
                }
                return out;
              },
          .effects = [](const nlohmann::json&, const SearchContext&, StepEffects&) {},
          .mesh =
              [](const nlohmann::json& c, dist::DeviceMesh& mesh) {
                const SequenceParallelConfig config = config_from(c);
                if (config.kind == SequenceParallelKind::kUlysses) mesh.cp = config.size;
              },
          .layout = true,
          .check_with =
              [](const nlohmann::json& c, const Strategy& whole) {
                if (config_from(c).kind != SequenceParallelKind::kMegatron) return;
                const bool tp = std::any_of(whole.begin(), whole.end(), [](const Method& m) {
                  return m.name == "tensor_parallel";
                });
                ACC_CHECK(tp,
                          "sequence_parallel: kind megatron splits the sequence over "
                          "tensor_parallel's ranks: add tensor_parallel to the strategy");
              }};
}

int64_t stage_message_tokens(const Strategy& s, const dist::DeviceMesh& mesh, int64_t seq_len) {
  bool megatron = false;
  for (const auto& m : s) {
    megatron |= m.name == "sequence_parallel" &&
                config_from(m.config).kind == SequenceParallelKind::kMegatron;
  }
  return seq_len / (megatron ? mesh.tp : 1) / mesh.cp;
}

}  // namespace acc::strategies
