#include "acc/search/space.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <unordered_set>

#include "acc/models/language_model.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/trace/batch_traces.hpp"
#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"
#include "made_ahead.hpp"
#include "ops_digest.hpp"

namespace acc::search {
namespace {

using strategies::MethodSearch;

std::string known_methods(const std::vector<MethodSearch>& methods) {
  std::string s;
  for (const auto& m : methods) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// One choice of a group: a method with a config, or none (method == nullptr).
struct Option {
  const MethodSearch* method = nullptr;
  nlohmann::json config;
};

}  // namespace

std::string Candidate::describe() const {
  return strategies::describe(strategy());
}

void Candidate::set_strategy(strategies::Strategy s) {
  layout_key_ = strategies::layout_key(s);
  strategy_ = std::move(s);
}

std::vector<const Candidate*> pointers_to(const std::vector<Candidate>& candidates) {
  std::vector<const Candidate*> out;
  out.reserve(candidates.size());
  for (const Candidate& c : candidates) out.push_back(&c);
  return out;
}

int64_t per_rank_batch(int64_t global_batch, int world) {
  ACC_CHECK(world >= 1, "search: world size must be >= 1, got ", world);
  ACC_CHECK(global_batch >= 1, "search: global batch must be >= 1, got ", global_batch);
  ACC_CHECK(global_batch % world == 0, "search: global batch ", global_batch,
            " does not split evenly over ", world, " ranks");
  return global_batch / world;
}

Candidate candidate_of(const strategies::Strategy& s, int world, int64_t global_batch,
                       const strategies::SearchContext& ctx,
                       const std::vector<MethodSearch>& methods,
                       const std::optional<std::string>& layout_key) {
  Candidate c;
  if (layout_key) {
    c.strategy_ = s;
    c.layout_key_ = *layout_key;
  } else {
    c.set_strategy(s);
  }
  c.world = world;
  c.mesh = strategies::mesh_for(s, world);
  c.per_rank_batch = global_batch / c.mesh.dp;
  // The gradient synchronisation reads what the others set (bf16 communication).
  for (const bool ranks_pass : {false, true}) {
    for (const strategies::Method& x : s) {
      const auto m = std::find_if(methods.begin(), methods.end(),
                                  [&](const MethodSearch& m) { return m.name == x.name; });
      ACC_CHECK(m != methods.end(), "search: method '", x.name,
                "' is not searchable (known: ", known_methods(methods), ")");
      if (m->needs_ranks != ranks_pass) continue;
      m->effects(x.config, ctx, c.effects);
      c.effects.methods.push_back(m->name);
    }
  }
  c.micro_batch = c.per_rank_batch / c.effects.micro_batches;
  return c;
}

std::vector<Candidate> enumerate_candidates(const SpaceOptions& o, int64_t num_blocks) {
  ACC_CHECK(o.world >= 1, "search: world size must be >= 1, got ", o.world);
  ACC_CHECK(o.global_batch >= 1, "search: global batch must be >= 1, got ", o.global_batch);
  const auto methods = strategies::searchable_methods();
  for (const auto* list : {&o.excluded, &o.included}) {
    for (const auto& name : *list) {
      const bool known = std::any_of(methods.begin(), methods.end(),
                                     [&](const MethodSearch& m) { return m.name == name; });
      ACC_CHECK(known, "search: unknown method '", name, "' in ",
                list == &o.excluded ? "excluded" : "included", " (known: ", known_methods(methods),
                ")");
    }
  }
  for (const auto& name : o.included) {
    ACC_CHECK(!contains(o.excluded, name), "search: method '", name,
              "' is both excluded and included");
  }
  // Two included methods of one exclusive slot cannot both be in a candidate: "--include ddp
  // zero2" used to mean "either" without a word.
  std::map<std::string, std::string> slot_taken;  // exclusive slot -> its included method
  for (const auto& m : methods) {
    if (!m.exclusive_slot || !contains(o.included, m.name)) continue;
    const auto [it, fresh] = slot_taken.emplace(m.slot, m.name);
    ACC_CHECK(fresh, "search: included methods '", it->second, "' and '", m.name,
              "' both fill the slot '", m.slot,
              "', which takes one method: include at most one of them");
  }
  // A layout may take every rank into one tp or cp group (dp 1, the whole batch per rank): the
  // methods' choices go up to the global batch, and the candidates keep those that divide their
  // own per-rank batch.
  const strategies::SearchContext ctx{.world = o.world,
                                      .num_blocks = num_blocks,
                                      .per_rank_batch = o.global_batch,
                                      .allow_bf16 = o.allow_bf16,
                                      .has_attention = o.has_attention,
                                      .language_model = o.language_model};

  // Groups of options: one per exclusive slot, one per other method; registry order.
  std::vector<std::vector<Option>> groups;
  std::vector<std::string> group_slot;  // "" for a non-exclusive method's own group
  std::set<std::string> required_slots;
  for (const auto& m : methods) {
    std::string why_not;
    if (contains(o.excluded, m.name)) why_not = "it is excluded";
    if (m.needs_bf16 && !o.allow_bf16) why_not = "bf16 is not allowed (allow_bf16)";
    if (m.needs_ranks && o.world == 1) why_not = "it needs more than one rank";
    if (m.needs_ranks && o.world > 1) required_slots.insert(m.slot);
    std::vector<nlohmann::json> choices =
        why_not.empty() ? m.choices(ctx) : std::vector<nlohmann::json>{};
    if (why_not.empty() && choices.empty()) why_not = "it has no choice in this run";
    ACC_CHECK(!contains(o.included, m.name) || why_not.empty(), "search: included method '", m.name,
              "' cannot be tried: ", why_not);
    size_t g = groups.size();
    if (m.exclusive_slot) {
      auto it = std::find(group_slot.begin(), group_slot.end(), m.slot);
      g = static_cast<size_t>(it - group_slot.begin());
    }
    if (g == groups.size()) {
      groups.push_back({Option{}});  // none
      group_slot.push_back(m.exclusive_slot ? m.slot : "");
    }
    // Each choice's config checked once here, on the configured threads (a pipeline's choices
    // make and validate their schedules: a tenth of a plan-only search on one thread); each
    // combination's composition below.
    std::vector<std::optional<std::string>> refused(choices.size());
    parallel_for(static_cast<int64_t>(choices.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        try {
          strategies::check_config({m.name, choices[static_cast<size_t>(i)]});
        } catch (const ValueError& e) {
          refused[static_cast<size_t>(i)] = e.what();
        }
      }
    });
    for (size_t i = 0; i < choices.size(); ++i) {
      if (refused[i]) {
        ACC_THROW(InternalError, "search: method '", m.name, "' offers a config it refuses (",
                  choices[i].dump(), "): ", *refused[i]);
      }
      groups[g].push_back({&m, std::move(choices[i])});
    }
  }
  // A required slot (gradient synchronisation on several ranks) has no "none"; an included
  // method's group keeps only that method.
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& opts = groups[g];
    const bool required = !group_slot[g].empty() && required_slots.count(group_slot[g]);
    bool has_included = false;
    for (const auto& opt : opts)
      has_included |= opt.method && contains(o.included, opt.method->name);
    opts.erase(std::remove_if(opts.begin(), opts.end(),
                              [&](const Option& opt) {
                                if (has_included) {
                                  return !opt.method || !contains(o.included, opt.method->name);
                                }
                                return required && !opt.method;
                              }),
               opts.end());
    ACC_CHECK(!opts.empty(), "search: no method of slot '", group_slot[g], "' can be tried, and ",
              o.world, " ranks need one (is every one excluded?)");
  }

  // The product of the groups, the mesh's first: a group whose options set mesh dimensions
  // (tensor, sequence, pipeline parallel) is an outer loop, and a combination of them whose
  // tp x cp x pp does not divide the world, or whose dp does not divide the global batch, is
  // dropped with everything the other groups would add to it (the mesh depends on those
  // methods alone). The rest is checked combination by combination (the composition rules).
  std::vector<std::optional<dist::DeviceMesh>> option_mesh;  // per option, flattened
  std::vector<std::vector<size_t>> option_index(groups.size());
  std::vector<size_t> outer, inner;  // group indices
  for (size_t g = 0; g < groups.size(); ++g) {
    bool sets_mesh = false;
    for (const Option& opt : groups[g]) {
      option_index[g].push_back(option_mesh.size());
      std::optional<dist::DeviceMesh> m;
      if (opt.method) {
        try {
          m = strategies::mesh_for({{opt.method->name, opt.config}}, o.world);
        } catch (const ValueError&) {
          // Its own dimension does not divide the world: no candidate has it.
        }
      } else {
        m = dist::DeviceMesh::data_parallel(o.world);
      }
      sets_mesh |= m && m->dp != o.world;
      option_mesh.push_back(m);
    }
    (sets_mesh ? outer : inner).push_back(g);
  }
  // The layout methods (tensor, sequence, pipeline parallel) set mesh dimensions, so their groups
  // are outer ones and a candidate's layout key is its outer choices': made once for them. Should
  // a layout method's group ever be an inner one, each candidate makes its own.
  bool layout_outer = true;
  for (const size_t g : inner) {
    for (const Option& opt : groups[g]) {
      layout_outer &=
          !opt.method || strategies::layout_key({{opt.method->name, opt.config}}).empty();
    }
  }
  int64_t batch_refused = 0;  // meshes whose dp does not divide the global batch
  // Odometer over `which` groups of `pick`; false when it wrapped around.
  auto advance = [&](std::vector<size_t>& pick, const std::vector<size_t>& which) {
    for (const size_t g : which) {
      if (++pick[g] < groups[g].size()) return true;
      pick[g] = 0;
    }
    return false;
  };
  // The choices of the outer groups whose mesh fits, each with its layout key (layout_outer).
  struct Outer {
    std::vector<size_t> pick;  // the inner groups' at 0
    std::optional<std::string> layout;
  };
  std::vector<Outer> meshes;
  std::vector<size_t> pick(groups.size(), 0);
  do {
    // The mesh of this choice of the outer groups: each dimension from the option that sets it.
    dist::DeviceMesh mesh;
    bool fits = true;
    for (const size_t g : outer) {
      const auto& m = option_mesh[option_index[g][pick[g]]];
      if (!m) {
        fits = false;
        break;
      }
      mesh.tp = std::max(mesh.tp, m->tp);
      mesh.cp = std::max(mesh.cp, m->cp);
      mesh.pp = std::max(mesh.pp, m->pp);
    }
    const int inner_ranks = mesh.tp * mesh.cp * mesh.pp;
    if (!fits || o.world % inner_ranks != 0) continue;
    if (o.global_batch % (o.world / inner_ranks) != 0) {
      ++batch_refused;
      continue;
    }
    Outer& m = meshes.emplace_back(Outer{pick, std::nullopt});
    if (layout_outer) {
      strategies::Strategy outer_methods;  // in group order, as a candidate lists them
      for (const size_t g : outer) {
        const Option& opt = groups[g][pick[g]];
        if (opt.method) outer_methods.push_back({opt.method->name, opt.config});
      }
      m.layout = strategies::layout_key(outer_methods);
    }
  } while (advance(pick, outer));
  // Each mesh's combinations of the inner groups, the meshes on the configured threads (the
  // methods' checks and effects read nothing shared but the registry); kept in the odometer's
  // order.
  std::vector<std::vector<Candidate>> of_mesh(meshes.size());
  parallel_for(static_cast<int64_t>(meshes.size()), 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Outer& m = meshes[static_cast<size_t>(i)];
      std::vector<Candidate>& found = of_mesh[static_cast<size_t>(i)];
      std::vector<size_t> at = m.pick;
      do {
        // A pair of methods one of which never composes with the other
        // (MethodSearch::never_with): refused before the strategy is built, as parse_strategy
        // would refuse it.
        bool never = false;
        for (size_t g = 0; g < groups.size() && !never; ++g) {
          const MethodSearch* a = groups[g][at[g]].method;
          if (a == nullptr || a->never_with.empty()) continue;
          for (size_t h = 0; h < groups.size() && !never; ++h) {
            const MethodSearch* b = groups[h][at[h]].method;
            never = h != g && b != nullptr && contains(a->never_with, b->name);
          }
        }
        if (never) continue;
        strategies::Strategy s;
        for (size_t g = 0; g < groups.size(); ++g) {
          const Option& opt = groups[g][at[g]];
          if (opt.method) s.push_back({opt.method->name, opt.config});
        }
        try {
          strategies::check_composition(s);
        } catch (const ValueError&) {
          continue;
        }
        Candidate c = candidate_of(s, o.world, o.global_batch, ctx, methods, m.layout);
        // Micro-batches offered for a larger per-rank batch than this candidate's.
        if (c.per_rank_batch % c.effects.micro_batches == 0) found.push_back(std::move(c));
      } while (advance(at, inner));
    }
  });
  std::vector<Candidate> out;
  size_t total = 0;
  for (const auto& found : of_mesh) total += found.size();
  out.reserve(total);
  for (auto& found : of_mesh) {
    for (Candidate& c : found) out.push_back(std::move(c));
  }
  ACC_CHECK(!out.empty() || batch_refused == 0, "search: global batch ", o.global_batch,
            " does not split evenly over ", o.world, " ranks, nor over the dp of any mesh tried");
  ACC_CHECK(!out.empty(), "search: no candidate is left (excluded ", o.excluded.size(),
            " method(s), included ", o.included.size(), ")");
  return out;
}

trace::ModelRef layout_model(const trace::ModelRef& model, const Candidate& c) {
  return rank_models(model, c, 0).front().model;
}

namespace {

// What a pipeline's walk depends on: its method's config (size, schedule, virtual stages,
// micro-batches, stages given).
std::string pipeline_walk_key(const strategies::Strategy& s) {
  for (const strategies::Method& m : s) {
    if (m.name == "pipeline_parallel") return m.config.dump();
  }
  return "";
}

// Each pp rank of `pipe`: its stages, ends and actions (model, keys and messages left unset).
std::vector<RankModel> walk_pipeline(const strategies::PipelineLayout& pipe) {
  std::vector<RankModel> out;
  const int S = pipe.schedule->num_stages();
  for (int r = 0; r < pipe.schedule->ranks; ++r) {
    RankModel rm;
    rm.pp_rank = r;
    for (int st = r; st < S; st += pipe.schedule->ranks) {
      rm.stages.push_back(pipe.stages[static_cast<size_t>(st)]);
    }
    rm.first = r == pipe.schedule->rank_of_stage(0);
    rm.last = r == pipe.schedule->rank_of_stage(S - 1);
    // Walk the rank's list: a forward adds one in flight to its stage, a backward holds its own
    // until it ends and, from then on, its stage's gradients.
    std::vector<int> in_flight(rm.stages.size(), 0);
    std::vector<bool> gradients(rm.stages.size(), false);
    for (const strategies::PipeAction& a : pipe.schedule->actions[static_cast<size_t>(r)]) {
      const int s = (a.stage - r) / pipe.schedule->ranks;
      const bool backward = a.step != strategies::PipeStep::kForward;
      if (!backward) ++in_flight[static_cast<size_t>(s)];
      // Compared in place: a schedule of m micro-batches has 2 m v actions a rank, few distinct.
      const bool seen =
          std::any_of(rm.actions.begin(), rm.actions.end(), [&](const StageAction& x) {
            return x.stage == s && x.backward == backward && x.in_flight == in_flight &&
                   x.gradients == gradients;
          });
      if (!seen) rm.actions.push_back({s, backward, in_flight, gradients});
      if (backward) {
        gradients[static_cast<size_t>(s)] = true;
        --in_flight[static_cast<size_t>(s)];
      }
    }
    // An action holding no more in flight on any stage than another of the same kind (stage,
    // direction, gradients held) never holds more memory: priced for every pipeline rank of
    // every candidate, the list keeps only the others (1F1B's warm-up forwards go).
    auto dominated = [&](const StageAction& a) {
      return std::any_of(rm.actions.begin(), rm.actions.end(), [&](const StageAction& b) {
        return &a != &b && a.stage == b.stage && a.backward == b.backward &&
               a.gradients == b.gradients &&
               std::equal(a.in_flight.begin(), a.in_flight.end(), b.in_flight.begin(),
                          [](int x, int y) { return x <= y; });
      });
    };
    std::vector<StageAction> kept;
    for (const StageAction& a : rm.actions) {
      if (!dominated(a)) kept.push_back(a);
    }
    rm.actions = std::move(kept);
    out.push_back(std::move(rm));
  }
  return out;
}

}  // namespace

std::vector<RankModel> rank_models(const trace::ModelRef& model, const Candidate& c,
                                   int64_t seq_len, PipelineWalks* walks) {
  // A registry model trains on its own next-token loss, which a split vocabulary replaces with
  // the vocabulary-parallel one; a module on the user's loss.
  if (c.mesh.pp == 1) {
    trace::ModelRef::Rewrite rewrite =
        strategies::layout_rewrite(c.strategy(), c.world, model.is_registry());
    RankModel whole;
    whole.model = rewrite ? model.rewritten(std::move(rewrite)) : model;
    whole.trace_key = c.layout_key();
    whole.shape_key = whole.trace_key;
    return {std::move(whole)};
  }
  ACC_CHECK(model.is_registry(), "pipeline_parallel: the model (", model.type(),
            ") is no language model of the registry: stages are cut between the blocks of a "
            "language model's embed -> blocks -> head (a module of your own is not cut yet)");
  const models::LanguageModelPtr lm = models::create_meta_model(model.type(), model.config(), 1);
  // A stage's message is its (B, T, C) activation, T as the layout splits the sequence.
  const int64_t T = strategies::stage_message_tokens(c.strategy(), c.mesh,
                                                     seq_len > 0 ? seq_len : lm->max_seq_len());
  // The methods each stage runs, to which each rank's key adds its stages.
  const std::string stage_layout =
      strategies::to_json(strategies::stage_layout_of(c.strategy())).dump();
  // Each pp rank's stages and actions: the cut and the schedule's walk, the same for every layout
  // around one pipeline config (tp, sp, the data-parallel method), so made once per config when
  // `walks` keeps them.
  std::vector<RankModel> out;
  const std::string walk_key = pipeline_walk_key(c.strategy());
  if (walks != nullptr) {
    std::lock_guard<std::mutex> lock(walks->mutex);
    if (const auto hit = walks->by_config.find(walk_key); hit != walks->by_config.end()) {
      out = hit->second;
    }
  }
  if (out.empty()) {
    // Outside the lock: two threads may walk one config at once (the first kept wins; both
    // walks are the same).
    const std::optional<strategies::PipelineLayout> pipe = strategies::pipeline_layout(
        c.strategy(), model.num_layers(),
        strategies::head_cost_in_blocks(lm->hidden_size(), lm->vocab_size(), lm->max_seq_len()));
    ACC_CHECK_INTERNAL(pipe.has_value(), "search: a mesh of pp ", c.mesh.pp, " without a pipeline");
    out = walk_pipeline(*pipe);
    if (walks != nullptr) {
      std::lock_guard<std::mutex> lock(walks->mutex);
      walks->by_config.emplace(walk_key, out);
    }
  }
  // Each rank's rewrite is built when its model is first traced: most ranks of a pipeline share
  // their traces with another's (shape_key) and are never traced, and building one (the meta mesh
  // and its groups) for each of a deep pipeline's ranks was a tenth of a plan-only search.
  const auto strategy = std::make_shared<const strategies::Strategy>(c.strategy());
  const int world = c.world;
  for (RankModel& rm : out) {
    int64_t blocks = 0;
    for (const auto& st : rm.stages) blocks += st.end - st.begin;
    rm.model = model.at_depth(blocks).rewritten(
        [strategy, world, pp_rank = rm.pp_rank](nn::Module& m, const data::Batch& batch,
                                                const trace::BatchLoss& loss) {
          return strategies::layout_rewrite(*strategy, world, true, pp_rank)(m, batch, loss);
        });
    const std::string ends = std::string(rm.first ? "#first" : "") + (rm.last ? "#last" : "");
    rm.trace_key = stage_layout + "#stages";
    for (const auto& st : rm.stages) rm.trace_key += ":" + std::to_string(st.end - st.begin);
    rm.trace_key += ends;
    rm.shape_key = stage_layout + "#stages" + std::to_string(rm.stages.size()) + ends;
    rm.message_bytes = checked_mul(checked_mul(checked_mul(c.micro_batch, T, "activation elements"),
                                               lm->hidden_size(), "activation elements"),
                                   4, "activation bytes");
  }
  return out;
}

RankModels::RankModels(trace::ModelRef model, int64_t seq_len)
    : model_(std::move(model)),
      seq_len_(seq_len),
      // The traces of 1 and 2 blocks kept as the time model's digests of them, which it reads
      // for every mesh (CostModel::pass); the memory estimator's deeper ones dropped once their
      // figures are made (trace::TraceCache). A module of the user's is traced whole: every
      // trace kept.
      traces_(model_.extrapolates() ? std::make_shared<trace::TraceCache>(2, detail::digest_ops)
                                    : std::make_shared<trace::TraceCache>()) {}

const std::vector<RankModel>& RankModels::of(const Candidate& c) {
  if (const std::vector<RankModel>* ranks = made(c)) return *ranks;
  const std::string& key = c.layout_key();
  std::vector<RankModel> ranks(1);
  ranks.front().model = model_;  // no layout: the model itself
  if (!key.empty()) ranks = rank_models(model_, c, seq_len_, &walks_);
  return keep(key, std::move(ranks));
}

const std::vector<RankModel>& RankModels::keep(const std::string& layout,
                                               std::vector<RankModel> ranks) {
  for (RankModel& r : ranks) {
    if (traces_) r.model = r.model.shared_traces(traces_, r.shape_key);
    r.trace_id = trace_id(r.trace_key);
  }
  return layouts_.emplace(layout, std::move(ranks)).first->second;
}

void RankModels::make(const std::vector<const Candidate*>& candidates) {
  // The first candidate of each layout not made yet, in the candidates' order.
  std::vector<const Candidate*> firsts;
  std::unordered_set<std::string> seen;
  for (const Candidate* c : candidates) {
    const std::string& key = c->layout_key();
    if (key.empty() || layouts_.count(key) != 0 || !seen.insert(key).second) continue;
    firsts.push_back(c);
  }
  // Each layout's cut, walk and rewrites (a tenth of a plan-only search at GPT-3 175B on 1024
  // devices, on one thread): what of() makes, shared walks and all.
  std::vector<std::optional<std::vector<RankModel>>> made(firsts.size());
  parallel_for(static_cast<int64_t>(firsts.size()), 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      try {
        made[static_cast<size_t>(i)] =
            rank_models(model_, *firsts[static_cast<size_t>(i)], seq_len_, &walks_);
      } catch (const Error&) {  // of() throws it again, where it is asked
      }
    }
  });
  for (size_t i = 0; i < firsts.size(); ++i) {
    if (made[i]) keep(firsts[i]->layout_key(), std::move(*made[i]));
  }
}

int RankModels::trace_id(const std::string& trace_key) {
  return trace_ids_.try_emplace(trace_key, static_cast<int>(trace_ids_.size())).first->second;
}

const std::vector<RankModel>* RankModels::made(const Candidate& c) const {
  const auto it = layouts_.find(c.layout_key());
  return it == layouts_.end() ? nullptr : &it->second;
}

void RankModels::share_traces(std::shared_ptr<trace::TraceCache> cache) {
  // of() hands out references to the layouts it made, whose models hold the cache they were made
  // with: swapping the cache then would leave them dangling or stale.
  ACC_CHECK(layouts_.empty(), "RankModels::share_traces: called after ", layouts_.size(),
            " layout(s) were made; give the cache before the first prediction");
  traces_ = std::move(cache);
}

void RankModels::for_each_rank(
    const std::vector<const Candidate*>& candidates,
    const std::function<void(const Candidate&, const RankModel&, const BatchPairKey&)>& f) {
  make(candidates);
  std::vector<std::pair<int, trace::TraceOptions::KeyFields>> seen;  // a candidate's pair keys
  for (const Candidate* cp : candidates) {
    const Candidate& c = *cp;
    const std::vector<RankModel>* ranks = nullptr;
    try {
      ranks = &of(c);
    } catch (const ValueError&) {  // a pipeline cut that cannot be made: predict says so
      continue;
    }
    seen.clear();
    for (const RankModel& r : *ranks) {
      const trace::TraceOptions a = rank_activation_options(c.effects, r);
      const std::pair<int, trace::TraceOptions::KeyFields> id{r.trace_id, a.key_fields()};
      if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
      seen.push_back(id);
      f(c, r, batch_pair_key(r.trace_key, a));
    }
  }
}

namespace {

// Of the model's first e.recompute_blocks blocks, those of `r`'s stages (-1 stays all).
int64_t rank_recompute_blocks(const strategies::StepEffects& e, const RankModel& r) {
  if (r.stages.empty() || e.recompute_blocks < 0) return e.recompute_blocks;
  int64_t mine = 0;
  for (const auto& st : r.stages) {
    mine += std::clamp<int64_t>(e.recompute_blocks - st.begin, 0, st.end - st.begin);
  }
  return mine;
}

// `e`'s activation options with `recompute_blocks` of them recomputed.
trace::TraceOptions options_with(const strategies::StepEffects& e, int64_t recompute_blocks) {
  trace::TraceOptions t;
  if (recompute_blocks != 0) {
    t.recompute = e.selective_recompute ? trace::Recompute::kSelective : trace::Recompute::kBlock;
  }
  t.recompute_blocks = recompute_blocks;
  t.bf16_activations = e.bf16_activations;
  return t;
}

}  // namespace

strategies::StepEffects rank_effects(const strategies::StepEffects& e, const RankModel& r) {
  strategies::StepEffects out = e;
  out.recompute_blocks = rank_recompute_blocks(e, r);
  return out;
}

trace::TraceOptions activation_trace_options(const strategies::StepEffects& e) {
  return options_with(e, e.recompute_blocks);
}

trace::TraceOptions rank_activation_options(const strategies::StepEffects& e, const RankModel& r) {
  return options_with(e, rank_recompute_blocks(e, r));
}

nlohmann::json MemoryPrediction::to_json() const {
  nlohmann::json j = {{"parameters", parameters},
                      {"gradients", gradients},
                      {"optimizer_state", optimizer_state},
                      {"buffers", buffers},
                      {"activations_peak", activations_peak},
                      {"peak", peak}};
  if (!stage_peaks.empty()) {
    j["stage_peaks"] = stage_peaks;
    j["in_flight_activations"] = in_flight_activations;
  }
  return j;
}

MemoryModel::MemoryModel(std::string model_type, nlohmann::json config, int64_t seq_len,
                         std::string optimizer)
    : MemoryModel(trace::ModelRef::registry(std::move(model_type), std::move(config)), seq_len,
                  std::move(optimizer)) {}

MemoryModel::MemoryModel(trace::ModelRef model, int64_t seq_len, std::string optimizer)
    : model_(model),
      seq_len_(seq_len),
      optimizer_(std::move(optimizer)),
      ranks_(std::make_shared<RankModels>(model, seq_len)) {}

const trace::TrainingNeed& MemoryModel::need(int64_t micro_batch, const strategies::StepEffects& e,
                                             std::optional<double> in_flight_fraction,
                                             bool accumulated) {
  return need(model_, ranks_->trace_id(""), micro_batch, activation_trace_options(e),
              in_flight_fraction, accumulated)
      .need;
}

std::optional<std::string> MemoryModel::layout_refusal(const Candidate& c) {
  const std::string& key = c.layout_key();
  if (key.empty()) return std::nullopt;
  auto it = refusals_.find(key);
  if (it != refusals_.end()) return it->second;
  std::optional<std::string> refusal;
  try {
    // Each distinct rank traced once (ranks running the same stages share a trace key).
    for (const RankModel& r : ranks_->of(c)) {
      if (traced_ranks_.count(r.trace_key) != 0) continue;
      (void)r.model.trace(model_.extrapolates() ? 1 : r.model.num_layers(), 1, seq_len_, {});
      traced_ranks_.insert(r.trace_key);
    }
  } catch (const ValueError& e) {  // a split that does not divide, a model it is not built for
    refusal = e.what();
  } catch (const ShapeError& e) {
    refusal = e.what();
  }
  return refusals_.emplace(key, refusal).first->second;
}

size_t MemoryModel::NeedKeyHash::operator()(const NeedKey& k) const {
  const auto& [trace_id, batch, fields, fraction, accumulated] = k;
  const auto& [backward, recompute, blocks, bf16] = fields;
  size_t h = std::hash<int>{}(trace_id);
  for (const size_t x :
       {std::hash<int64_t>{}(batch), std::hash<bool>{}(backward),
        std::hash<int>{}(static_cast<int>(recompute)), std::hash<int64_t>{}(blocks),
        std::hash<bool>{}(bf16), std::hash<double>{}(fraction), std::hash<bool>{}(accumulated)}) {
    h ^= x + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);  // boost::hash_combine's mix
  }
  return h;
}

MemoryModel::NeedKey MemoryModel::need_key(int trace_id, int64_t micro_batch,
                                           const trace::TraceOptions& activations,
                                           std::optional<double> in_flight_fraction,
                                           bool accumulated) {
  return NeedKey{trace_id, micro_batch, activations.key_fields(), in_flight_fraction.value_or(-1.0),
                 accumulated};
}

MemoryModel::Made MemoryModel::make_needs(const trace::ModelRef& model, int trace_id,
                                          const std::vector<int64_t>& batches,
                                          const trace::TraceOptions& activations,
                                          std::optional<double> in_flight_fraction,
                                          bool accumulated, bool paired) const {
  std::optional<trace::BlockwiseGradients> blockwise;
  if (in_flight_fraction) {
    blockwise = trace::BlockwiseGradients{.in_flight_fraction = *in_flight_fraction,
                                          .accumulated = accumulated};
  }
  Made out;
  auto key = [&](int64_t b) {
    return need_key(trace_id, b, activations, in_flight_fraction, accumulated);
  };
  // From one pair of traces (trace::estimate_training_needs; one sample beside them, which takes
  // its deeper traces from the pairs where it can).
  std::vector<int64_t> pair;
  for (const int64_t b : batches) {
    if (paired && model.is_registry()) {
      pair.push_back(b);
      continue;
    }
    out.needs.emplace_back(key(b), NeedEntry{trace::estimate_training_need(
                                       model, b, seq_len_, activations, optimizer_, blockwise)});
    ++out.traced;
  }
  if (pair.empty()) return out;
  std::vector<trace::TrainingNeed> needs =
      trace::estimate_training_needs(model, pair, seq_len_, activations, optimizer_, blockwise);
  ++out.traced;
  for (size_t i = 0; i < needs.size(); ++i)
    out.needs.emplace_back(key(pair[i]), NeedEntry{std::move(needs[i])});
  return out;
}

void MemoryModel::keep(Made made) {
  needs_traced_ += made.traced;
  for (auto& [key, entry] : made.needs) needs_.emplace(key, std::move(entry));
}

MemoryModel::NeedEntry& MemoryModel::need(const trace::ModelRef& model, int trace_id,
                                          int64_t micro_batch,
                                          const trace::TraceOptions& activations,
                                          std::optional<double> in_flight_fraction,
                                          bool accumulated, const std::set<int64_t>* batches) {
  const NeedKey key = need_key(trace_id, micro_batch, activations, in_flight_fraction, accumulated);
  auto it = needs_.find(key);
  if (it != needs_.end()) return it->second;
  std::vector<int64_t> todo{micro_batch};
  const bool paired = batches != nullptr && micro_batch >= trace::BatchTraces::kLow &&
                      batches->count(micro_batch) != 0 && model.is_registry();
  if (paired) {
    // Every expected micro-batch of the rank's trace from the same traces (those smaller than
    // the pair's are made on their own when asked).
    todo.clear();
    for (const int64_t b : *batches) {
      if (b >= trace::BatchTraces::kLow &&
          needs_.count(need_key(trace_id, b, activations, in_flight_fraction, accumulated)) == 0) {
        todo.push_back(b);
      }
    }
  }
  keep(make_needs(model, trace_id, todo, activations, in_flight_fraction, accumulated, paired));
  return needs_.at(key);
}

int64_t MemoryModel::num_blocks() {
  return need(1, strategies::StepEffects{}).num_layers;
}

BatchPairKey batch_pair_key(const std::string& trace_key, const trace::TraceOptions& a) {
  return {trace_key, a.key_fields()};
}

namespace {

// What of a block's packed gradients stays in flight under sharded parameters (fsdp), as a share
// of them (MemoryModel::predict_rank says why): the packed buffer (half of it in bf16), the ring's
// partial sums (min(2, W - 2) chunks of 1/W of it over W data-parallel ranks) and, in bf16, the
// output chunk.
double sharded_in_flight(const strategies::StepEffects& e, int64_t W) {
  const double elem_share = e.bf16_communication ? 0.5 : 1.0;
  const int64_t ring_chunks = std::min<int64_t>(2, std::max<int64_t>(0, W - 2));
  return elem_share * (1.0 + static_cast<double>(ring_chunks + (e.bf16_communication ? 1 : 0)) /
                                 static_cast<double>(W));
}

// The timeline of a pipeline rank's need over each of its stages (trace::stage_highs), where the
// trace's copy splits its blocks as the rank does: evenly (Strategy's layout_rewrite), so only for
// stages of equal length (else none). Once per need: the layout keying it holds the rank's stages.
std::optional<std::vector<trace::StageHighs>> stage_highs_of(const trace::TrainingNeed& n,
                                                             const RankModel& rank) {
  std::vector<int64_t> blocks;
  for (const auto& st : rank.stages) blocks.push_back(st.end - st.begin);
  if (std::adjacent_find(blocks.begin(), blocks.end(), std::not_equal_to<>()) != blocks.end()) {
    return std::nullopt;
  }
  return trace::stage_highs(n, blocks);
}

}  // namespace

void MemoryModel::expect(const std::vector<Candidate>& candidates) {
  // Each pair's first rank model (the one whose need predict_rank keeps under its trace key) and
  // the activation options its key was made of.
  struct Pair {
    const Candidate* candidate = nullptr;
    const RankModel* rank = nullptr;
    trace::TraceOptions activations;
  };
  std::map<BatchPairKey, Pair> first;
  // The blockwise needs predict_rank asks of the candidates with sharded parameters (its
  // in-flight fraction, accumulated with more than one micro-batch), per pair: each micro-batch
  // asked and, as need() makes them once one from BatchTraces::kLow up is asked of a registry
  // model, every expected one from kLow up.
  using Blockwise = std::pair<double, bool>;
  std::map<BatchPairKey, std::map<Blockwise, std::set<int64_t>>> blockwise;
  ranks_->for_each_rank(pointers_to(candidates), [&](const Candidate& c, const RankModel& r,
                                                     const BatchPairKey& pair_key) {
    expected_[{r.trace_id, pair_key.second}].insert(c.micro_batch);
    // The rank's effects are the candidate's but for the blocks recomputed (rank_effects).
    const strategies::StepEffects& e = c.effects;
    if (first.count(pair_key) == 0) {
      first.emplace(pair_key, Pair{&c, &r, rank_activation_options(e, r)});
    }
    if (e.shard_parameters) {
      blockwise[pair_key][{sharded_in_flight(e, c.data_parallel_ranks()), e.micro_batches > 1}]
          .insert(c.micro_batch);
    }
  });
  // Each pair's needs made now, on the configured threads: the needs predict_rank asks of each
  // candidate (without blockwise gradients, and the blockwise ones above), made as need() makes
  // them. The pairs whose rank models share their traces (one shape_key, the trace cache's
  // identity) run on one thread, in order (detail::made_ahead): a model (its meta mesh, its
  // rewrite) is never traced twice at once, and which of them makes a shared trace does not
  // depend on the threads' timing, so the traces are those one thread makes. A module of the
  // user's is traced in place (its parameters swapped to meta storage and back, its layers
  // replaced by a tensor-parallel rewrite): all of its pairs run on one thread. A pair whose
  // layout the model refuses (layout_refusal, as predict asks it first) is left out, and so is a
  // need made before.
  // A job: one pair's needs of one kind (plain, or blockwise with a fraction), not made yet.
  struct Job {
    const BatchPairKey* key = nullptr;
    std::optional<double> in_flight_fraction;
    bool accumulated = false;
    std::vector<int64_t> batches;
  };
  std::map<std::string, std::vector<Job>> by_shape;
  for (const auto& entry : first) {
    // Named, not bound: a lambda below captures them (clang refuses to capture a binding).
    const BatchPairKey& key = entry.first;
    const Pair& pair = entry.second;
    if (layout_refusal(*pair.candidate)) continue;
    auto add = [&](Job job, const std::set<int64_t>& asked) {
      for (const int64_t b : asked) {
        if (needs_.count(need_key(pair.rank->trace_id, b, pair.activations, job.in_flight_fraction,
                                  job.accumulated)) == 0) {
          job.batches.push_back(b);
        }
      }
      if (job.batches.empty()) return;
      by_shape[model_.is_registry() ? pair.rank->shape_key : ""].push_back(std::move(job));
    };
    const std::set<int64_t>& expected = expected_.at({pair.rank->trace_id, key.second});
    add(Job{&key, std::nullopt, false, {}}, expected);
    if (auto it = blockwise.find(key); it != blockwise.end()) {
      for (const auto& [variant, asked] : it->second) {
        std::set<int64_t> batches = asked;
        if (model_.is_registry() && *asked.rbegin() >= trace::BatchTraces::kLow) {
          batches.insert(expected.lower_bound(trace::BatchTraces::kLow), expected.end());
        }
        add(Job{&key, variant.first, variant.second, {}}, batches);
      }
    }
  }
  std::vector<const std::vector<Job>*> jobs;
  for (const auto& [shape_key, list] : by_shape) jobs.push_back(&list);
  auto made = detail::made_ahead<Made>(jobs, [&](const Job& job, Made& out) {
    const Pair& pair = first.at(*job.key);
    Made m = make_needs(pair.rank->model, pair.rank->trace_id, job.batches, pair.activations,
                        job.in_flight_fraction, job.accumulated, /*paired=*/true);
    out.traced += m.traced;
    for (auto& [key, entry] : m.needs) {
      // A pipeline rank's prediction reads its plain need's figures over its stages.
      if (!job.in_flight_fraction && !pair.rank->stages.empty()) {
        make_stage_figures(entry, *pair.rank, pair.activations.recompute_blocks);
      }
      out.needs.emplace_back(std::move(key), std::move(entry));
    }
  });
  for (Made& m : made) keep(std::move(m));
}

MemoryPrediction MemoryModel::predict(const Candidate& c) {
  return predict(c, false);
}

std::vector<MemoryPrediction> MemoryModel::predict_all(
    const std::vector<const Candidate*>& candidates) {
  std::vector<MemoryPrediction> out(candidates.size());
  // 0: predicted on the threads; 1: left for this thread (a need not made, or an error, which
  // predict() then throws in the candidates' order).
  std::vector<char> left(candidates.size(), 0);
  parallel_for(static_cast<int64_t>(candidates.size()), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto k = static_cast<size_t>(i);
      try {
        out[k] = predict(*candidates[k], true);
      } catch (...) {
        left[k] = 1;
      }
    }
  });
  for (size_t k = 0; k < candidates.size(); ++k) {
    if (left[k] == 0) continue;
    ++predictions_left_;
    out[k] = predict(*candidates[k], false);
  }
  return out;
}

MemoryPrediction MemoryModel::predict(const Candidate& c, bool made_only) {
  const std::vector<RankModel>* made = ranks_->made(c);
  if (made == nullptr && made_only) throw NotMade{};
  const std::vector<RankModel>& ranks = made != nullptr ? *made : ranks_->of(c);
  if (ranks.size() == 1) return predict_rank(c, ranks.front(), made_only, nullptr);
  // A pipeline: each pp rank holds its own stages; the candidate needs its largest.
  MemoryPrediction worst;
  std::vector<int64_t> peaks;
  LastNeed last;
  for (const RankModel& r : ranks) {
    MemoryPrediction m = predict_rank(c, r, made_only, &last);
    peaks.push_back(m.peak);
    if (peaks.size() == 1 || m.peak > worst.peak) worst = m;
  }
  worst.stage_peaks = std::move(peaks);
  return worst;
}

namespace {

// Each of a pipeline rank's stages' share of `total` bytes: `per_block` a block (`per_recomputed`
// for the first `recomputed` of the rank's blocks), the rest on the stage holding the embedding
// or the head (spread evenly on a middle rank, the remainder on its first stage).
std::vector<int64_t> stage_shares(int64_t total, int64_t per_block, int64_t per_recomputed,
                                  int64_t recomputed, const RankModel& rank) {
  const size_t v = rank.stages.size();
  std::vector<int64_t> share(v, 0);
  int64_t offset = 0, blocks = 0;
  for (size_t s = 0; s < v; ++s) {
    const int64_t len = rank.stages[s].end - rank.stages[s].begin;
    const int64_t rec = std::clamp<int64_t>(recomputed - offset, 0, len);
    share[s] = checked_add(checked_mul(len - rec, per_block, "stage bytes"),
                           checked_mul(rec, per_recomputed, "stage bytes"), "stage bytes");
    blocks = checked_add(blocks, share[s], "stage bytes");
    offset += len;
  }
  const int64_t ends = std::max<int64_t>(0, total - blocks);
  if (rank.first) {
    share.front() += ends;
  } else if (rank.last) {
    share.back() += ends;
  } else {
    for (auto& b : share) b += ends / static_cast<int64_t>(v);
    share.front() += ends % static_cast<int64_t>(v);  // the shares sum to `total`
  }
  return share;
}

// stage_saved_bytes with the rank's first `recompute_blocks` blocks recomputed (-1: all; the
// trace's per-block figure is then already the recomputed one).
std::vector<int64_t> saved_shares(const trace::TrainingNeed& n, int64_t recompute_blocks,
                                  const RankModel& rank) {
  return stage_shares(n.memory.activations_saved, n.block_activations_saved,
                      n.recomputed_block_activations_saved, std::max<int64_t>(0, recompute_blocks),
                      rank);
}

}  // namespace

std::vector<int64_t> stage_saved_bytes(const trace::TrainingNeed& n,
                                       const strategies::StepEffects& e, const RankModel& rank) {
  return saved_shares(n, e.recompute_blocks, rank);
}

void MemoryModel::make_stage_figures(NeedEntry& entry, const RankModel& rank,
                                     int64_t recompute_blocks) {
  entry.stage_saved = saved_shares(entry.need, recompute_blocks, rank);
  entry.stage_gradients = stage_gradient_bytes(entry.need, rank);
  entry.highs = stage_highs_of(entry.need, rank);
  entry.stage_figures_made = true;
}

std::vector<int64_t> stage_gradient_bytes(const trace::TrainingNeed& n, const RankModel& rank) {
  const int64_t per_parameter = n.memory.gradients / std::max<int64_t>(1, n.parameters);
  const int64_t per_block = checked_mul(n.parameters_per_block, per_parameter, "block gradients");
  return stage_shares(n.memory.gradients, per_block, per_block, 0, rank);
}

MemoryPrediction MemoryModel::predict_rank(const Candidate& c, const RankModel& rank,
                                           bool made_only, LastNeed* last) {
  // The candidate's effects: the rank's are the same but for the blocks recomputed, which enter
  // through the activation options (rank_effects, not copied here: this runs for each rank of
  // 10^5 candidates).
  const strategies::StepEffects& e = c.effects;
  const trace::TraceOptions activations = rank_activation_options(e, rank);
  const RankTraceKey key{rank.trace_id, activations.key_fields()};
  // The micro-batches expected of the rank's trace under these options (expect), for the needs
  // it makes.
  const std::set<int64_t>* batches = nullptr;
  if (!made_only && !expected_.empty()) {
    const auto it = expected_.find(key);
    if (it != expected_.end()) batches = &it->second;
  }
  // The model as the candidate's rank runs it (its stages, its tensor-parallel shards, its share
  // of the sequence), which the data-parallel methods then shard over dp x cp.
  const trace::ModelRef& model = rank.model;
  auto entry_of = [&](int64_t micro_batch, std::optional<double> in_flight,
                      bool accumulated) -> NeedEntry& {
    if (!made_only) {
      return this->need(model, rank.trace_id, micro_batch, activations, in_flight, accumulated,
                        batches);
    }
    const auto it =
        needs_.find(need_key(rank.trace_id, micro_batch, activations, in_flight, accumulated));
    if (it == needs_.end()) throw NotMade{};
    return it->second;
  };
  auto need = [&](int64_t micro_batch, std::optional<double> in_flight = std::nullopt,
                  bool accumulated = false) -> const trace::TrainingNeed& {
    return entry_of(micro_batch, in_flight, accumulated).need;
  };
  NeedEntry& entry = last != nullptr && last->entry != nullptr && last->key == key
                         ? *last->entry
                         : entry_of(c.micro_batch, std::nullopt, false);
  if (last != nullptr) *last = LastNeed{key, &entry};
  const trace::TrainingNeed& n = entry.need;
  const int64_t W = c.data_parallel_ranks();
  const int64_t P = n.memory.parameters, G = n.memory.gradients, O = n.memory.optimizer_state;
  // Gradients and activations at the step's peak (the trace's figure, one rank, whole model,
  // gradients starting from none). With several micro-batches the later ones run with the
  // accumulated gradients resident (whole: nothing is synchronised or sharded before the last
  // micro-batch), so their activations peak on top of all of G, with the gradient each makes
  // before it is added in (the trace's accumulating peak).
  int64_t live = n.memory.peak - P - O;
  if (e.micro_batches > 1) live = std::max(live, G + n.memory.accumulating_peak);
  MemoryPrediction m;
  if (!rank.stages.empty()) {
    // A pipeline rank: its schedule holds several forwards in flight through its stages, of which
    // the trace (one micro-batch through each stage, forwards then backwards) holds one each. A
    // stage saves its blocks' share (the trace's per-block figures, recomputed blocks apart) and,
    // on the first or last stage, the model's ends (embedding; head and loss): interleaved, the
    // last stage's logits make a rank's stages unequal.
    // The stages' saved and gradient bytes and the timeline over each stage, once per need.
    if (!entry.stage_figures_made) {
      if (made_only) throw NotMade{};
      make_stage_figures(entry, rank, activations.recompute_blocks);
    }
    const std::vector<int64_t>& saved = entry.stage_saved;
    const std::vector<int64_t>& grads = entry.stage_gradients;
    const size_t V = saved.size();
    // Each action's in-flight activations beyond the trace's one micro-batch a stage.
    auto beyond_trace = [&](const std::vector<int>& in_flight) {
      int64_t extra = 0;
      for (size_t t = 0; t < V; ++t) {
        extra = checked_add(extra, checked_mul(in_flight[t] - 1, saved[t], "in-flight bytes"),
                            "in-flight bytes");
      }
      return std::max<int64_t>(0, extra);
    };
    m.in_flight_activations = 0;
    for (const StageAction& a : rank.actions) {
      m.in_flight_activations = std::max(m.in_flight_activations, beyond_trace(a.in_flight));
    }
    const std::optional<std::vector<trace::StageHighs>>& highs = entry.highs;
    if (highs) {
      // The step peaks at one of the rank's actions: what every stage's in-flight micro-batches
      // saved, the gradients of the stages whose backward has run, and the action's own excess:
      // the trace's highest point over that stage's forward or backward less what the trace held
      // then (the earlier stages' saved bytes; in a backward, the later stages' gradients too).
      // A backward whose stage's gradients are held (an earlier micro-batch's) adds each
      // gradient it makes into them (the accumulating timeline). A recomputed stage's transient
      // so lands at its own backward, among that moment's in-flight counts (the trace's peak
      // plus the most in flight, as below, was -8.7 % to +6.2 % off on such interleaved ranks),
      // and at the trace's own counts each action's figure is the trace's.
      live = 0;
      for (const StageAction& a : rank.actions) {
        const auto s = static_cast<size_t>(a.stage);
        int64_t held = 0, earlier = 0, later_grads = 0;
        for (size_t t = 0; t < V; ++t) {
          held = checked_add(held, checked_mul(a.in_flight[t], saved[t], "in-flight bytes"),
                             "in-flight bytes");
          if (a.gradients[t]) held = checked_add(held, grads[t], "held gradient bytes");
          if (t < s || (a.backward && t == s)) {
            earlier = checked_add(earlier, saved[t], "saved bytes");
          }
          if (t > s) later_grads = checked_add(later_grads, grads[t], "gradient bytes");
        }
        const trace::StageHighs& h = (*highs)[s];
        int64_t excess = 0;
        // Differences of non-negative figures, each checked as it was made: no overflow.
        if (!a.backward) {  // its own micro-batch is in `held`
          excess = h.forward - checked_add(earlier, saved[s], "saved bytes");
        } else if (!a.gradients[s]) {
          excess = h.backward - checked_add(earlier, later_grads, "held bytes");
        } else {
          excess = h.backward_accumulating - earlier;
        }
        live = std::max(live, checked_add(held, excess, "live bytes"));
      }
    } else {
      // Else the trace's peak with the most in flight beyond it: at the rank's first backward,
      // before any gradient is held; after it, with every gradient held (all of G and the
      // accumulating peak) less those of the stages whose backward has not begun.
      bool backward_seen = false;
      int64_t first = 0, later = 0;
      bool any_later = false;
      for (const StageAction& a : rank.actions) {
        if (!backward_seen) {
          if (a.backward) first = beyond_trace(a.in_flight);
          backward_seen = a.backward;
          continue;
        }
        int64_t missing = 0;
        for (size_t t = 0; t < V; ++t) {
          const bool held = a.gradients[t] || (a.backward && static_cast<int>(t) == a.stage);
          missing += held ? 0 : grads[t];
        }
        const int64_t extra = beyond_trace(a.in_flight);
        if (!any_later || extra - missing > later) later = extra - missing;
        any_later = true;
      }
      live = n.memory.peak - P - O + first;
      if (e.micro_batches > 1 && any_later) {
        live = std::max(live, G + n.memory.accumulating_peak + later);
      }
    }
    const auto v = static_cast<int64_t>(rank.stages.size());
    // The receives Pipeline::run posts ahead (one stage a rank, or more than 2 ranks): the next
    // forward's input (but on the first stage alone) and the next backward's gradient (but on
    // the last stage alone).
    int64_t posted = 0;
    if (v == 1 || c.mesh.pp > 2) {
      posted = ((v == 1 && rank.first) ? 0 : rank.message_bytes) +
               ((v == 1 && rank.last) ? 0 : rank.message_bytes);
    }
    live = checked_add(live, posted, "live bytes");
  }
  const int64_t elem = P / std::max<int64_t>(1, n.parameters);  // bytes per parameter
  const int64_t block_bytes = checked_mul(n.parameters_per_block, elem, "block bytes");
  const int64_t root_bytes = P - checked_mul(block_bytes, n.num_layers, "blocks' bytes");
  auto shard = [W](int64_t x) { return (x + W - 1) / W; };
  m.parameters = e.shard_parameters ? shard(P) : P;
  m.gradients = e.shard_gradients ? shard(G) : G;
  m.optimizer_state = e.shard_optimizer_state ? shard(O) : O;
  m.activations_peak = n.memory.activations_peak;
  const int64_t resident = m.parameters + m.gradients + m.optimizer_state;
  if (e.shard_parameters) {
    // Sharded parameters (fsdp) follow their own timeline (strategies/fsdp.cpp), checked against
    // the allocator's peak per step (tests/search/space_mpi_test.cpp). On top of the shards:
    // the root unit (gathered for the step) and one gathered block (the forward's gather is freed
    // by its post-hook before backward gathers the block again: the declared gathered_blocks
    // counts both). Each block's gradients are packed, reduce-scattered and freed when its
    // backward ends, with one reduction in flight (fsdp's kReducesInFlight): the trace's
    // blockwise timeline. What stays in flight is the packed buffer (half of it in bf16), the
    // ring's partial sums (min(2, W - 2) chunks of 1/W) and, in bf16, the output chunk.
    const int64_t gathered = std::min(e.gathered_blocks, 1) * block_bytes;
    m.buffers = root_bytes + gathered;
    const double in_flight = sharded_in_flight(e, W);
    const int64_t base = resident + m.buffers;
    if (e.micro_batches == 1) {
      m.peak = base + need(c.micro_batch, in_flight).blockwise_live_peak;
      return m;
    }
    // Gradient accumulation: the micro-batches that do not synchronise keep every whole gradient
    // (the first as the whole-model trace makes them; the middle ones on top of them, adding
    // into them), and the last one reduces block by block on top of them.
    m.peak = base + (n.memory.peak - P - O);
    if (e.micro_batches > 2) m.peak = std::max(m.peak, base + G + n.memory.activations_peak);
    const trace::TrainingNeed& last = need(c.micro_batch, in_flight, true);
    m.peak = std::max(m.peak, base + last.blockwise_live_peak);
    return m;
  }
  if (e.gradient_buckets) m.buffers += G;  // bucket padding is at most a few elements
  if (e.buckets_in_flight > 0) {
    m.buffers += std::min(checked_mul(e.buckets_in_flight, e.bucket_bytes, "buckets"), G);
  }
  m.peak = m.parameters + m.optimizer_state + (live - G + m.gradients) + m.buffers;
  // The end of backward, activations gone: the last bucket launches with its bf16 copy when the
  // communication is bf16 (all-reduce buckets keep every bucket's copy until the step's wait, to
  // copy the sums back). The parameters' own gradients are gone when the buckets took them.
  if (e.bucket_bytes > 0) {
    const int64_t copies = e.gradient_buckets ? G : std::min(e.bucket_bytes, G);
    const int64_t copy = e.bf16_communication ? copies / 2 : 0;
    const int64_t own = e.buckets_take_gradients ? 0 : m.gradients;
    m.peak = std::max(m.peak, m.parameters + m.optimizer_state + own + m.buffers + copy);
  }
  // After the step: the resident state plus the parameter copies of the all-gather.
  const int64_t after_step = m.parameters + m.optimizer_state + m.gradients +
                             checked_mul(e.parameter_copies_after_step, P, "gathered copies");
  m.peak = std::max(m.peak, after_step);
  return m;
}

}  // namespace acc::search
