#pragma once
// What the estimates, the cost model and the search trace: a model of the registry by type and
// config, or a user's own module with a sample batch and its loss.
//
//  - registry("gpt", config): meta copies cut to any number of blocks (models::create_meta_model),
//    so a model of any depth is priced from traces of 1 and 2 blocks in milliseconds;
//  - module(m, sample, loss): the user's module itself, traced in place and whole (the tracer
//    swaps its storages for meta ones for the trace: no memory, values untouched), on inputs
//    shaped like the sample batch with dimension 0 resized to the micro-batch, through the loss.
//    Its "blocks" are its repeated blocks (find_blocks), none when it has none.
//
// hash() names what the model computes (the strategy cache's and checkpoints' model key):
// model_trace_hash(type, config) for the registry; for a module, FNV-1a 64 of its class, its
// parameter shapes, the sample's per-sample shapes and dtypes and the trace of one sample.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "acc/data/batch.hpp"
#include "acc/nn/module.hpp"
#include "acc/trace/passes.hpp"
#include "acc/trace/tracer.hpp"

namespace acc::trace {

/// A micro-batch -> its mean loss (strategies::LossFn has the same type).
using BatchLoss = std::function<Tensor(nn::Module&, const data::Batch&)>;

/// Traces `module` on meta inputs shaped like `sample`'s tensors (dimension 0 resized to `batch`
/// samples; 0 keeps the sample's), through `loss` given them as a Batch under the sample's names:
/// what a module's ModelRef traces, and what a strategy that finds patterns in a user's module
/// traces. Throws what the module and the loss throw.
Trace trace_on_batch(nn::Module& module, const data::Batch& sample, const BatchLoss& loss,
                     int64_t batch = 0, const TraceOptions& options = {});

/// `options` as they trace a model of `layers` blocks, in one form for all that trace alike:
/// without recomputation the recomputed blocks' count is not read (0), recomputing none of the
/// blocks is not recomputing, and recomputing at least as many blocks as the model has is
/// recomputing them all (-1; the tracer's BlockWrappers). TraceCache's keys are made of it.
TraceOptions traced_alike(const TraceOptions& options, int64_t layers);

class TraceCache;
struct TraceFigures;  // what trace/estimate.cpp reads of a trace (defined there)

/// What one reader keeps of a trace in place of the trace: a compact form of what it reads (the
/// time model's ops: search/ops_digest.hpp). The reader derives its own type from this one.
struct TraceDigest {
  virtual ~TraceDigest() = default;
};
/// Makes the digest of a trace (a reader's own function; it must not throw for a trace it is
/// given).
using DigestMaker = std::function<std::shared_ptr<const TraceDigest>(const Trace&)>;

class ModelRef {
 public:
  /// A language model of the registry. Throws what models::create_meta_model throws for a bad
  /// type or config.
  static ModelRef registry(std::string type, nlohmann::json config);
  /// The user's module, traced on batches shaped like `sample` through `loss`. The module is held
  /// (shared) and must not be trained while a trace runs. Throws acc::ValueError for a null module,
  /// an empty or inconsistent sample (Batch::size()), or an empty loss.
  static ModelRef module(nn::ModulePtr module, data::Batch sample, BatchLoss loss);

  bool is_registry() const;
  /// "gpt" | "llama" | the module's type_name().
  const std::string& type() const;
  /// The registry config; for a module {"parameters": {name: shape}, "inputs": {name: {"shape":
  /// per-sample shape, "dtype"}}}: what the strategy cache compares field by field.
  const nlohmann::json& config() const;
  /// Blocks of the full model: the config's layer count; a module's repeated blocks (0: none).
  int64_t num_layers() const;
  /// "n_layer" | "num_hidden_layers" | "blocks".
  std::string layers_key() const;
  /// The longest sequence a registry model takes; 0 for a module (its sample fixes the shapes).
  int64_t max_seq_len() const;
  /// Whether traces of a few blocks stand for the whole model (registry only); a module is traced
  /// whole.
  bool extrapolates() const { return is_registry(); }
  /// Whether the model's blocks hold attention cores (nn::AttentionCoreHooks) that selective
  /// recomputation can recompute: a registry model (the zoo's transformers) always; a module when
  /// one of its submodules is an attention of nn's.
  bool has_attention() const;
  /// The samples per batch of the module's sample (0 for the registry).
  int64_t sample_size() const;

  /// The same registry model at `layers` blocks (the config's layer count replaced; a pipeline
  /// rank's share of the blocks), without building it again. Throws acc::ValueError for a module
  /// or layers < 1.
  ModelRef at_depth(int64_t layers) const;

  /// Rewrites the model before each of its traces as one rank of a parallel layout runs it (the
  /// search's tensor- and sequence-parallel candidates: strategies::layout_rewrite): given the
  /// model about to be traced (a registry model's meta copy, a module itself), the batch it is
  /// traced on and its loss, transforms the model and returns the undo and the loss to trace
  /// through. The undo runs after the trace, also when it throws.
  using Rewrite = std::function<std::pair<nn::Undo, BatchLoss>(nn::Module&, const data::Batch&,
                                                               const BatchLoss&)>;
  /// This model traced through `rewrite` (none: as it is). hash() and the facts above stay this
  /// model's: the rewrite is how a candidate runs it, not another model.
  /// Its traces are no longer shared (shared_traces): it traces otherwise.
  ModelRef rewritten(Rewrite rewrite) const;

  /// This model with its traces kept in `cache` under `identity`: a trace asked again, by this
  /// model or by another given the same cache and identity, is the one made first (traced()
  /// hands it out; trace() copies it).
  /// The caller vouches that every model it gives one identity traces the same ops, shapes and
  /// bytes at the same (layers, batch, seq_len, options) — what every estimate reads; what none
  /// reads may differ (a pipeline message's peer and tag). The search gives the pp ranks of
  /// pipelines of every depth that run alike one identity (search::RankModel::shape_key). Null
  /// `cache`: traced each time.
  ModelRef shared_traces(std::shared_ptr<TraceCache> cache, std::string identity) const;

  struct Traced {
    Trace trace;
    std::vector<BlockGroup> blocks;  // find_blocks of the traced model
  };
  /// A step on a micro-batch of `batch` samples (registry: of seq_len tokens, 0 the maximum;
  /// ignored for a module) at `layers` blocks (registry; a module is traced whole: layers must be
  /// num_layers()). Throws what the model throws, acc::ValueError for batch < 1.
  Traced trace(int64_t layers, int64_t batch, int64_t seq_len, const TraceOptions& options) const;
  /// The same, shared: with shared_traces, the cache's own trace (no copy; its options are those
  /// it was first traced with, which trace alike), else a new one.
  std::shared_ptr<const Traced> traced(int64_t layers, int64_t batch, int64_t seq_len,
                                       const TraceOptions& options) const;
  /// Figures derived from the trace at (layers, batch, seq_len, options) under `what` (what else
  /// they depend on): with shared_traces, kept in the cache beside the trace (`make` runs once
  /// per key), else made each time. `make` derives them however it likes (from traced(), or from
  /// a BatchTraces at `batch`): they must be those of that trace. For trace/estimate.cpp.
  std::shared_ptr<const TraceFigures> figures(
      int64_t layers, int64_t batch, int64_t seq_len, const TraceOptions& options,
      const std::string& what,
      const std::function<std::shared_ptr<const TraceFigures>()>& make) const;
  /// The digest of the trace at (layers, batch, seq_len, options): with shared_traces into a
  /// cache that digests its traces (TraceCache's `digest`), the one it kept, else made (and kept)
  /// with its trace; otherwise `make` of traced(). `make` must be the cache's maker when it has
  /// one. Throws what traced() throws (a refusal kept is thrown again).
  std::shared_ptr<const TraceDigest> digest(int64_t layers, int64_t batch, int64_t seq_len,
                                            const TraceOptions& options,
                                            const DigestMaker& make) const;
  /// Whether the step at one sample has the structure of the same step at BatchTraces::kLow
  /// samples at 2 blocks under `options` (at one sample a transpose can leave a tensor contiguous,
  /// and the copy every larger batch makes is not made), as note_one_sample_like_pair noted it;
  /// nullopt when not noted, or without shared_traces. estimate_training_needs notes it while it
  /// holds both traces, and then takes a deeper trace at one sample from its pair
  /// (BatchTraces::at_one) instead of tracing it.
  std::optional<bool> one_sample_like_pair(int64_t seq_len, const TraceOptions& options) const;
  void note_one_sample_like_pair(int64_t seq_len, const TraceOptions& options, bool like) const;
  /// 16 hex digits (see the top of this file). Equal on every rank for the same model and sample
  /// shapes.
  std::string hash() const;

 private:
  Traced trace_uncached(int64_t layers, int64_t batch, int64_t seq_len,
                        const TraceOptions& options) const;
  Traced trace_as_is(int64_t layers, int64_t batch, int64_t seq_len,
                     const TraceOptions& options) const;

  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

/// The traces of the ModelRefs given it (ModelRef::shared_traces), each kept once per (identity,
/// layers, batch, seq_len, options). A trace the model refuses (the acc::ValueError, ShapeError or
/// TypeError of a layout that cannot be made: heads that tp does not divide, ...) is kept as
/// refused: asked again, the same error is thrown without tracing again. Its lookups lock a
/// mutex and a trace is made outside the lock (two threads asking for one key at once may both
/// trace it; the first kept wins): a registry model's traces may be asked from several threads,
/// a module's not (its traces run on the module itself). Its traces live as long as it does: a
/// search keeps one per model it prices, and the models given one must be one model (the first
/// fixes it: type and config).
class TraceCache {
 public:
  /// Keeps every trace it is given to make.
  TraceCache() = default;
  /// Keeps the traces of at most `kept_blocks` blocks (>= 0); a deeper one is made each time it
  /// is asked and dropped when its asker is done with it (its refusal, and the figures made from
  /// it, are kept). The search keeps those of 1 and 2 blocks, which its time model reads again
  /// for every mesh, and drops the memory estimator's deeper ones, read once per set of figures:
  /// keeping them held 1.4 of 3.6 GB at GPT-3 175B on 1024 devices, and the page faults of that
  /// memory cost more than the 8 % of them made again (a blockwise figure of a trace whose
  /// plain figures were made). Throws acc::ValueError for kept_blocks < 0.
  explicit TraceCache(int64_t kept_blocks);
  /// The same, but a trace of at most `kept_blocks` blocks is kept as its digest (`digest` of it,
  /// made when the trace is made) instead of itself: asked again, the trace is made again; its
  /// digest is served (ModelRef::digest). The search's: its time model reads the traces of 1
  /// and 2 blocks again for every mesh, and only their ops (search/ops_digest.hpp) — at GPT-3
  /// 175B on 1024 devices, keeping the traces themselves held 1.1 of 1.8 GB, and faulting that
  /// memory in cost more than making a trace again where the memory model asks one twice. Throws
  /// acc::ValueError for kept_blocks < 0 or an empty `digest`.
  TraceCache(int64_t kept_blocks, DigestMaker digest);
  /// Traces made for it (kept or not), refusals kept, and asks answered with one made before.
  size_t traced() const;
  /// Of traced(), those made but not kept (deeper than kept_blocks, or kept as their digests).
  size_t dropped() const;
  size_t refused() const;
  size_t served() const;
  /// Figures derived from its traces (ModelRef::figures) made, and asks answered with them.
  size_t figures_made() const;
  size_t figures_served() const;
  /// Digests kept (the constructor's `digest`), and asks answered with one made before.
  size_t digests_made() const;
  size_t digests_served() const;

 private:
  friend class ModelRef;
  // (identity, layers, batch, seq_len, TraceOptions::key_fields() normalised).
  using Key = std::tuple<std::string, int64_t, int64_t, int64_t, TraceOptions::KeyFields>;
  // What was made under a key: the value, or the refusal to rethrow.
  template <class T>
  struct Kept {
    using value_type = T;
    T value;
    std::exception_ptr refusal;
  };
  // What is kept under `key`, else made by `make` and kept (a value only with `keep`; a refusal
  // always).
  template <class Map, class Make>
  typename Map::mapped_type::value_type kept(Map& map, size_t& served, typename Map::key_type key,
                                             const Make& make, bool keep = true);
  mutable std::mutex mutex_;
  int64_t kept_blocks_ = std::numeric_limits<int64_t>::max();
  size_t dropped_ = 0;
  std::string model_;  // the type and config (but its depth) of the model whose traces it keeps
  std::map<Key, Kept<std::shared_ptr<const ModelRef::Traced>>> traces_;
  size_t served_ = 0;
  std::map<std::pair<Key, std::string>, Kept<std::shared_ptr<const TraceFigures>>> figures_;
  size_t figures_served_ = 0;
  DigestMaker digest_;
  std::map<Key, std::shared_ptr<const TraceDigest>> digests_;
  size_t digests_served_ = 0;
  std::map<Key, bool> one_sample_like_pair_;  // at 2 blocks and 1 sample (ModelRef's)
  // The key of a trace of `ref` (options that trace alike share one).
  static Key key_of(const std::string& identity, int64_t layers, int64_t batch, int64_t seq_len,
                    const TraceOptions& options);
};

}  // namespace acc::trace
