#pragma once
// What one training step of a language model needs, known without building it: the parameters,
// gradients, optimizer state, activation peak and FLOPs of a model of n blocks, and the size of
// the graph a full trace of it would hold.
//
// Decision: building even a meta model of 10^9 blocks takes minutes and gigabytes of host
// memory, so the model is never built. Shallow copies of the config are traced on the meta device
// instead (each in milliseconds):
//  - counts (parameters, gradient and optimizer bytes, FLOPs, graph vertices and ops) are linear in
//    the block count for models that repeat one block, as GPT and Llama do:
//    f(n) = f(1) + (n - 1 - k) * (f(2) - f(1)) + k * (f(2 with block 0 recomputed) - f(1)) when
//    the first k of n blocks are recomputed (k = 0 when none or all are);
//  - peaks are not linear where the peak moves (from the start of backward to its end as gradients
//    outgrow the activations they replace), so they come from the memory timeline of a copy whose
//    runs of blocks (recomputed, plain) are cut to their first, middle and last block: each block
//    of the copy stands for `count` blocks of the deep model, repetition r of its segment of the
//    timeline starts r x (the segment's net change) higher, and the highest point over the
//    repetitions is in the first or the last. Exact wherever the peak falls.
// tests/trace/trace_test.cpp compares every figure with full traces of 1 to 13 blocks (GPT, Llama;
// none, all, the first k recomputed; bf16 activations): all equal. Every step of the arithmetic
// is checked: a figure that does not fit in 64 bits is an acc::ValueError naming the block count.
//
// The figures are for one rank holding the whole model, as acc-trace prints them (a single process
// or ddp); sharding strategies (zero, fsdp) and pipeline stages hold less.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "acc/trace/model_ref.hpp"
#include "acc/trace/passes.hpp"
#include "acc/trace/tracer.hpp"

namespace acc::trace {

/// Host memory a trace takes per graph vertex (the meta model, the autograd tape and the graph):
/// measured 1.3-1.8 KiB per vertex in acc-trace's max RSS for GPT and Llama at 100 to 8000 blocks;
/// rounded up so the estimate errs on the side of refusing.
inline constexpr int64_t kTraceHostBytesPerVertex = 2048;

/// Gradients held block by block, as a strategy that shards them as it goes (fsdp) holds them: at
/// the end of each block's backward, the buffer of the previous block is waited for and freed, the
/// block's live gradients are packed into a buffer of their size (both alive at that moment), they
/// are dropped, and `in_flight_fraction` x their bytes stay until the next block's backward ends
/// (the reduction in flight: 1 for an fp32 buffer, 0.5 for bf16, plus whatever the collective
/// allocates). Gradients of parameters outside the blocks are held as in the whole-model figure.
/// `accumulated`: the last micro-batch of gradient accumulation, every gradient held from the
/// start (the earlier micro-batches') and each new one added into it and freed; the figure then
/// includes memory.gradients.
struct BlockwiseGradients {
  double in_flight_fraction = 1.0;
  bool accumulated = false;
};

/// One segment of a step's memory timeline cut at its blocks: the bytes it adds over one run of it
/// (born less died) and the highest point it reaches above its start.
struct TimelineSegment {
  int64_t delta = 0;
  int64_t high = 0;
  bool any = false;  // it has memory events at all
};

/// A step's memory timeline (every storage but the parameters) cut where its blocks begin and
/// end: segment 0 before the blocks, 1..N the forwards of blocks 0..N-1, N+1 between (head, loss),
/// N+2..2N+1 the backwards of blocks N-1..0, 2N+2 after. Block i of the cut stands for counts[i]
/// consecutive blocks of the deep model, each running its two segments once (ops between two
/// blocks, a pipeline rank's messages between its stages, count with the block before them; a
/// need keeps such a timeline only when each block of its cut stands for itself). `accumulating` is
/// the same step adding into gradients held from an earlier micro-batch: activations only, each
/// gradient alive only as it is made (MemoryEstimate::accumulating_peak's timeline).
struct TimelineCut {
  std::vector<int64_t> counts;
  std::vector<TimelineSegment> live, accumulating;
};

/// The highest point of a step's memory timeline while each stage of a pipeline rank runs (see
/// stage_highs), relative to the timeline's start (parameters and optimizer state left out).
struct StageHighs {
  int64_t forward = 0;                // during the stage's forward (the first stage's embedding)
  int64_t backward = 0;               // during its backward (the last stage's head and loss)
  int64_t backward_accumulating = 0;  // the same on TimelineCut::accumulating
};

struct TrainingNeed {
  std::string model_type;   // "gpt" | "llama"
  std::string layers_key;   // the config field counting blocks ("n_layer", "num_hidden_layers")
  int64_t num_layers = 0;   // blocks of the full model
  int64_t batch = 0;        // B
  int64_t seq_len = 0;      // T
  std::string optimizer;    // whose state memory.optimizer_state counts
  int64_t parameters = 0;   // elements
  MemoryEstimate memory;    // bytes, as estimate_memory() of the full trace would give
  ComputeEstimate compute;  // FLOPs per step, as estimate_compute() of the full trace would give
  // The repeated blocks (find_blocks() of the shallow model; the count is num_layers).
  std::string block_type, block_container;
  int64_t parameters_per_block = 0;
  // What one block's forward saves for backward (memory.activations_saved less the model's ends,
  // the embedding and head, spread over its blocks): a block beyond the first
  // options.recompute_blocks (every block when all or none are recomputed), and one of those
  // first blocks when only some are. From the 1- and 2-block samples, or, for a model traced
  // whole, one more trace a block shorter (longer at 1 block). 0 for a module that is not the
  // registry's (traced whole, never cut into stages).
  int64_t block_activations_saved = 0;
  int64_t recomputed_block_activations_saved = 0;
  // With the BlockwiseGradients option: the peak of every storage but the parameters with the
  // blocks' gradients held block by block (compare memory.peak - parameters - optimizer_state).
  // Exact as the other peaks; when the blocks do not run one after another, the whole-model figure.
  int64_t blockwise_live_peak = 0;
  // The timeline the peaks come from, for stage_highs; empty when the trace's ops do not run
  // block after block (the peaks are then extrapolated like the counts).
  std::optional<TimelineCut> timeline;
  // The graph a full trace would hold, and the host memory it would take.
  int64_t graph_vertices = 0;
  int64_t graph_ops = 0;
  int64_t graph_forward_ops = 0;
  int64_t trace_host_bytes = 0;  // graph_vertices x kTraceHostBytesPerVertex

  /// Bytes one training step needs on a rank holding the whole model: memory.peak (parameters
  /// and optimizer state throughout, plus the peak of gradients and activations).
  int64_t total() const { return memory.peak; }
};

/// Estimates a training step of `model_type` ("gpt" | "llama") built from `config` on micro-batches
/// of batch x seq_len tokens (seq_len 0: the model's maximum), with the trace options'
/// recomputation / bf16 activations and `optimizer`'s state (see optimizer_state_factor). Takes
/// milliseconds for any block count. Throws acc::ValueError for a bad config, batch < 1,
/// seq_len < 0, an unknown optimizer, or a figure that does not fit in 64 bits (naming the block
/// count); acc::ShapeError when a tensor of the shallow model or the inputs is too large to
/// describe (naming its shape); and what the model throws for a sequence longer than it allows.
TrainingNeed estimate_training_need(const std::string& model_type, const nlohmann::json& config,
                                    int64_t batch, int64_t seq_len,
                                    const TraceOptions& options = {},
                                    const std::string& optimizer = "adamw",
                                    std::optional<BlockwiseGradients> blockwise = std::nullopt);

/// The same for any model the ModelRef names: a user's module is traced whole on its sample's
/// shapes (seq_len ignored), so its figures are exact rather than extrapolated.
TrainingNeed estimate_training_need(const ModelRef& model, int64_t batch, int64_t seq_len,
                                    const TraceOptions& options = {},
                                    const std::string& optimizer = "adamw",
                                    std::optional<BlockwiseGradients> blockwise = std::nullopt);

/// estimate_training_need at each of `batches`, equal to it field by field, for the cost of
/// two batches' traces: a registry model's traces are made at 2 and 3 samples and every larger
/// batch is evaluated from them (trace::BatchTraces: every size in a trace is affine in the
/// batch; where the two traces do not have the same ops and memory events, each batch is traced
/// itself). A batch of 1 is traced itself at 1 and 2 blocks; its deeper traces (the cut of the
/// first, middle and last blocks) are the pair's line at 1 (BatchTraces::at_one) where the 2-block
/// trace at one sample has the pair's structure and every block runs alike (none or all
/// recomputed), else traced too. A user's module is traced at each batch. Throws what
/// estimate_training_need throws, and acc::ValueError for no batches.
std::vector<TrainingNeed> estimate_training_needs(
    const ModelRef& model, const std::vector<int64_t>& batches, int64_t seq_len,
    const TraceOptions& options = {}, const std::string& optimizer = "adamw",
    std::optional<BlockwiseGradients> blockwise = std::nullopt);

/// The highest point of `need`'s timeline (its memory.peak less parameter and optimizer bytes is
/// the highest of all) during each stage's forward and backward, its blocks cut into stages of
/// `stage_blocks` consecutive blocks (a pipeline rank's stages, in the order its trace runs
/// them): what a schedule running the stages' actions among other micro-batches' adds its own
/// in-flight activations to. What runs before the first block (the embedding) counts to the
/// first stage's forward and, after the last block's backward, to its backward; what runs between
/// the forwards and the backwards (head, loss) to the last stage's backward. Exact as the
/// peaks are, at any depth. std::nullopt when the need has no timeline. Throws acc::ValueError
/// when a stage has no block or the stages do not hold the need's num_layers blocks.
std::optional<std::vector<StageHighs>> stage_highs(const TrainingNeed& need,
                                                   const std::vector<int64_t>& stage_blocks);

/// The BlockwiseGradients peak of a full trace whose repeated blocks (find_blocks) are `blocks`,
/// straight from its timeline: what estimate_training_need extrapolates. Throws acc::ValueError
/// when the blocks do not run one after another.
int64_t blockwise_live_peak(const Trace& t, const std::vector<std::string>& blocks,
                            const BlockwiseGradients& blockwise);

/// Throws acc::ValueError "<what>: a training step needs N bytes (...), more than the M bytes
/// available" with both figures (exact and human-readable) and the parts of the need, when
/// need.total() > available_bytes; returns otherwise. A caller about to build a model passes
/// acc::available_memory_bytes() (acc/util/system.hpp):
///
///   auto need = acc::trace::estimate_training_need("gpt", config, B, T, {}, "adamw");
///   acc::trace::check_fits(need, acc::available_memory_bytes(), "train_gpt");
void check_fits(const TrainingNeed& need, int64_t available_bytes, const std::string& what);

/// 16 lower-case hex digits naming what a model computes, for keys that must change when the model
/// does (the strategy cache, checkpoints): FNV-1a 64 of the canonical JSON of the model type, the
/// config with its defaults filled (sorted keys) and the trace of a two-block copy on one sample
/// of min(8, max) tokens (every op, scope and tensor shape; acc::trace::to_json). Equal on every
/// rank, run and machine for the same model code and config; another config, or a change to the
/// model's code that changes its graph, gives another hash. Milliseconds at any depth. Throws what
/// models::create_meta_model throws for a bad config.
std::string model_trace_hash(const std::string& model_type, const nlohmann::json& config);

/// "1.50 GiB" (B, KiB, MiB, GiB, TiB, PiB, EiB), for messages and tables.
std::string human_bytes(double bytes);

}  // namespace acc::trace
