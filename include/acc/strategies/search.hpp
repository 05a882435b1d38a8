#pragma once
// What each registered method tells the strategy search (accelerate/): which configs of it to
// try, when it may be tried at all, and what it does to a training step's memory and time. The
// search builds its candidate space from these declarations and never names a method, so a new
// method (tensor or pipeline parallel) joins the search by declaring itself in its own file.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "acc/strategies/strategy.hpp"

namespace acc::strategies {

/// What the search knows of the run when it asks a method for its choices.
struct SearchContext {
  int world = 1;           // ranks of the data-parallel group
  int64_t num_blocks = 0;  // the model's repeated blocks (trace::find_blocks)
  /// The most samples a rank may take per optimizer step: the global batch (a tensor- or
  /// sequence-parallel layout may hold every rank in one group). Choices up to it are offered; a
  /// candidate whose own per-rank batch (global / its dp) one does not divide is left out.
  int64_t per_rank_batch = 0;
  bool allow_bf16 = false;    // the user allows bf16 (amp)
  bool has_attention = true;  // the model has attention cores (selective recomputation)
  /// The model is a language model of the registry, which pipeline_parallel cuts into stages (a
  /// module of the user's is not cut yet: no pipeline is tried for it).
  bool language_model = true;
};

/// What the methods of a candidate do to one training step, filled in by their `effects`; the
/// search's memory and cost model read it. Starts as one rank holding everything, one
/// micro-batch, nothing recomputed, f32 throughout, no communication.
struct StepEffects {
  // Activations (the trace's options).
  int64_t recompute_blocks = 0;  // blocks recomputed in backward, from the first (-1: all)
  /// Only those blocks' attention cores are recomputed (checkpoint {"kind": "selective"}).
  bool selective_recompute = false;
  bool bf16_activations = false;  // saved activations inside blocks kept in bf16
  // Schedule.
  int micro_batches = 1;  // the per-rank batch is split into this many
  /// A pipeline (pipeline_parallel): ranks along pp and stages per rank. Its micro-batches are
  /// micro_batches; gradients are reduced over dp after the schedule (nothing overlaps it).
  int pipeline_ranks = 1;
  int pipeline_virtual = 1;
  ScheduleKind pipeline_schedule = ScheduleKind::kOneFOneB;
  // Resident training state per rank: whole, or 1/world of it.
  bool shard_parameters = false;
  bool shard_gradients = false;
  bool shard_optimizer_state = false;
  /// Whole blocks' parameters gathered at once beyond the shard (fsdp), and the gradient buffers
  /// a method keeps besides the parameters' own (bucket copies), in multiples of the bucket size.
  int gathered_blocks = 0;
  int64_t bucket_bytes = 0;
  /// The whole gradient also lives in the method's flat buckets (all-reduce buckets), besides the
  /// parameters' own gradients made by backward.
  bool gradient_buckets = false;
  /// The buckets take the parameters' gradients as they are packed (zero1 drops each parameter's
  /// gradient once copied): at the end of backward the gradient lives in the buckets only.
  bool buckets_take_gradients = false;
  /// Full buckets alive at once while they reduce (reduce-scatter buckets), at most the gradient.
  int buckets_in_flight = 0;
  /// Whole copies of the parameters alive while updated shards are all-gathered after the
  /// optimizer step (on top of the resident state): zero2 packs and gathers into full buffers.
  int parameter_copies_after_step = 0;
  // Communication per optimizer step, in elements of the whole model's parameters/gradients
  // (the model multiplies by the element size: 2 with bf16 communication, else 4).
  bool bf16_communication = false;
  struct Collective {
    std::string op;  // "allreduce" | "reduce_scatter" | "allgather" | "broadcast"
    enum class Of { kGradients, kParameters } of = Of::kGradients;
    /// kBackward: issued bucket by bucket while backward runs (overlaps it, except the last
    /// bucket); kForward: before each block's forward and again before its backward (fsdp,
    /// once per micro-batch); kAfterStep: after the optimizer step, exposed.
    enum class When { kBackward, kForward, kAfterStep } when = When::kBackward;
  };
  std::vector<Collective> collectives;
  /// Names of the methods that filled this, in order (for reports).
  std::vector<std::string> methods;
};

/// One registered method as the search sees it.
struct MethodSearch {
  std::string name;
  std::string slot;  // methods in one exclusive slot exclude each other
  bool exclusive_slot = false;
  bool needs_bf16 = false;   // tried only when SearchContext::allow_bf16
  bool needs_ranks = false;  // tried only when world > 1 (and then one of its slot is required)
  /// The configs to try for this method in this run (empty: the method is not tried).
  std::function<std::vector<nlohmann::json>(const SearchContext&)> choices;
  /// Adds what the method with `config` does to a step. Methods of exclusive slots with
  /// needs_ranks (the gradient synchronisation) run after the others.
  std::function<void(const nlohmann::json& config, const SearchContext&, StepEffects&)> effects;
  /// Methods it never composes with (parse_strategy refuses any strategy holding both).
  std::vector<std::string> never_with;
};

/// The registered methods' search declarations, in registry order.
std::vector<MethodSearch> searchable_methods();

/// layout_of(s) without the pipeline: the methods each pipeline stage runs (tensor and sequence
/// parallelism). The search keys a pipeline rank's trace by them and by its stages.
Strategy stage_layout_of(const Strategy& s);

/// Tokens of one sample in the activation a pipeline stage of `s` on `mesh` sends to the next
/// (and the gradient it gets back): the sequence of `seq_len` tokens, split over tp under
/// Megatron-SP and over cp under Ulysses (each cp rank sends its chunk to its peer).
///
/// Not read from the search's trace: the copy a pp rank is traced on receives the whole sequence
/// into its first block under Megatron-SP (the copy's first block scatters it, Pipeline::
/// trace_step), where the run receives its tp chunk.
int64_t stage_message_tokens(const Strategy& s, const dist::DeviceMesh& mesh, int64_t seq_len);

}  // namespace acc::strategies
