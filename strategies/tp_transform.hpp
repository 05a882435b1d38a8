#pragma once
// Tensor parallelism as a model transform (Megatron 1D): the attention's q|k|v projection(s) and
// the MLP's first linear(s) become column-parallel, the attention's output and the MLP's second
// linear row-parallel (strategies/tp_layers.hpp), over the group `tp`. Which linears: the trace's
// attention and MLP patterns (trace::find_attention_patterns / find_mlp_patterns), never the
// model's name, so GPT, Llama and a transformer of the user's whose attention is one of the nn
// attention classes are sharded alike; every other module stays replicated. Heads are split with
// nn::shard_heads (a rank keeps NH/tp query heads and their kv heads); the attention reads its
// local head counts from the projections' widths.
//
// Fewer kv heads than ranks: each kv head is held by the tp / kv_heads ranks whose query heads use
// it, and its k/v weights enter the forward through copy_to_group over those ranks, so their
// gradient is the sum of the sharers' partial gradients (replicated, as one process computes it).
// Every tp rank shards tp rank 0's whole model (broadcast first).

#include "acc/dist/process_group.hpp"
#include "acc/models/language_model.hpp"
#include "acc/nn/module.hpp"
#include "acc/trace/tracer.hpp"
#include "grad_sync.hpp"

namespace acc::strategies {

/// Shards `model` over `tp`, finding the patterns from `trace` (a trace of the model's step).
/// Returns the undo: a collective over `tp` that gathers every shard's current values back into
/// the whole linears and puts them back in place. Throws acc::ValueError naming the module, the
/// counts and tp for a split that does not divide (heads, kv heads, MLP width), an attention that
/// is not one of nn's classes (its head size unknown), kv heads that do not divide the ranks (or
/// that the ranks do not divide), and a model without any attention or MLP pattern; the model is
/// untouched then. `layouts` (optional) receives the layout of every sharded parameter, by name
/// (grad_sync.hpp), and loses them again when the transform is undone.
struct TensorParallelOptions {
  /// Megatron's sequence parallelism (Korthikanti et al. 2022): between the tensor-parallel ops
  /// the activations are split along the sequence (dimension 1) over tp. The first block's input
  /// is scattered and the last block's output gathered; the column-parallel linears all-gather
  /// their input and the row-parallel ones reduce-scatter their output, instead of the
  /// all-reduces. Inside the blocks the norms, residual adds and dropout run on this rank's
  /// chunk (dropout draws the whole sequence's masks: ForwardOptions::sequence_chunk), so the
  /// replicated parameters there (norm weights, row-parallel biases) get partial gradients, to be
  /// summed over tp (their names go to `partial_over_tp`). Every shard must lie in the blocks
  /// (trace::find_blocks), T divisible by tp.
  bool sequence_parallel = false;
};

nn::Undo shard_tensor_parallel(nn::Module& model, const trace::Trace& trace,
                               const dist::ProcessGroupPtr& tp, ParamLayouts* layouts = nullptr,
                               const TensorParallelOptions& options = {},
                               std::vector<std::string>* partial_over_tp = nullptr);

/// Megatron's vocabulary split of a language model over `tp`: its token embedding becomes a
/// VocabParallelEmbedding (a tied output projection stays tied: the embedding's attend gives this
/// rank's columns of the logits) and an untied output projection a VocabParallelHead, both over
/// the vocabulary padded to a multiple of tp (the padding rows in no layout: never in the norm,
/// a checkpoint or an export). The model's forward then gives this rank's columns of the logits,
/// for vocab_parallel_cross_entropy. Found by the model's vocabulary size (the Embedding with V
/// rows, the Linear C -> V), never by name; acc::ValueError naming what is missing or ambiguous.
/// The undo gathers the rows back into the whole modules (a collective over tp).
nn::Undo shard_vocab_parallel(models::LanguageModel& lm, const dist::ProcessGroupPtr& tp,
                              ParamLayouts* layouts = nullptr);

}  // namespace acc::strategies
