#include "tp_transform.hpp"

#include <algorithm>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "acc/dist/functional.hpp"
#include "acc/nn/head_split.hpp"
#include "acc/nn/recompute.hpp"
#include "acc/nn/transformer.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/error.hpp"
#include "tp_layers.hpp"

namespace acc::strategies {
namespace {

// One linear to replace: where, the whole module, and each rank's blocks (rows for a column-
// parallel layer, columns for a row-parallel one): every rank's, so the undo can put the gathered
// shards back where they came from.
struct Shard {
  std::string path;
  std::shared_ptr<nn::Linear> whole;
  bool column = true;
  std::vector<std::vector<nn::RowBlock>> blocks;  // [rank] -> blocks
  int sharers = 1;  // ranks holding the same blocks (kv heads fewer than ranks)
};

std::shared_ptr<nn::Linear> linear_at(nn::Module& model, const std::string& path) {
  auto lin = std::dynamic_pointer_cast<nn::Linear>(model.submodule(path));
  ACC_CHECK(lin != nullptr, "tensor_parallel: '", path, "' is a ",
            model.submodule(path)->type_name(), ", not a Linear");
  return lin;
}

int64_t head_dim_of(nn::Module& model, const std::string& scope) {
  const nn::ModulePtr m = model.submodule(scope);
  if (auto* a = dynamic_cast<nn::AttentionCoreHooks*>(m.get())) return a->head_dim();
  ACC_THROW(ValueError, "tensor_parallel: the attention '", scope, "' is a ", m->type_name(),
            ", whose head size is unknown (nn::CausalSelfAttention and nn::LlamaAttention are "
            "sharded)");
}

void add_attention(nn::Module& model, const trace::AttentionPattern& p, int tp,
                   std::vector<Shard>& out) {
  const int64_t hs = head_dim_of(model, p.scope);
  if (p.qkv.size() == 1) {  // fused q|k|v (GPT's c_attn)
    auto qkv = linear_at(model, p.qkv[0]);
    const int64_t width = qkv->out_features();
    ACC_CHECK(width % (3 * hs) == 0, "tensor_parallel: '", p.qkv[0], "' has ", width,
              " outputs, not 3 x a multiple of the head size ", hs);
    const int64_t heads = width / (3 * hs);
    ACC_CHECK(heads % tp == 0, "tensor_parallel: '", p.scope, "' has ", heads,
              " heads, not a multiple of tp ", tp);
    Shard s{p.qkv[0], qkv, true, {}}, o{p.proj, linear_at(model, p.proj), false, {}};
    for (int r = 0; r < tp; ++r) {
      const auto rows = nn::fused_qkv_rows(heads, hs, tp, r);
      s.blocks.emplace_back(rows.begin(), rows.end());
      o.blocks.push_back({rows[0]});  // the q heads' rows are c_proj's columns
    }
    out.push_back(std::move(s));
    out.push_back(std::move(o));
    return;
  }
  ACC_CHECK(p.qkv.size() == 3, "tensor_parallel: '", p.scope, "' has ", p.qkv.size(),
            " q/k/v projections (1 fused or 3 expected)");
  auto q = linear_at(model, p.qkv[0]), k = linear_at(model, p.qkv[1]),
       v = linear_at(model, p.qkv[2]);
  const int64_t heads = q->out_features() / hs, kv_heads = k->out_features() / hs;
  ACC_CHECK(heads % tp == 0, "tensor_parallel: '", p.scope, "' has ", heads,
            " heads, not a multiple of tp ", tp);
  // Fewer kv heads than ranks: each kv head is held by the tp / kv_heads ranks whose query heads
  // use it (nn::qkv_rows checks that one divides the other).
  const int sharers = kv_heads < tp ? static_cast<int>(tp / kv_heads) : 1;
  Shard sq{p.qkv[0], q, true, {}}, sk{p.qkv[1], k, true, {}, sharers},
      sv{p.qkv[2], v, true, {}, sharers}, so{p.proj, linear_at(model, p.proj), false, {}};
  for (int r = 0; r < tp; ++r) {
    const nn::QkvRows rows = nn::qkv_rows(heads, kv_heads, hs, tp, r);
    sq.blocks.push_back({rows.q});
    sk.blocks.push_back({rows.k});
    sv.blocks.push_back({rows.v});
    so.blocks.push_back({rows.q});
  }
  for (Shard* s : {&sq, &sk, &sv, &so}) out.push_back(std::move(*s));
}

void add_mlp(nn::Module& model, const trace::MlpPattern& p, int tp, std::vector<Shard>& out) {
  auto second = linear_at(model, p.second);
  const int64_t width = second->in_features();
  for (const auto& f : p.first) {
    Shard s{f, linear_at(model, f), true, {}};
    ACC_CHECK(s.whole->out_features() == width, "tensor_parallel: '", f, "' has ",
              s.whole->out_features(), " outputs but '", p.second, "' takes ", width);
    for (int r = 0; r < tp; ++r) {
      s.blocks.push_back(
          {even_block(width, tp, r, ("tensor_parallel: '" + f + "' width").c_str())});
    }
    out.push_back(std::move(s));
  }
  Shard s{p.second, second, false, {}};
  for (int r = 0; r < tp; ++r) s.blocks.push_back({even_block(width, tp, r, "MLP width")});
  out.push_back(std::move(s));
}

// The layouts of a replaced linear's parameters on this rank: a column-parallel weight holds
// its row blocks (all columns), its bias the same rows; a row-parallel weight its column blocks
// (one); a row-parallel bias is whole on every rank (no layout: replicated).
void add_layouts(ParamLayouts& out, const Shard& s, const std::vector<nn::RowBlock>& mine,
                 int rank) {
  auto layout_of = [&](const Tensor& whole, int dim) {
    ParamLayout l;
    l.global_shape = whole.shape();
    l.tensor_dim = dim;
    l.tp_replicas = s.sharers;
    l.tp_replica = rank % s.sharers;
    int64_t at = 0;
    for (const auto& b : mine) {
      Box box = Box::whole(whole.shape());
      box.offsets[static_cast<size_t>(dim)] = b.offset;
      box.sizes[static_cast<size_t>(dim)] = b.size;
      l.segments.push_back({box, at});
      at += box.numel();
    }
    return l;
  };
  const std::string prefix = s.path + ".";
  if (s.column) {
    out[prefix + "weight"] = layout_of(s.whole->weight(), 0);
    if (s.whole->bias().defined()) out[prefix + "bias"] = layout_of(s.whole->bias(), 0);
  } else {
    out[prefix + "weight"] = layout_of(s.whole->weight(), 1);
  }
}

// The whole weight (bias) from every rank's shard: gathered along dimension `dim` in rank order,
// each rank's blocks put back at their offsets (along `dim` of the whole).
void put_back(Tensor& whole, const Tensor& local, int64_t dim,
              const std::vector<std::vector<nn::RowBlock>>& blocks,
              const dist::ProcessGroupPtr& tp) {
  NoGradGuard ng;
  const Tensor all = tp->size() > 1 ? dist::gather_along(local.detach(), dim, tp) : local.detach();
  int64_t at = 0;
  for (const auto& rank_blocks : blocks) {
    for (const auto& b : rank_blocks) {
      whole.narrow(dim, b.offset, b.size).copy_(all.narrow(dim, at, b.size));
      at += b.size;
    }
  }
}

// While the shards train, a replaced module's whole tensors hold no memory (tensor parallelism is
// there to split them): their storage is released, as fsdp releases a unit's (0 bytes on the meta
// device: any read fails), and given back, zeroed, before the undo writes the gathered values in.
void release_whole(Tensor& t) {
  if (t.defined()) repoint(t, std::make_shared<Storage>(0, Device::kMeta), 0);
}
void restore_whole(Tensor& t) {
  if (t.defined()) repoint_to_own(t, zeros(t.shape()));
}

// The one module of type T under `model` that `pick` accepts; "" when none, acc::ValueError naming
// them when several.
template <class T, class Pick>
std::string only_module(nn::Module& model, const char* what, Pick pick) {
  std::vector<std::string> found;
  for (const auto& [name, m] : model.named_modules()) {
    auto* t = dynamic_cast<T*>(m.get());
    if (t != nullptr && pick(*t)) found.push_back(name);
  }
  if (found.empty()) return "";
  ACC_CHECK(found.size() == 1, "tensor_parallel: ", found.size(), " modules could be the ", what,
            " (", found.front(), ", ", found[1], "): the vocabulary split needs one");
  return found.front();
}

// The layout of this rank's padded vocabulary rows [first, first + Vp/W) of a (V, C) table: the
// real ones, from local row 0 (the padding rows after them are in no segment).
ParamLayout vocab_layout(const Shape& whole, int64_t first, int64_t rows) {
  ParamLayout l;
  l.global_shape = whole;
  l.tensor_dim = 0;
  const int64_t real = std::clamp<int64_t>(whole[0] - first, 0, rows);
  if (real > 0) l.segments.push_back({Box{{first, 0}, {real, whole[1]}}, 0});
  return l;
}

// The whole (V, C) table from every rank's padded rows.
void put_back_vocab(Tensor& whole, const Tensor& local, const dist::ProcessGroupPtr& tp) {
  NoGradGuard ng;
  const Tensor all = tp->size() > 1 ? dist::gather_along(local.detach(), 0, tp) : local.detach();
  whole.copy_(all.narrow(0, 0, whole.size(0)));
}

// The blocks whose insides run on sequence chunks: the model's repeated blocks, which must hold
// every shard (a column-parallel input or row-parallel output outside them would be whole).
std::vector<std::string> sequence_parallel_blocks(nn::Module& model,
                                                  const std::vector<Shard>& shards) {
  const auto groups = trace::find_blocks(model);
  ACC_CHECK(!groups.empty(), "sequence_parallel: the model (", model.type_name(),
            ") has no repeated blocks to run on sequence chunks");
  const std::vector<std::string>& blocks = groups.front().blocks;
  for (const auto& s : shards) {
    bool inside = false;
    for (const auto& b : blocks) inside = inside || s.path.rfind(b + ".", 0) == 0;
    ACC_CHECK(inside, "sequence_parallel: '", s.path, "' is a tensor-parallel linear outside the ",
              "repeated blocks (", blocks.front(), " ... ", blocks.back(),
              "), where the activations are whole");
  }
  return blocks;
}

// Each block runs with its chunk of the sequence current (dropout's masks); the first scatters
// its input along the sequence, the last gathers its output.
nn::Undo sequence_parallel_boundaries(nn::Module& model, const std::vector<std::string>& blocks,
                                      const dist::ProcessGroupPtr& tp) {
  std::vector<nn::Undo> undos;
  try {
    for (size_t i = 0; i < blocks.size(); ++i) {
      const bool first = i == 0, last = i + 1 == blocks.size();
      nn::Module::ForwardWrapper w = [first, last, tp](
                                         nn::Module&, const Tensor& x,
                                         const std::function<Tensor(const Tensor&)>& fwd) {
        const int W = tp->size();
        ACC_CHECK_SHAPE(x.dim() == 3, "sequence_parallel: a block's input must be (B, T, C), got ",
                        x.shape());
        const int64_t T = first ? x.size(1) : x.size(1) * W;
        ACC_CHECK_SHAPE(T % W == 0, "sequence_parallel: the sequence length ", T,
                        " is not a multiple of tp ", W);
        const Tensor in = first ? dist::scatter_along(x, 1, tp) : x;
        nn::ForwardOptions o = nn::current_forward_options();
        o.sequence_chunk = TensorChunk{1, tp->rank() * (T / W), T};
        Tensor y;
        {
          nn::ForwardOptionsGuard guard(o);
          y = fwd(in);
        }
        return last ? dist::gather_along(y, 1, tp) : y;
      };
      undos.push_back(nn::wrap_forward({model.submodule(blocks[i])}, w));
    }
  } catch (...) {
    nn::undo_all(std::move(undos))();
    throw;
  }
  return nn::undo_all(std::move(undos));
}

}  // namespace

nn::Undo shard_vocab_parallel(models::LanguageModel& lm, const dist::ProcessGroupPtr& tp,
                              ParamLayouts* layouts) {
  ACC_CHECK(tp != nullptr, "tensor_parallel: the group is null");
  const int64_t V = lm.vocab_size();
  const std::string tied = lm.tied_embedding_name();
  std::string emb_path;
  if (!tied.empty()) {
    emb_path = tied.substr(0, tied.rfind('.'));
  } else {
    emb_path = only_module<nn::Embedding>(
        lm, "token embedding", [&](nn::Embedding& e) { return e.weight().size(0) == V; });
  }
  ACC_CHECK(!emb_path.empty(), "tensor_parallel: the model (", lm.type_name(),
            ") has no embedding of its ", V, "-token vocabulary to split");
  auto emb = std::dynamic_pointer_cast<nn::Embedding>(lm.submodule(emb_path));
  ACC_CHECK(emb != nullptr, "tensor_parallel: '", emb_path, "' is a ",
            lm.submodule(emb_path)->type_name(), ", not an Embedding");
  const int64_t C = emb->weight().size(1);
  std::string head_path;
  if (tied.empty()) {
    head_path = only_module<nn::Linear>(lm, "output projection", [&](nn::Linear& l) {
      return l.out_features() == V && l.in_features() == C;
    });
    ACC_CHECK(!head_path.empty(), "tensor_parallel: the model (", lm.type_name(),
              ") has an untied output projection, but no Linear (", C, " -> ", V,
              ") to split along the vocabulary");
  }
  auto pemb = std::make_shared<VocabParallelEmbedding>(*emb, tp);
  std::shared_ptr<nn::Linear> head;
  std::shared_ptr<VocabParallelHead> phead;
  if (!head_path.empty()) {
    head = std::dynamic_pointer_cast<nn::Linear>(lm.submodule(head_path));
    phead = std::make_shared<VocabParallelHead>(*head, tp);
  }
  const int64_t rows = pemb->weight().size(0);
  nn::Undo undo_emb = lm.replace_module(emb_path, pemb);
  nn::Undo undo_head;
  if (phead) {
    try {
      undo_head = lm.replace_module(head_path, phead);
    } catch (...) {
      undo_emb();
      throw;
    }
  }
  std::vector<std::string> names{emb_path + ".weight"};
  if (layouts != nullptr) {
    (*layouts)[emb_path + ".weight"] = vocab_layout(emb->weight().shape(), pemb->first_row(), rows);
    if (phead) {
      names.push_back(head_path + ".weight");
      (*layouts)[head_path + ".weight"] =
          vocab_layout(head->weight().shape(), phead->first_row(), rows);
    }
  }
  release_whole(emb->weight());
  if (head) release_whole(head->weight());
  return [emb, pemb, head, phead, undo_emb, undo_head, tp, layouts, names] {
    if (layouts != nullptr) {
      for (const auto& n : names) layouts->erase(n);
    }
    // As the layers' undo: no gather while an exception unwinds (the tables stay released).
    const bool gather = std::uncaught_exceptions() == 0;
    if (gather) {
      restore_whole(emb->weight());
      put_back_vocab(emb->weight(), pemb->weight(), tp);
    }
    if (phead) {
      if (gather) {
        restore_whole(head->weight());
        put_back_vocab(head->weight(), phead->weight(), tp);
      }
      undo_head();
    }
    undo_emb();
  };
}

nn::Undo shard_tensor_parallel(nn::Module& model, const trace::Trace& trace,
                               const dist::ProcessGroupPtr& tp, ParamLayouts* layouts,
                               const TensorParallelOptions& options,
                               std::vector<std::string>* partial_over_tp) {
  ACC_CHECK(tp != nullptr, "tensor_parallel: the group is null");
  const int t = tp->size(), rank = tp->rank();
  std::vector<Shard> shards;
  for (const auto& p : trace::find_attention_patterns(trace)) add_attention(model, p, t, shards);
  for (const auto& p : trace::find_mlp_patterns(trace)) add_mlp(model, p, t, shards);
  ACC_CHECK(!shards.empty(), "tensor_parallel: the model (", model.type_name(),
            ") has no attention or MLP pattern to shard");
  std::vector<std::string> blocks;
  if (options.sequence_parallel) blocks = sequence_parallel_blocks(model, shards);
  // The groups of ranks sharing kv heads: one split of tp per sharer count (collective over tp,
  // the same splits in the same order on every rank).
  std::map<int, dist::ProcessGroupPtr> sharer_groups;
  for (const auto& s : shards) {
    if (s.sharers > 1 && !sharer_groups.count(s.sharers)) {
      const std::string name = "tp_kv" + std::to_string(s.sharers);
      sharer_groups[s.sharers] = tp->is_meta()
                                     ? dist::ProcessGroup::meta(s.sharers, rank % s.sharers, name)
                                     : tp->split(rank / s.sharers, rank % s.sharers, name);
    }
  }
  // Every tp rank shards the same whole model: tp rank 0's (a meta group, which the search's
  // traces run over, has no values to agree on).
  if (t > 1 && !tp->is_meta()) broadcast_model_state(model, *tp);
  // Everything checked: now the replacements (undone in reverse if one throws).
  std::vector<std::pair<Shard, nn::Undo>> done;
  std::vector<std::shared_ptr<nn::Module>> layers;
  ParamLayouts mine_layouts;
  try {
    for (auto& s : shards) {
      const auto& mine = s.blocks[static_cast<size_t>(rank)];
      const dist::ProcessGroupPtr sharers = s.sharers > 1 ? sharer_groups.at(s.sharers) : nullptr;
      nn::ModulePtr layer =
          s.column
              ? nn::ModulePtr(std::make_shared<ColumnParallelLinear>(*s.whole, mine, tp, sharers))
              : nn::ModulePtr(std::make_shared<RowParallelLinear>(*s.whole, mine, tp));
      add_layouts(mine_layouts, s, mine, rank);
      if (auto* c = dynamic_cast<ColumnParallelLinear*>(layer.get())) {
        c->set_sequence_parallel(options.sequence_parallel);
      } else if (auto* r = dynamic_cast<RowParallelLinear*>(layer.get())) {
        r->set_sequence_parallel(options.sequence_parallel);
      }
      nn::Undo undo = model.replace_module(s.path, layer);
      layers.push_back(layer);
      done.emplace_back(std::move(s), std::move(undo));
    }
  } catch (...) {
    for (auto it = done.rbegin(); it != done.rend(); ++it) it->second();
    throw;
  }
  nn::Undo boundaries;
  if (options.sequence_parallel) {
    try {
      boundaries = sequence_parallel_boundaries(model, blocks, tp);
    } catch (...) {
      for (auto it = done.rbegin(); it != done.rend(); ++it) it->second();
      throw;
    }
    if (partial_over_tp != nullptr) {
      // The replicated parameters inside the blocks: they see this rank's chunk only.
      for (const auto& [name, p] : model.named_parameters()) {
        if (mine_layouts.count(name)) continue;
        for (const auto& b : blocks) {
          if (name.rfind(b + ".", 0) == 0) partial_over_tp->push_back(name);
        }
      }
    }
  }
  if (layouts != nullptr) layouts->insert(mine_layouts.begin(), mine_layouts.end());
  for (auto& [shard, undo] : done) {
    release_whole(shard.whole->weight());
    release_whole(shard.whole->bias());
  }
  std::vector<std::string> names;
  for (const auto& [name, l] : mine_layouts) names.push_back(name);
  return [done = std::move(done), layers = std::move(layers), tp, layouts, names,
          boundaries]() mutable {
    if (boundaries) boundaries();
    if (layouts != nullptr) {
      for (const auto& n : names) layouts->erase(n);
    }
    // The trained shards back into the whole linears (every rank alike), then the wholes back.
    // While an exception unwinds (a failed step tearing its Trainer down), another rank may never
    // reach the gathers, and an fsdp under this has left the shards released: the wholes stay
    // released too (0 bytes; any use fails with a device error naming the op), as fsdp's do.
    const bool gather = std::uncaught_exceptions() == 0;
    for (size_t i = 0; gather && i < done.size(); ++i) {
      Shard& s = done[i].first;
      nn::Module& layer = *layers[i];
      Tensor w = layer.find_tensor("weight");
      restore_whole(s.whole->weight());
      restore_whole(s.whole->bias());
      put_back(s.whole->weight(), w, s.column ? 0 : 1, s.blocks, tp);
      if (s.column && s.whole->bias().defined()) {
        put_back(s.whole->bias(), layer.find_tensor("bias"), 0, s.blocks, tp);
      } else if (s.whole->bias().defined()) {
        NoGradGuard ng;
        s.whole->bias().copy_(layer.find_tensor("bias").detach());
      }
    }
    for (auto it = done.rbegin(); it != done.rend(); ++it) it->second();
  };
}

}  // namespace acc::strategies
