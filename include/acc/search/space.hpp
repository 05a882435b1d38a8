#pragma once
// The candidate space of the strategy search and each candidate's predicted memory.
//
// The space comes from the methods' own declarations (strategies::searchable_methods()): per
// exclusive slot one of its methods or none (a grad_sync method is required on more than one
// rank, and none is tried on one), every other method in or out, each with the configs it
// declares for this run; combinations the composition rules refuse are left out. Nothing here
// names a method.
//
// Memory: the step's need is traced (trace::estimate_training_need: the micro-batch, the
// recomputed blocks, bf16 activations; milliseconds at any depth) for one rank holding the whole
// model, then the candidate's effects reshape it: sharded state counts 1/world, gathered blocks
// and the gradient buffers of bucketed methods are added.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "acc/dist/device_mesh.hpp"
#include "acc/strategies/search.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/trace/estimate.hpp"

#include "acc/trace/model_ref.hpp"

namespace acc::search {

struct SpaceOptions {
  int world = 1;
  int64_t global_batch = 0;  // samples per optimizer step over all ranks
  int64_t seq_len = 0;
  bool allow_bf16 = false;
  std::vector<std::string> excluded;  // methods never tried
  std::vector<std::string> included;  // methods every candidate has
  /// The model has attention cores (trace::ModelRef::has_attention): else selective
  /// recomputation is not tried (it would have nothing to recompute and is refused).
  bool has_attention = true;
  /// The model is a registry language model (trace::ModelRef::is_registry): else no pipeline is
  /// tried (pipeline_parallel cuts language models only).
  bool language_model = true;
};

struct Candidate {
  /// Its methods (set_strategy changes them, and its layout key with them).
  const strategies::Strategy& strategy() const { return strategy_; }
  void set_strategy(strategies::Strategy s);
  strategies::StepEffects effects;
  int world = 1;
  /// The strategy's mesh over the world (strategies::mesh_for): the data-parallel methods shard
  /// and communicate over dp x cp; the ranks of one tp or cp group read the same samples.
  dist::DeviceMesh mesh;
  int64_t per_rank_batch = 0;  // samples per rank per step: global batch / dp
  int64_t micro_batch = 0;     // samples per forward/backward on a rank
  /// "zero2 + amp + checkpoint{blocks:2} + grad_accum{steps:4}" ("single process" when empty).
  std::string describe() const;
  /// Ranks the data-parallel methods shard over and reduce gradients over: dp x cp.
  int data_parallel_ranks() const { return mesh.dp * mesh.cp; }
  /// The candidate's layout methods (strategies::layout_of) as a key: "" when it has none. Made
  /// when the strategy is set: the search reads it several times for each of 10^5 candidates,
  /// and making it (the configs' JSON) was 7 % of a plan-only search.
  const std::string& layout_key() const { return layout_key_; }

 private:
  friend Candidate candidate_of(const strategies::Strategy&, int, int64_t,
                                const strategies::SearchContext&,
                                const std::vector<strategies::MethodSearch>&,
                                const std::optional<std::string>&);
  strategies::Strategy strategy_;
  std::string layout_key_;
};

/// The candidate of strategy `s` on `world` ranks at `global_batch` samples a step: its mesh
/// (strategies::mesh_for), per-rank batch and micro-batch, and the effects its methods declare
/// (`methods`: strategies::searchable_methods(); the gradient synchronisation last, as it reads
/// what the others set), told `ctx` of the run. `layout_key`: strategies::layout_key(s) when the
/// caller made it (enumerate_candidates, once for all the candidates of one layout), else made
/// here. Throws acc::ValueError for a method that is not searchable, and what mesh_for throws.
Candidate candidate_of(const strategies::Strategy& s, int world, int64_t global_batch,
                       const strategies::SearchContext& ctx,
                       const std::vector<strategies::MethodSearch>& methods,
                       const std::optional<std::string>& layout_key = std::nullopt);

/// Pointers to each of `candidates`, in order (what the models' expect() walk).
std::vector<const Candidate*> pointers_to(const std::vector<Candidate>& candidates);

/// Every candidate for a model of `num_blocks` repeated blocks; a candidate's dp must divide the
/// global batch (its tp and cp ranks read the same samples). Throws acc::ValueError naming the
/// value for: world < 1, a global batch < 1 or one no mesh's dp divides ("global batch 63 does
/// not split evenly over 2 ranks, nor over the dp of any mesh tried"), an unknown method in
/// excluded/included (listing the known ones), a method both excluded and included, an included
/// method that cannot be tried in this run (amp without allow_bf16, a grad_sync method on one
/// rank), or a space left empty.
std::vector<Candidate> enumerate_candidates(const SpaceOptions& options, int64_t num_blocks);

/// Each rank's share of the global batch: global_batch / world. Throws acc::ValueError naming the
/// values ("search: global batch 7 does not split evenly over 2 ranks") when world < 1,
/// global_batch < 1 or it does not divide.
int64_t per_rank_batch(int64_t global_batch, int world);

/// The model as the candidate's rank runs it: `model` itself, or traced through the candidate's
/// layout methods (strategies::layout_rewrite over its mesh: tensor_parallel's shards and
/// collectives, sequence_parallel's share of the sequence).
/// With a pipeline, the first pp rank's model (rank_models()[0]).
trace::ModelRef layout_model(const trace::ModelRef& model, const Candidate& c);

/// One action of a pipeline rank's schedule as the memory model sees it: the stage (of the rank's
/// own, RankModel::stages) it runs, forward or backward, the forwards each stage holds during it
/// (a forward's own micro-batch counted; a backward's until it ends) and the stages whose
/// gradients are held before it begins (a backward of them has run this step).
struct StageAction {
  int stage = 0;
  bool backward = false;
  std::vector<int> in_flight;
  std::vector<bool> gradients;
  bool operator==(const StageAction&) const = default;
};

/// The model as one pp rank of a candidate runs it.
struct RankModel {
  trace::ModelRef model;  // traced through the candidate's layout (its stages, shards, chunks)
  int pp_rank = 0;
  /// The whole model's blocks this rank runs, per stage (empty without a pipeline: all of them).
  std::vector<strategies::StageBlocks> stages;
  bool first = true, last = true;  // holds the first stage (embedding) / the last (head, loss)
  /// The rank's actions in the schedule's order, each distinct one once and none another of its
  /// kind holds more than (a step's peak is at one of them). Empty without a pipeline.
  std::vector<StageAction> actions;
  /// Bytes of one activation between stages (a micro-batch's (B, T, C) f32, T / tp under
  /// Megatron-SP): the runtime posts a receive of one ahead from each neighbour.
  int64_t message_bytes = 0;
  /// What the rank's trace depends on, the key of the memory and time models' trace caches: the
  /// layout's tensor and sequence methods and, with a pipeline, the blocks of each of the rank's
  /// stages and whether it holds the embedding or the head. Ranks of the pipelines of several
  /// candidates (other micro-batch counts or schedules, other ranks in the middle of one
  /// pipeline) that run the same stages share it, and so share their traces.
  std::string trace_key;
  /// What its traces at a few blocks depend on: trace_key without the stages' block counts (the
  /// copy traced splits its blocks evenly among the rank's stages, whatever their counts). The
  /// ranks of pipelines of every depth that share it trace alike (their messages' peers and tags
  /// aside) and share their traces (trace::ModelRef::shared_traces).
  std::string shape_key;
  /// trace_key's number among the rank models of one RankModels (equal keys, equal numbers; -1
  /// outside one): compared where the key's string would be, for each rank of 10^5 candidates.
  int trace_id = -1;
};

/// The model as each pp rank of `c` runs it: without a pipeline, layout_model alone. With one
/// (a registry language model only: acc::ValueError naming the model otherwise), rank r's model
/// is a copy holding exactly its blocks of pipeline_parallel's cut (strategies::pipeline_layout),
/// traced through strategies::layout_rewrite at that pp rank: its embedding or head when it holds
/// them, and its stages' messages. `seq_len`: the run's (0: the model's longest), for
/// message_bytes. Throws what the cut throws (fewer blocks than stages).
/// `walks`, when given, keeps each pipeline config's cut and schedule walk (the ranks' stages,
/// ends and actions) for the next layout around the same config: one model's, the cut depending
/// on its blocks and head. Several threads may share one (RankModels::make).
struct PipelineWalks {
  std::mutex mutex;
  std::map<std::string, std::vector<RankModel>> by_config;
};
std::vector<RankModel> rank_models(const trace::ModelRef& model, const Candidate& c,
                                   int64_t seq_len, PipelineWalks* walks = nullptr);

/// What one micro-batch's forward saves on each of a pipeline rank's stages (`need`: the rank
/// model's trace under `effects`, rank_effects of the candidate's): each stage's blocks at the
/// trace's per-block figures (the first effects.recompute_blocks of the rank's blocks recomputed)
/// and the rest of the trace, the model's ends, on the stage holding the embedding or the head
/// (spread evenly on a middle rank). Sums to need.memory.activations_saved.
std::vector<int64_t> stage_saved_bytes(const trace::TrainingNeed& need,
                                       const strategies::StepEffects& effects,
                                       const RankModel& rank);
/// The gradient bytes of each of a pipeline rank's stages, the same way: its blocks' and, on the
/// stage holding them, the embedding's or the head's. Sums to need.memory.gradients.
std::vector<int64_t> stage_gradient_bytes(const trace::TrainingNeed& need, const RankModel& rank);

/// A rank's trace (RankModel::trace_key) under activation options `a`, as a key: the candidates
/// of a space that share it are those whose micro-batches the memory and time models price
/// from one pair of traces (MemoryModel::expect, CostModel::expect). The options enter through
/// TraceOptions::key_fields(), so a new option that changes a trace changes this key too.
using BatchPairKey = std::pair<std::string, trace::TraceOptions::KeyFields>;
BatchPairKey batch_pair_key(const std::string& trace_key, const trace::TraceOptions& a);
/// The same pair with the trace key's RankModel::trace_id for its string: what the models look
/// their expected micro-batches up by for each rank of 10^5 candidates.
using RankTraceKey = std::pair<int, trace::TraceOptions::KeyFields>;

/// rank_models of one model's candidates, each layout's computed once (the memory and the time
/// model each keep one).
class RankModels {
 public:
  /// Its rank models keep their traces in a cache of its own, shared by the ranks of every
  /// layout with the same RankModel::shape_key.
  RankModels(trace::ModelRef model, int64_t seq_len);
  /// The models of `c`'s pp ranks: the model itself when `c` has no layout.
  const std::vector<RankModel>& of(const Candidate& c);
  /// of() each candidate's layout not made yet, the layouts' rank models made on the configured
  /// threads and kept in the candidates' order (the same trace ids of() gives them). A layout
  /// whose ranks cannot be made is left to of(), which throws why.
  void make(const std::vector<const Candidate*>& candidates);
  /// Those of() made before, else null. Changes nothing: several threads may ask at once while
  /// no of() runs.
  const std::vector<RankModel>* made(const Candidate& c) const;
  /// The RankModel::trace_id of `trace_key`, numbered now when no rank model has it yet (not
  /// thread-safe: the calling thread only, as of() and make() keep their layouts).
  int trace_id(const std::string& trace_key);
  /// For each rank of each candidate whose layout can be made: `f(c, pair_key)`, the rank's
  /// batch_pair_key, under which its micro-batches share traces (what the models' expect()
  /// collect). A candidate's ranks of one pair key (a deep pipeline's middle ranks) are given
  /// once, with the first of them.
  void for_each_rank(const std::vector<const Candidate*>& candidates,
                     const std::function<void(const Candidate&, const RankModel& rank,
                                              const BatchPairKey& pair_key)>& f);
  /// Keeps the traces in `cache` (another model's of the same model and sequence length: the
  /// memory and the time model of one search share theirs); null: traced each time. Call it
  /// before the first of(); afterwards it throws acc::ValueError.
  void share_traces(std::shared_ptr<trace::TraceCache> cache);
  const std::shared_ptr<trace::TraceCache>& traces() const { return traces_; }
  const trace::ModelRef& model() const { return model_; }
  int64_t seq_len() const { return seq_len_; }

 private:
  trace::ModelRef model_;
  int64_t seq_len_ = 0;
  std::shared_ptr<trace::TraceCache> traces_;
  // layout_key -> its ranks' models. Hashed: asked for each of 10^5 candidates several times, and
  // the keys (the layouts' JSON) share long prefixes that an ordered map compares again and again.
  std::unordered_map<std::string, std::vector<RankModel>> layouts_;
  std::map<std::string, int> trace_ids_;  // trace_key -> RankModel::trace_id
  PipelineWalks walks_;                   // pipeline config -> its ranks' stages and actions
  // Keeps a layout's rank models (made by rank_models): their traces shared, their trace ids.
  const std::vector<RankModel>& keep(const std::string& layout, std::vector<RankModel> ranks);
};

/// `e` as rank `r` of a pipeline sees it: of the model's first e.recompute_blocks blocks, those
/// of its stages (the copy's first ones; -1 stays all).
strategies::StepEffects rank_effects(const strategies::StepEffects& e, const RankModel& r);
/// activation_trace_options(rank_effects(e, r)), without copying `e` (asked for each rank of
/// 10^5 candidates).
trace::TraceOptions rank_activation_options(const strategies::StepEffects& e, const RankModel& r);

/// The trace options of a candidate's activation effects (StepEffects::recompute_blocks: 0 none,
/// -1 all, else the first n blocks, whole or, with selective_recompute, their attention cores;
/// bf16_activations), as the memory and the time model trace it.
trace::TraceOptions activation_trace_options(const strategies::StepEffects& e);

/// A candidate's predicted per-rank memory, bytes.
struct MemoryPrediction {
  int64_t parameters = 0;  // resident parameters (sharded or whole)
  int64_t gradients = 0;   // gradients resident after backward
  int64_t optimizer_state = 0;
  int64_t buffers = 0;  // gathered blocks, gradient buckets
  int64_t activations_peak = 0;
  int64_t peak = 0;  // the step's predicted peak of tracked tensor memory
  /// With a pipeline: each pp rank's peak (the figures above are the rank with the largest), and
  /// the largest rank's in-flight activations beyond the trace's one micro-batch.
  std::vector<int64_t> stage_peaks;
  int64_t in_flight_activations = 0;
  nlohmann::json to_json() const;
};

/// Predicts memory for candidates of one model, caching the traced need per (micro-batch,
/// recomputation, recomputed blocks, bf16 activations).
class MemoryModel {
 public:
  MemoryModel(std::string model_type, nlohmann::json config, int64_t seq_len,
              std::string optimizer = "adamw");
  /// Any model (trace::ModelRef: a user's module is traced whole).
  MemoryModel(trace::ModelRef model, int64_t seq_len, std::string optimizer = "adamw");
  MemoryPrediction predict(const Candidate& c);
  /// predict() of each candidate, in their order. The predictions whose needs expect() made (and
  /// each pipeline rank's timeline over its stages with them) only read what is made, and run on
  /// the configured threads (acc::set_num_threads); the rest follow on this thread, in order, as
  /// predict() makes them, and throw what it throws.
  std::vector<MemoryPrediction> predict_all(const std::vector<const Candidate*>& candidates);
  /// Of predict_all()'s predictions so far, those left to the calling thread (what expect() did
  /// not make for them; bench_plan reports it).
  size_t predictions_left() const { return predictions_left_; }
  /// Tells the model the candidates it will predict: a need first traced for one of the
  /// micro-batches of the candidates running a rank's trace with the same activation options
  /// (batch_pair_key) is then evaluated at all of them from the same traces
  /// (trace::estimate_training_needs: exact, each tensor's bytes are affine in the batch), instead
  /// of traced again for each. Optional: without it each micro-batch is traced on its own.
  /// It also makes those needs (each candidate's own and, with sharded parameters, its blockwise
  /// one) at once, on the configured threads (acc::set_num_threads; a module of the user's on
  /// one): the predictions that follow find them made, the same as they would make them. A layout
  /// the model refuses is left to predict; any other error a trace throws (acc::InternalError,
  /// bad_alloc) is thrown here.
  void expect(const std::vector<Candidate>& candidates);
  /// The traced need of a step of `micro_batch` samples with the candidate's activation options
  /// (and, given an in-flight fraction, its blockwise gradient peak: trace::BlockwiseGradients).
  const trace::TrainingNeed& need(int64_t micro_batch, const strategies::StepEffects& e,
                                  std::optional<double> in_flight_fraction = std::nullopt,
                                  bool accumulated = false);
  int64_t num_blocks();
  /// Needs traced so far (each from a few traces of 1 to 6 blocks; the needs at all of a
  /// batch_pair_key's expected micro-batches, made from one set of trace pairs, count once):
  /// what the predictions so far cost in traces (bench_plan reports it).
  size_t needs_traced() const { return needs_traced_; }
  /// Why the candidate's layout (tensor_parallel, sequence_parallel) cannot run this model, as its
  /// transform says when the model is traced through it ("tensor_parallel: ... has 6 heads, not a
  /// multiple of tp 4"); nullopt when it can (or the candidate has no layout). Checked once per
  /// layout.
  std::optional<std::string> layout_refusal(const Candidate& c);
  /// Its traces kept in `cache` (RankModels::share_traces; by default a cache of its own).
  void share_traces(std::shared_ptr<trace::TraceCache> cache) {
    ranks_->share_traces(std::move(cache));
  }
  const std::shared_ptr<trace::TraceCache>& traces() const { return ranks_->traces(); }
  /// Its rank models (and their traces), for the time model of the same search
  /// (CostModel::share_rank_models).
  const std::shared_ptr<RankModels>& rank_models() const { return ranks_; }

 private:
  // A need and, for a pipeline rank, what its predictions read of it for the rank's stages: its
  // timeline over them and each stage's saved and gradient bytes (made with the need by expect(),
  // else when first asked: every pipeline rank's prediction reads them). The trace key keying
  // it holds the rank's stages, and its activation options the blocks recomputed.
  struct NeedEntry {
    trace::TrainingNeed need;
    bool stage_figures_made = false;
    std::optional<std::vector<trace::StageHighs>> highs{};
    std::vector<int64_t> stage_saved{}, stage_gradients{};
  };
  // (the rank's RankModel::trace_id, micro-batch, the activation options' key_fields(), in-flight
  // fraction (-1: none), accumulated): numbers, not the trace key's string, which a prediction
  // hashed and compared for each rank of 10^5 candidates (a fifth of the warm pricing).
  using NeedKey = std::tuple<int, int64_t, trace::TraceOptions::KeyFields, double, bool>;
  static NeedKey need_key(int trace_id, int64_t micro_batch, const trace::TraceOptions& activations,
                          std::optional<double> in_flight_fraction, bool accumulated);
  // Needs made, not kept yet, and the traces they cost (as needs_traced_ counts).
  struct Made {
    std::vector<std::pair<NeedKey, NeedEntry>> needs;
    size_t traced = 0;
  };
  // The needs of `model` (keyed `layout`) at `batches`, none made yet: with `paired`, those from
  // BatchTraces::kLow up of a registry model from one set of trace pairs
  // (trace::estimate_training_needs), the rest each traced on its own. Reads no member but
  // seq_len_ and optimizer_: expect() runs it on several threads.
  Made make_needs(const trace::ModelRef& model, int trace_id, const std::vector<int64_t>& batches,
                  const trace::TraceOptions& activations, std::optional<double> in_flight_fraction,
                  bool accumulated, bool paired) const;
  void keep(Made made);
  // A pipeline rank's figures of its stages into `entry` (its need's), with the rank's first
  // `recompute_blocks` blocks recomputed (-1: all).
  static void make_stage_figures(NeedEntry& entry, const RankModel& rank, int64_t recompute_blocks);
  // What a prediction that may only read (predict_all's threads) lacks: a need, a pipeline rank's
  // timeline over its stages or the candidate's rank models not made yet.
  struct NotMade {};
  // The prediction of a candidate / of one of its pp ranks. With `made_only` they change nothing
  // (predict_all runs them on several threads) and throw NotMade where they would make something.
  MemoryPrediction predict(const Candidate& c, bool made_only);
  // The need the previous pp rank of a candidate read (its trace id and activation options): the
  // next rank with both the same (a deep pipeline's middle ranks) reads it too, without a lookup
  // (5 % of the warm pricing at GPT-3 175B on 1024 devices). Elements of needs_ stay where they
  // are.
  struct LastNeed {
    RankTraceKey key{-1, {}};
    NeedEntry* entry = nullptr;
  };
  MemoryPrediction predict_rank(const Candidate& c, const RankModel& rank, bool made_only,
                                LastNeed* last);
  // `trace_id` keys the cache: the rank's trace key's, whose model `model` is. Given `batches`
  // holding `micro_batch`, the need is made at each of them at once.
  NeedEntry& need(const trace::ModelRef& model, int trace_id, int64_t micro_batch,
                  const trace::TraceOptions& activations, std::optional<double> in_flight_fraction,
                  bool accumulated, const std::set<int64_t>* batches = nullptr);

  trace::ModelRef model_;
  int64_t seq_len_;
  std::string optimizer_;
  std::shared_ptr<RankModels> ranks_;  // the model as each pp rank of a candidate runs it
  std::unordered_map<std::string, std::optional<std::string>> refusals_;  // by layout key
  std::set<std::string> traced_ranks_;                  // rank trace keys traced without a refusal
  std::map<RankTraceKey, std::set<int64_t>> expected_;  // -> micro-batches expected
  size_t needs_traced_ = 0;
  size_t predictions_left_ = 0;
  // Hashed, as layouts_ is: looked up for each rank of each candidate predicted.
  struct NeedKeyHash {
    size_t operator()(const NeedKey& k) const;
  };
  std::unordered_map<NeedKey, NeedEntry, NeedKeyHash> needs_;
};

}  // namespace acc::search
