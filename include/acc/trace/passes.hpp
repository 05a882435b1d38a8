#pragma once
// Analyses over a trace: FLOPs and bytes per module scope, the repeated-block structure, the
// patterns tensor parallelism shards, topological order, liveness of activations, and the memory
// and compute estimates the strategy search trusts.
//
// Every count is int64 (elements, bytes, FLOPs: exact, and 9.2e18 exceeds any machine's memory and
// any micro-batch step) and every sum or product is checked: a total that does not fit is an
// acc::ValueError naming the quantity, never a wrapped negative number.

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "acc/nn/module.hpp"
#include "acc/trace/tracer.hpp"

namespace acc::trace {

// ---- per scope ----
struct ScopeStats {
  int64_t forward_flops = 0;
  int64_t backward_flops = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t ops = 0;
  int64_t parameters = 0;  // elements of parameters registered under the scope
};
/// Stats of every scope, each op counted in its scope and in every enclosing one ("" is the whole
/// model). Parameters are attributed by their dotted names.
std::map<std::string, ScopeStats> scope_stats(const Trace& t);

// ---- structure ----
/// A run of sibling modules with the same type and the same parameter names and shapes, called in
/// sequence: the transformer blocks the pipeline splitter and the recompute chooser work with.
struct BlockGroup {
  std::string container;            // dotted name of the parent ("transformer.h")
  std::string type_name;            // "GPTBlock"
  std::vector<std::string> blocks;  // dotted names, in order
  int64_t parameters_per_block = 0;
};
/// Found from the module tree alone (any model, no names recognised); the largest group first.
std::vector<BlockGroup> find_blocks(const nn::Module& module);

/// Linear -> activation -> Linear (an MLP tensor parallelism splits column-then-row). For a gated
/// MLP, `first` holds both the gate and the up projection.
struct MlpPattern {
  std::string scope;               // the enclosing module
  std::vector<std::string> first;  // scopes of the first linear(s)
  std::string activation;          // "Gelu", "Silu", "Swiglu", "Relu"
  std::string second;              // scope of the second linear
};
/// q/k/v projection(s) -> attention -> output projection.
struct AttentionPattern {
  std::string scope;
  std::vector<std::string> qkv;  // scopes of the linear(s) producing q, k and v
  std::string attention_op;      // "Attention"
  std::string proj;              // scope of the output projection
};
std::vector<MlpPattern> find_mlp_patterns(const Trace& t);
std::vector<AttentionPattern> find_attention_patterns(const Trace& t);

/// Vertices in a topological order of the data-flow edges (Boost.Graph topological_sort).
std::vector<VertexId> topological_order(const Trace& t);

// ---- liveness and memory ----
struct StorageLife {
  uint64_t storage = 0;
  int64_t bytes = 0;
  int64_t born = -1;  // op index after which it exists (-1: before the first op)
  int64_t dies = -1;  // op index after which it is gone (-1: alive at the end)
  enum class Role { kParameter, kGradient, kInput, kActivation } role = Role::kActivation;
};
struct Liveness {
  std::vector<StorageLife> storages;
  /// Bytes alive after each op (index into graph.ops()), all roles.
  std::vector<int64_t> live_after_op;
  int64_t peak_bytes = 0;
  int64_t peak_op = -1;  // op index where the peak is reached
  /// Activation bytes alive when the forward ends (saved for backward).
  int64_t saved_activation_bytes = 0;
};
Liveness liveness(const Trace& t);

/// Bytes of optimizer state per parameter byte: adamw/adam 2, sgd with momentum 1, sgd 0,
/// "buffers:<k>" k.
/// Throws acc::ValueError for an unknown optimizer name.
double optimizer_state_factor(const std::string& optimizer);
/// The optimizer name whose state is `buffers` parameter-sized buffers (optim::
/// optimizer_state_buffers of a user's factory): 0 "sgd", 1 "sgd_momentum", 2 "adamw", else
/// "buffers:<count>" (which optimizer_state_factor reads as that count). Throws acc::ValueError
/// when negative.
std::string optimizer_with_state_buffers(int buffers);
/// optimizer_state_factor(optimizer) x parameter_bytes; throws acc::ValueError for an unknown
/// optimizer or when the product does not fit in 64 bits.
int64_t optimizer_state_bytes(const std::string& optimizer, int64_t parameter_bytes);

struct MemoryEstimate {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  int64_t activations_peak = 0;  // peak of activation bytes alive during the step
  /// The same step as one that adds into gradients already held (a later micro-batch's): each
  /// gradient a backward makes is then alive beside the activations only until its leaf's
  /// accumulator adds it in (at once: the engine runs an accumulator as soon as it is ready), so
  /// the peak of the activations plus the gradient made at each moment. >= activations_peak.
  int64_t accumulating_peak = 0;
  /// Activation bytes alive when backward begins: what the forward saved for it (what a pipeline
  /// stage holds per micro-batch in flight).
  int64_t activations_saved = 0;
  /// Predicted peak of acc::memory::current_bytes() over a training step: parameters and
  /// optimizer state (alive throughout) plus the peak of everything the step allocates.
  int64_t peak = 0;
};
/// From liveness over the trace (the trace's recompute choice included).
MemoryEstimate estimate_memory(const Trace& t, const std::string& optimizer = "adamw");

struct ComputeEstimate {
  int64_t forward_flops = 0;
  int64_t backward_flops = 0;
  /// Throws acc::ValueError when the sum does not fit in 64 bits.
  int64_t total() const;
};
/// FLOPs per step exactly as counted from the ops (recomputed forwards included when present).
ComputeEstimate estimate_compute(const Trace& t);

// ---- communication ----
struct CommStats {
  int group_size = 0;
  int64_t ops = 0;
  int64_t forward_bytes = 0;   // CommRecord::bytes of the forward ops, summed
  int64_t backward_bytes = 0;  // and of the backward ones
  /// Throws acc::ValueError when the sum does not fit in 64 bits.
  int64_t bytes() const;
};
/// The communication vertices' bytes summed per group name and kind, forward and backward apart:
/// what a cost model prices with each group's fits (search::CommCalibration counts bytes the same
/// way, comm_kind_name its op). Throws acc::ValueError when one group name appears with two sizes
/// or a sum does not fit in 64 bits.
std::map<std::pair<std::string, CommKind>, CommStats> comm_stats(const Trace& t);

}  // namespace acc::trace
