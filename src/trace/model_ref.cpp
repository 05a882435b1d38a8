#include "acc/trace/model_ref.hpp"

#include <optional>

#include "acc/nn/transformer.hpp"

#include "acc/models/language_model.hpp"
#include "acc/trace/dump.hpp"
#include "acc/trace/estimate.hpp"
#include "acc/util/error.hpp"
#include "acc/util/hash.hpp"

namespace acc::trace {

struct ModelRef::Impl {
  std::string type;
  nlohmann::json config;
  // The registry's only.
  int64_t num_layers = 0;
  int64_t max_seq_len = 0;
  // The module's only.
  nn::ModulePtr module;
  data::Batch sample;
  BatchLoss loss;
  // How a candidate's rank runs the model (ModelRef::rewritten), if set.
  Rewrite rewrite;
  // Where its traces are kept, and under what (ModelRef::shared_traces), if set.
  std::shared_ptr<TraceCache> cache;
  std::string cache_identity;
};

ModelRef ModelRef::registry(std::string type, nlohmann::json config) {
  auto impl = std::make_shared<Impl>();
  impl->num_layers = models::config_num_layers(type, config);
  impl->max_seq_len = models::create_meta_model(type, config, 1)->max_seq_len();
  impl->type = std::move(type);
  impl->config = std::move(config);
  ModelRef r;
  r.impl_ = std::move(impl);
  return r;
}

ModelRef ModelRef::module(nn::ModulePtr module, data::Batch sample, BatchLoss loss) {
  ACC_CHECK(module != nullptr, "ModelRef::module: the module is null");
  ACC_CHECK(static_cast<bool>(loss), "ModelRef::module: the loss function is empty");
  const int64_t n = sample.size();  // throws for an empty or inconsistent batch
  ACC_CHECK(n >= 1, "ModelRef::module: the sample batch has no samples (", sample.describe(), ")");
  auto impl = std::make_shared<Impl>();
  impl->type = module->type_name();
  nlohmann::json params = nlohmann::json::object();
  for (const auto& [name, p] : module->named_parameters()) params[name] = p.shape();
  nlohmann::json inputs = nlohmann::json::object();
  for (const auto& [name, t] : sample.tensors()) {
    Shape per_sample(t.shape().begin() + 1, t.shape().end());
    inputs[name] = {{"shape", per_sample}, {"dtype", dtype_name(t.dtype())}};
  }
  impl->config = {{"parameters", params}, {"inputs", inputs}};
  const auto groups = find_blocks(*module);
  impl->num_layers = groups.empty() ? 0 : static_cast<int64_t>(groups.front().blocks.size());
  impl->module = std::move(module);
  impl->sample = std::move(sample);
  impl->loss = std::move(loss);
  ModelRef r;
  r.impl_ = std::move(impl);
  return r;
}

bool ModelRef::is_registry() const {
  return impl_->module == nullptr;
}

bool ModelRef::has_attention() const {
  if (is_registry()) return true;
  for (const auto& [name, m] : impl_->module->named_modules()) {
    if (dynamic_cast<const nn::AttentionCoreHooks*>(m.get()) != nullptr) return true;
  }
  return false;
}
const std::string& ModelRef::type() const {
  return impl_->type;
}
const nlohmann::json& ModelRef::config() const {
  return impl_->config;
}
int64_t ModelRef::num_layers() const {
  return impl_->num_layers;
}
int64_t ModelRef::max_seq_len() const {
  return impl_->max_seq_len;
}
int64_t ModelRef::sample_size() const {
  return is_registry() ? 0 : impl_->sample.size();
}

std::string ModelRef::layers_key() const {
  return is_registry() ? models::config_num_layers_key(impl_->type) : "blocks";
}

Trace trace_on_batch(nn::Module& module, const data::Batch& sample, const BatchLoss& loss,
                     int64_t batch, const TraceOptions& options) {
  std::vector<std::string> names;
  std::vector<Tensor> inputs;
  for (const auto& [name, t] : sample.tensors()) {
    Shape shape = t.shape();
    if (batch > 0) shape[0] = batch;
    names.push_back(name);
    inputs.push_back(empty(shape, {t.dtype(), Device::kMeta}));
  }
  const LossFn run = [&](nn::Module& m, const std::vector<Tensor>& in) {
    std::vector<data::Batch::Entry> entries;
    for (size_t i = 0; i < in.size(); ++i) entries.emplace_back(names[i], in[i]);
    return loss(m, data::Batch(std::move(entries)));
  };
  return trace(module, run, inputs, options);
}

ModelRef ModelRef::at_depth(int64_t layers) const {
  ACC_CHECK(is_registry(), "ModelRef::at_depth: the model (", impl_->type,
            ") is a module of the user's, traced whole");
  ACC_CHECK(layers >= 1, "ModelRef::at_depth: the layer count must be >= 1, got ", layers);
  auto impl = std::make_shared<Impl>(*impl_);
  impl->config[layers_key()] = layers;
  impl->num_layers = models::config_num_layers(impl->type, impl->config);  // checked as registry()
  ModelRef r;
  r.impl_ = std::move(impl);
  return r;
}

ModelRef ModelRef::rewritten(Rewrite rewrite) const {
  auto impl = std::make_shared<Impl>(*impl_);
  impl->rewrite = std::move(rewrite);
  // Traced otherwise now: not under the identity it was given.
  impl->cache.reset();
  impl->cache_identity.clear();
  ModelRef r;
  r.impl_ = std::move(impl);
  return r;
}

namespace {

// Traces `model` on `sample` (resized to `batch` samples, 0: as it is) through `loss`, rewritten
// first when a rewrite is given (undone after, also when the trace throws). A `throwaway` model (a
// registry model's meta copy, dropped after its trace) is rewritten in place and never undone:
// the undo (gathering tensor-parallel shards back into whole meta weights) was a twentieth of a
// plan-only search, and nothing outside the copy and its rewrite's own plan is changed.
ModelRef::Traced trace_rewritten(nn::Module& model, const data::Batch& sample,
                                 const BatchLoss& loss, int64_t batch, const TraceOptions& options,
                                 const ModelRef::Rewrite& rewrite, bool throwaway = false) {
  // The rewrite cuts its shards from meta weights (a module's own values untouched, no memory):
  // its undo gathers them back into those, and then the real storages return (the guards go in
  // that order). A throwaway copy, meta already, is neither swapped nor undone.
  std::optional<MetaStorageGuard> meta_weights;
  nn::Undo undo;
  struct UndoGuard {
    nn::Undo& undo;
    ~UndoGuard() {
      if (undo) undo();
    }
  } guard{undo};
  BatchLoss traced_loss = loss;
  if (rewrite) {
    if (!throwaway) meta_weights.emplace(model);
    auto [rewrite_undo, rewritten_loss] = rewrite(model, sample, loss);
    if (!throwaway) undo = std::move(rewrite_undo);
    traced_loss = std::move(rewritten_loss);
  }
  ModelRef::Traced out;
  out.trace = trace_on_batch(model, sample, traced_loss, batch, options);
  out.blocks = find_blocks(model);  // with a rewrite, the rank's blocks: their shards
  return out;
}

}  // namespace

// What `map` keeps under `key` (an ask answered: `served` counted), else what `make` gives, kept;
// a refusal of the model's (a ValueError, ShapeError or TypeError: the same every time) is kept
// too and thrown again. Made unlocked (a trace takes milliseconds); a race makes it twice and
// keeps the first.
template <class Map, class Make>
typename Map::mapped_type::value_type TraceCache::kept(Map& map, size_t& served,
                                                       typename Map::key_type key, const Make& make,
                                                       bool keep) {
  auto give = [](const typename Map::mapped_type& k) {
    if (k.refusal) std::rethrow_exception(k.refusal);
    return k.value;
  };
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = map.find(key); it != map.end()) {
      ++served;
      return give(it->second);
    }
  }
  typename Map::mapped_type made;
  try {
    made.value = make();
  } catch (const ValueError&) {
    made.refusal = std::current_exception();
  } catch (const ShapeError&) {
    made.refusal = std::current_exception();
  } catch (const TypeError&) {
    made.refusal = std::current_exception();
  }
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!keep && !made.refusal) {
    ++dropped_;
    return made.value;
  }
  return give(map.emplace(std::move(key), std::move(made)).first->second);
}

TraceCache::TraceCache(int64_t kept_blocks) : kept_blocks_(kept_blocks) {
  ACC_CHECK(kept_blocks >= 0, "TraceCache: kept_blocks must be >= 0, got ", kept_blocks);
}

TraceCache::TraceCache(int64_t kept_blocks, DigestMaker digest)
    : kept_blocks_(kept_blocks), digest_(std::move(digest)) {
  ACC_CHECK(kept_blocks >= 0, "TraceCache: kept_blocks must be >= 0, got ", kept_blocks);
  ACC_CHECK(static_cast<bool>(digest_), "TraceCache: an empty digest maker");
}

ModelRef ModelRef::shared_traces(std::shared_ptr<TraceCache> cache, std::string identity) const {
  if (cache) {
    // One cache, one model: the identities of two models' ranks could be equal.
    // The depth aside: a trace's depth is in its key (a pipeline rank's model holds its blocks).
    nlohmann::json config = impl_->config;
    if (is_registry()) config.erase(layers_key());
    const std::string model = impl_->type + " " + config.dump();
    const std::lock_guard<std::mutex> lock(cache->mutex_);
    if (cache->model_.empty()) cache->model_ = model;
    // An InternalError, not a ValueError: the search reads a ValueError as a layout refused.
    ACC_CHECK_INTERNAL(cache->model_ == model,
                       "shared_traces: this trace cache keeps the traces of another model (",
                       cache->model_.substr(0, 120), "), not of ", model.substr(0, 120));
  }
  auto impl = std::make_shared<Impl>(*impl_);
  impl->cache = std::move(cache);
  impl->cache_identity = std::move(identity);
  ModelRef r;
  r.impl_ = std::move(impl);
  return r;
}

ModelRef::Traced ModelRef::trace(int64_t layers, int64_t batch, int64_t seq_len,
                                 const TraceOptions& options) const {
  ACC_CHECK(batch >= 1, "trace: the batch must have >= 1 sample, got ", batch);
  if (!impl_->cache) return trace_uncached(layers, batch, seq_len, options);
  Traced t = *traced(layers, batch, seq_len, options);
  t.trace.options = options;  // as asked (the dump shows them)
  return t;
}

std::shared_ptr<const ModelRef::Traced> ModelRef::traced(int64_t layers, int64_t batch,
                                                         int64_t seq_len,
                                                         const TraceOptions& options) const {
  ACC_CHECK(batch >= 1, "trace: the batch must have >= 1 sample, got ", batch);
  TraceCache* cache = impl_->cache.get();
  if (cache == nullptr) {
    return std::make_shared<const Traced>(trace_uncached(layers, batch, seq_len, options));
  }
  const bool digested = cache->digest_ && layers <= cache->kept_blocks_;
  TraceCache::Key key = TraceCache::key_of(impl_->cache_identity, layers, batch, seq_len, options);
  return cache->kept(
      cache->traces_, cache->served_, key,
      [&] {
        auto t = std::make_shared<const Traced>(trace_uncached(layers, batch, seq_len, options));
        if (digested) {
          {
            const std::lock_guard<std::mutex> lock(cache->mutex_);
            if (cache->digests_.count(key) != 0) return t;  // made again, digested before
          }
          auto d = cache->digest_(t->trace);
          ACC_CHECK_INTERNAL(d != nullptr, "TraceCache: the digest maker gave no digest");
          const std::lock_guard<std::mutex> lock(cache->mutex_);
          cache->digests_.try_emplace(key, std::move(d));  // a race: the first kept
        }
        return t;
      },
      layers <= cache->kept_blocks_ && !digested);
}

std::shared_ptr<const TraceDigest> ModelRef::digest(int64_t layers, int64_t batch, int64_t seq_len,
                                                    const TraceOptions& options,
                                                    const DigestMaker& make) const {
  TraceCache* cache = impl_->cache.get();
  if (cache == nullptr || !cache->digest_ || layers > cache->kept_blocks_) {
    auto d = make(traced(layers, batch, seq_len, options)->trace);
    ACC_CHECK_INTERNAL(d != nullptr, "ModelRef::digest: the digest maker gave no digest");
    return d;
  }
  const TraceCache::Key key =
      TraceCache::key_of(impl_->cache_identity, layers, batch, seq_len, options);
  // The kept digest, if any; `served`: an ask answered with one made before.
  auto find = [&](bool served) -> std::shared_ptr<const TraceDigest> {
    const std::lock_guard<std::mutex> lock(cache->mutex_);
    auto it = cache->digests_.find(key);
    if (it == cache->digests_.end()) return nullptr;
    if (served) ++cache->digests_served_;
    return it->second;
  };
  if (auto d = find(true)) return d;
  (void)traced(layers, batch, seq_len, options);  // digests it (or throws the model's refusal)
  auto d = find(false);
  ACC_CHECK_INTERNAL(d != nullptr, "ModelRef::digest: a trace of ", layers, " blocks at batch ",
                     batch, " was made but not digested");
  return d;
}

std::shared_ptr<const TraceFigures> ModelRef::figures(
    int64_t layers, int64_t batch, int64_t seq_len, const TraceOptions& options,
    const std::string& what,
    const std::function<std::shared_ptr<const TraceFigures>()>& make) const {
  TraceCache* cache = impl_->cache.get();
  if (cache == nullptr) return make();
  return cache->kept(
      cache->figures_, cache->figures_served_,
      std::pair{TraceCache::key_of(impl_->cache_identity, layers, batch, seq_len, options), what},
      make);
}

std::optional<bool> ModelRef::one_sample_like_pair(int64_t seq_len,
                                                   const TraceOptions& options) const {
  TraceCache* cache = impl_->cache.get();
  if (cache == nullptr) return std::nullopt;
  const TraceCache::Key key = TraceCache::key_of(impl_->cache_identity, 2, 1, seq_len, options);
  const std::lock_guard<std::mutex> lock(cache->mutex_);
  const auto it = cache->one_sample_like_pair_.find(key);
  if (it == cache->one_sample_like_pair_.end()) return std::nullopt;
  return it->second;
}

void ModelRef::note_one_sample_like_pair(int64_t seq_len, const TraceOptions& options,
                                         bool like) const {
  TraceCache* cache = impl_->cache.get();
  if (cache == nullptr) return;
  const TraceCache::Key key = TraceCache::key_of(impl_->cache_identity, 2, 1, seq_len, options);
  const std::lock_guard<std::mutex> lock(cache->mutex_);
  cache->one_sample_like_pair_.try_emplace(key, like);
}

TraceOptions traced_alike(const TraceOptions& options, int64_t layers) {
  TraceOptions o = options;
  if (o.recompute != Recompute::kNone && o.recompute_blocks == 0) o.recompute = Recompute::kNone;
  o.recompute_blocks = o.recompute == Recompute::kNone ? 0
                       : o.recompute_blocks < 0 || o.recompute_blocks >= layers
                           ? -1
                           : o.recompute_blocks;
  return o;
}

TraceCache::Key TraceCache::key_of(const std::string& identity, int64_t layers, int64_t batch,
                                   int64_t seq_len, const TraceOptions& options) {
  // Options that trace alike share a key.
  return {identity, layers, batch, seq_len, traced_alike(options, layers).key_fields()};
}

namespace {

// How many of `map`'s entries are refusals (`refusals`) or values (else).
template <class Map>
size_t count_kept(const Map& map, bool refusals) {
  size_t n = 0;
  for (const auto& [key, k] : map) n += static_cast<bool>(k.refusal) == refusals ? 1 : 0;
  return n;
}

}  // namespace

size_t TraceCache::figures_made() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return count_kept(figures_, false);
}

size_t TraceCache::figures_served() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return figures_served_;
}

size_t TraceCache::digests_made() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return digests_.size();
}

size_t TraceCache::digests_served() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return digests_served_;
}

size_t TraceCache::traced() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return count_kept(traces_, false) + dropped_;
}

size_t TraceCache::dropped() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return dropped_;
}

size_t TraceCache::refused() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return count_kept(traces_, true);
}

size_t TraceCache::served() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return served_;
}

ModelRef::Traced ModelRef::trace_uncached(int64_t layers, int64_t batch, int64_t seq_len,
                                          const TraceOptions& options) const {
  if (!impl_->rewrite) return trace_as_is(layers, batch, seq_len, options);
  DefaultDeviceGuard meta(Device::kMeta);  // what the forward creates is meta too
  if (is_registry()) {
    auto model = models::create_meta_model(impl_->type, impl_->config, layers);
    const int64_t T = seq_len > 0 ? seq_len : model->max_seq_len();
    const Tensor idx = empty({batch, T}, {DType::kInt64, Device::kMeta});
    const BatchLoss next_token = [](nn::Module& m, const data::Batch& b) {
      return dynamic_cast<models::LanguageModel&>(m).loss(b.idx(), b.targets());
    };
    return trace_rewritten(*model, data::Batch(idx, idx), next_token, 0, options, impl_->rewrite,
                           /*throwaway=*/true);
  }
  ACC_CHECK(layers == impl_->num_layers, "trace: a module is traced whole (", impl_->num_layers,
            " repeated block(s)), not at ", layers);
  return trace_rewritten(*impl_->module, impl_->sample, impl_->loss, batch, options,
                         impl_->rewrite);
}

ModelRef::Traced ModelRef::trace_as_is(int64_t layers, int64_t batch, int64_t seq_len,
                                       const TraceOptions& options) const {
  ACC_CHECK(batch >= 1, "trace: the batch must have >= 1 sample, got ", batch);
  DefaultDeviceGuard meta(Device::kMeta);  // what the forward creates is meta too
  Traced out;
  if (is_registry()) {
    auto model = models::create_meta_model(impl_->type, impl_->config, layers);
    const int64_t T = seq_len > 0 ? seq_len : model->max_seq_len();
    const Tensor idx = empty({batch, T}, {DType::kInt64, Device::kMeta});
    out.trace = ::acc::trace::trace(*model, {idx, idx}, options);
    out.blocks = find_blocks(*model);
    return out;
  }
  ACC_CHECK(layers == impl_->num_layers, "trace: a module is traced whole (", impl_->num_layers,
            " repeated block(s)), not at ", layers);
  return trace_rewritten(*impl_->module, impl_->sample, impl_->loss, batch, options, {});
}

std::string ModelRef::hash() const {
  if (is_registry()) return model_trace_hash(impl_->type, impl_->config);
  const nlohmann::json facts = {{"model_type", impl_->type},
                                {"config", impl_->config},
                                {"trace", to_json(trace_as_is(impl_->num_layers, 1, 0, {}).trace)}};
  return fnv1a64_hex(facts.dump());
}

}  // namespace acc::trace
