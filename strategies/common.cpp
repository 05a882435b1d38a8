// Pieces shared by the data-parallel strategies, the placement helpers, and the local
// (single-rank) gradient synchronisation.

#include <algorithm>
#include <cstring>

#include "acc/trace/passes.hpp"
#include "acc/util/error.hpp"
#include "grad_sync.hpp"

namespace acc::strategies {

void GradSync::sync_accumulated() {
  ACC_THROW(InternalError,
            "this gradient synchronisation cannot reduce gradients accumulated "
            "outside a synchronised backward (a pipeline schedule's)");
}

void broadcast_model_state(nn::Module& model, dist::ProcessGroup& group) {
  std::vector<dist::WorkPtr> works;
  NoGradGuard ng;
  for (auto& [name, t] : model.state_dict()) {
    Tensor x = t;
    works.push_back(group.broadcast(x, 0));
  }
  for (auto& w : works) w->wait();
}

WholePlacement whole_placement(const dist::ParallelContext* ctx) {
  const ShardingSpec spec = ShardingSpec::replicated();
  if (ctx == nullptr) return {spec, 0, 1};
  return {spec, dist::replica_of(spec, ctx->mesh(), ctx->coordinate()),
          dist::replicas_of(spec, ctx->mesh())};
}

WholePlacement flat_placement(const dist::ParallelContext& ctx) {
  const ShardingSpec spec = ShardingSpec::replicated()
                                .with(dist::MeshDim::kDp, dist::Placement::shard_flat())
                                .with(dist::MeshDim::kCp, dist::Placement::shard_flat());
  return {spec, dist::replica_of(spec, ctx.mesh(), ctx.coordinate()),
          dist::replicas_of(spec, ctx.mesh())};
}

void add_whole(PlacementTable& table, const std::string& name, const Shape& shape,
               const Tensor& local, TensorKind kind, const WholePlacement& where) {
  PlacementEntry e =
      dist::whole_entry(name, name, kind, shape, local, where.replica, where.replicas);
  e.dtype = DType::kFloat32;  // a gradient not computed yet has no dtype of its own
  e.spec = where.spec;
  table.push_back(std::move(e));
}

std::vector<OptimPiece> whole_pieces(const nn::Module& model, const WholePlacement& w) {
  std::vector<OptimPiece> out;
  for (const auto& [name, p] : model.named_parameters()) {
    out.push_back({name, p, {0, p.numel()}, w.spec, w.replica, w.replicas});
  }
  return out;
}

void add_whole_params_and_grads(PlacementTable& table, const nn::Module& model,
                                const WholePlacement& where) {
  for (const auto& [name, p] : model.named_parameters()) {
    add_whole(table, name, p.shape(), p, TensorKind::kParameter, where);
    add_whole(table, name, p.shape(), p.grad(), TensorKind::kGradient, where);
  }
}

PlacementTable lift_layouts(PlacementTable table, const ParamLayouts& layouts,
                            const dist::ParallelContext* ctx) {
  if (layouts.empty()) return table;
  PlacementTable out;
  out.reserve(table.size());
  for (PlacementEntry& e : table) {
    auto it = layouts.find(e.param);
    if (it == layouts.end()) {
      out.push_back(std::move(e));
      continue;
    }
    const ParamLayout& layout = it->second;
    ACC_CHECK_AS(InternalError, e.box == Box::whole(e.global_shape), "lift_layouts: '", e.name,
                 "' holds the box ", e.box.to_string(), " of its local tensor, not all of it");
    const FlatRange held = e.flat ? *e.flat : FlatRange{0, numel_of(e.global_shape)};
    const Tensor flat_local = e.local.defined() ? e.local.reshape({-1}) : Tensor();
    ShardingSpec spec = e.spec.with(dist::MeshDim::kTp, dist::Placement::shard(layout.tensor_dim));
    int replica = 0, replicas = 1;
    if (ctx != nullptr) {
      replica = dist::replica_of(spec, ctx->mesh(), ctx->coordinate());
      replicas = dist::replicas_of(spec, ctx->mesh());
    }
    for (const auto& seg : layout.segments) {
      const FlatRange part = intersect(held, FlatRange{seg.local_offset, seg.box.numel()});
      if (part.length == 0) continue;
      PlacementEntry x = e;
      x.global_shape = layout.global_shape;
      x.spec = spec;
      x.box = seg.box;
      x.replica = replica * layout.tp_replicas + layout.tp_replica;
      x.replicas = replicas * layout.tp_replicas;
      const bool whole_box = !e.flat && part.length == seg.box.numel();
      x.flat =
          whole_box
              ? std::nullopt
              : std::optional<FlatRange>(FlatRange{part.offset - seg.local_offset, part.length});
      if (flat_local.defined()) {
        Tensor mine = flat_local.narrow(0, part.offset - held.offset, part.length);
        x.local = whole_box ? mine.view(seg.box.sizes) : mine;
      }
      out.push_back(std::move(x));
    }
  }
  return out;
}

void check_units_config(const nlohmann::json& config, const std::string& method) {
  if (!config.contains("units")) return;
  const nlohmann::json& u = config.at("units");
  ACC_CHECK(u.is_array() && !u.empty(), method,
            ": units must be a non-empty list of module names, got ", u.dump());
  for (const auto& name : u) {
    ACC_CHECK(name.is_string() && !name.get<std::string>().empty(), method,
              ": units must be module names (dotted paths), got ", name.dump());
  }
}

std::vector<std::string> unit_names(const nn::Module& model, const nlohmann::json& config,
                                    const std::string& method) {
  if (!config.is_object() || !config.contains("units")) {
    auto groups = trace::find_blocks(model);
    return groups.empty() ? std::vector<std::string>{} : groups.front().blocks;
  }
  check_units_config(config, method);
  std::vector<std::string> out;
  for (const auto& j : config.at("units")) {
    const std::string name = j.get<std::string>();
    nn::ModulePtr m;
    try {
      m = model.submodule(name);  // its error names the part that is not there, and what is
    } catch (const ValueError& e) {
      ACC_THROW(ValueError, method, ": unit '", name, "' names no module of the model: ", e.what());
    }
    if (dynamic_cast<const nn::ModuleList*>(m.get()) != nullptr) {
      for (const auto& [child, c] : m->named_children()) out.push_back(name + "." + child);
    } else {
      out.push_back(name);
    }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    for (size_t j = 0; j < out.size(); ++j) {
      ACC_CHECK(i == j || (out[i] != out[j] && out[j].rfind(out[i] + ".", 0) != 0), method,
                ": unit '", out[j], "' ",
                out[i] == out[j] ? "is named twice" : "lies inside unit '",
                out[i] == out[j] ? "" : out[i] + "'", " (units must not overlap)");
    }
  }
  return out;
}

BucketLayout::BucketLayout(const NamedTensors& params, int world, int64_t bucket_bytes) {
  ACC_CHECK(bucket_bytes > 0, "bucket size must be > 0 bytes, got ", bucket_bytes);
  Bucket cur;
  auto close = [&] {
    if (cur.slots.empty()) return;
    cur.padded = (cur.numel + world - 1) / world * world;
    cur.flat_offset = total;
    total += cur.padded;
    for (const auto& s : cur.slots) index.emplace_back(s.name, buckets.size());
    buckets.push_back(std::move(cur));
    cur = Bucket();
  };
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const int64_t n = it->second.numel();
    if (!cur.slots.empty() && (cur.numel + n) * 4 > bucket_bytes) close();
    cur.slots.push_back({it->first, it->second, cur.numel});
    cur.numel += n;
  }
  close();
}

size_t BucketLayout::bucket_of(const std::string& name) const {
  for (const auto& [n, b] : index) {
    if (n == name) return b;
  }
  ACC_THROW(InternalError, "bucket layout: no parameter '", name, "'");
}

std::vector<SlotShard> shards_of(const BucketLayout::Bucket& bucket, int world, int rank) {
  const FlatRange chunk = dist::shard_range(bucket.padded, world, rank);
  std::vector<SlotShard> out;
  for (const auto& slot : bucket.slots) {
    const FlatRange in_bucket = dist::intersect(FlatRange{slot.offset, slot.param.numel()}, chunk);
    if (in_bucket.length == 0) continue;
    out.push_back({&slot,
                   {in_bucket.offset - slot.offset, in_bucket.length},
                   in_bucket.offset - chunk.offset});
  }
  return out;
}

void sort_by_model(std::vector<ShardPiece>& pieces, const nn::Module& model) {
  std::vector<ShardPiece> ordered;
  for (const auto& [name, p] : model.named_parameters()) {
    for (ShardPiece& piece : pieces) {
      if (piece.name == name) ordered.push_back(std::move(piece));
    }
  }
  pieces = std::move(ordered);
}

std::vector<OptimPiece> optim_pieces(const std::vector<ShardPiece>& pieces,
                                     const WholePlacement& where) {
  std::vector<OptimPiece> out;
  for (const ShardPiece& p : pieces) {
    out.push_back({p.name, p.leaf, p.range, where.spec, where.replica, where.replicas});
  }
  return out;
}

void add_piece(PlacementTable& table, const ShardPiece& piece, TensorKind kind, const Tensor& local,
               const WholePlacement& where) {
  PlacementEntry e;
  e.name = e.param = piece.name;
  e.kind = kind;
  e.global_shape = piece.shape;
  e.spec = where.spec;
  e.box = Box::whole(piece.shape);
  e.flat = piece.range;
  e.replica = where.replica;
  e.replicas = where.replicas;
  e.local = local;
  table.push_back(std::move(e));
}

void pack_bucket_grads(const BucketLayout::Bucket& bucket, float* dst, float scale,
                       bool drop_grads) {
  for (const auto& slot : bucket.slots) {
    Tensor p = slot.param;
    const int64_t n = p.numel();
    float* out = dst + slot.offset;
    Tensor g = p.grad();
    if (!g.defined()) {
      std::memset(out, 0, static_cast<size_t>(n) * sizeof(float));
    } else {
      Tensor gc = g.contiguous();
      const float* src = gc.data<float>();
      if (scale == 1.0f) {
        std::memcpy(out, src, static_cast<size_t>(n) * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = src[i] * scale;
      }
    }
    if (drop_grads) p.set_grad(Tensor());
  }
  const int64_t tail = bucket.padded - bucket.numel;
  if (tail > 0) std::memset(dst + bucket.numel, 0, static_cast<size_t>(tail) * sizeof(float));
}

void repoint(Tensor& param, const std::shared_ptr<Storage>& storage, int64_t offset) {
  TensorImpl* impl = param.impl();
  impl->storage = storage;
  impl->offset = offset;
  impl->strides = contiguous_strides(impl->shape);
}

void repoint_to_own(Tensor& param, const Tensor& values) {
  NoGradGuard ng;
  ACC_CHECK(values.numel() == param.numel(), "repoint: ", values.numel(),
            " values for a parameter of shape ", to_string(param.shape()));
  Tensor own = values.reshape(param.shape()).clone();
  repoint(param, own.storage(), own.offset());
}

Tensor piece_of(const Tensor& base, int64_t start, int64_t n) {
  Tensor p = make_view(base, {n}, {1}, base.offset() + start);
  p.set_requires_grad(true);
  return p;
}

void ParamHooks::add(Tensor param, std::function<void(Tensor&)> fn) {
  const int id = param.register_post_accumulate_grad_hook(std::move(fn));
  hooks_.emplace_back(std::move(param), id);
}

void ParamHooks::remove_all() {
  for (auto& [p, id] : hooks_) p.remove_post_accumulate_grad_hook(id);
  hooks_.clear();
}

namespace {

// One rank, nothing to synchronise.
class Local : public GradSync {
 public:
  Local(nn::Module& m, const dist::ParallelContext* ctx)
      : model_(m), where_(whole_placement(ctx)) {}
  ~Local() override { model_.zero_grad(); }
  void sync_accumulated() override { set_sync(true); }
  std::vector<OptimPiece> optimizer_pieces() override { return whole_pieces(model_, where_); }
  void add_placements(PlacementTable& table) const override {
    add_whole_params_and_grads(table, model_, where_);
  }

 private:
  nn::Module& model_;
  WholePlacement where_;
};

}  // namespace

std::unique_ptr<GradSync> make_local(nn::Module& model, const dist::ParallelContext* ctx) {
  return std::make_unique<Local>(model, ctx);
}

}  // namespace acc::strategies
