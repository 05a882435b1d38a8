#include "acc/trace/passes.hpp"

#include <boost/graph/topological_sort.hpp>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"

namespace acc::trace {
namespace {

// "a.b.c" -> {"a.b.c", "a.b", "a", ""}
std::vector<std::string> enclosing_scopes(const std::string& scope) {
  std::vector<std::string> out;
  std::string s = scope;
  while (!s.empty()) {
    out.push_back(s);
    const size_t dot = s.rfind('.');
    s = dot == std::string::npos ? "" : s.substr(0, dot);
  }
  out.push_back("");
  return out;
}

std::string parent_of(const std::string& scope) {
  const size_t dot = scope.rfind('.');
  return dot == std::string::npos ? "" : scope.substr(0, dot);
}

// Ops that only move or reshape data: patterns look through them.
bool passes_through(const std::string& op) {
  static const std::set<std::string> kinds = {"View", "Permute", "Slice",  "Expand", "Clone",
                                              "To",   "Split",   "Rotary", "Cat"};
  return kinds.count(op) > 0;
}

// Forward ops reachable from v by walking edges (in or out) through data-movement ops only.
std::vector<VertexId> reach(const BoostGraph& g, VertexId v, bool upstream) {
  std::vector<VertexId> found, stack{v};
  std::set<VertexId> seen{v};
  while (!stack.empty()) {
    VertexId cur = stack.back();
    stack.pop_back();
    auto visit = [&](VertexId n) {
      if (!seen.insert(n).second) return;
      const Vertex& vx = g[n];
      if (vx.kind != VertexKind::kOp || vx.phase != Phase::kForward) return;
      if (passes_through(vx.op)) {
        stack.push_back(n);
      } else {
        found.push_back(n);
      }
    };
    if (upstream) {
      for (auto [e, end] = boost::in_edges(cur, g); e != end; ++e) visit(boost::source(*e, g));
    } else {
      for (auto [e, end] = boost::out_edges(cur, g); e != end; ++e) visit(boost::target(*e, g));
    }
  }
  std::sort(found.begin(), found.end());
  return found;
}

// "|<dotted name><shape>" for each of m's parameters in named_parameters()'s order (pre-order,
// each tied tensor once), the names built in one buffer: find_blocks runs after every trace the
// search makes, and named_parameters()'s list of names was a twentieth of a plan-only search.
void append_signature(const nn::Module& m, std::string& path, std::vector<Tensor>& seen,
                      std::string& sig) {
  for (const auto& named : m.named_parameters(false)) {
    const Tensor& p = named.second;  // named, not bound: clang refuses to capture a binding
    if (std::any_of(seen.begin(), seen.end(), [&](const Tensor& o) { return o.is_same(p); })) {
      continue;
    }
    seen.push_back(p);
    sig += '|';
    sig += path;
    sig += named.first;
    sig += to_string(p.shape());
  }
  for (const auto& [name, child] : m.named_children()) {
    const size_t at = path.size();
    path += name;
    path += '.';
    append_signature(*child, path, seen, sig);
    path.resize(at);
  }
}

std::string param_signature(const nn::Module& m) {
  std::string sig = m.type_name(), path;
  std::vector<Tensor> seen;
  append_signature(m, path, seen, sig);
  return sig;
}

// The groups among m's children, then, in order, those inside each child that is not a block of
// one: a group inside a block is structure of that block (the linears of each transformer
// block), not a top-level repetition.
void add_block_groups(const nn::Module& m, const std::string& prefix,
                      std::vector<BlockGroup>& groups) {
  const auto children = m.named_children();
  // Each child's signature at most once, and only where a neighbour of the same type is compared
  // with it (a signature begins with its module's type name, which holds no '|'): the search runs
  // this after every trace it makes.
  std::vector<std::optional<std::string>> sigs(children.size());
  auto sig = [&](size_t k) -> const std::string& {
    if (!sigs[k]) sigs[k] = param_signature(*children[k].second);
    return *sigs[k];
  };
  auto alike = [&](size_t a, size_t b) {
    return children[a].second->type_name() == children[b].second->type_name() && sig(a) == sig(b);
  };
  auto path = [&](size_t k) {
    return prefix.empty() ? children[k].first : prefix + "." + children[k].first;
  };
  const bool is_list = m.type_name() == "ModuleList";
  std::vector<bool> in_block(children.size(), false);
  size_t i = 0;
  while (i < children.size()) {
    size_t j = i + 1;
    while (j < children.size() && alike(i, j)) ++j;
    const int64_t params = children[i].second->num_parameters();
    if (params > 0 && (j - i >= 2 || is_list)) {
      BlockGroup grp;
      grp.container = prefix;
      grp.type_name = children[i].second->type_name();
      grp.parameters_per_block = params;
      for (size_t k = i; k < j; ++k) {
        grp.blocks.push_back(path(k));
        in_block[k] = true;
      }
      groups.push_back(std::move(grp));
    }
    i = j;
  }
  for (size_t k = 0; k < children.size(); ++k) {
    if (!in_block[k]) add_block_groups(*children[k].second, path(k), groups);
  }
}

}  // namespace

std::map<std::string, ScopeStats> scope_stats(const Trace& t) {
  std::map<std::string, ScopeStats> out;
  const BoostGraph& g = t.graph.boost_graph();
  for (auto [v, end] = boost::vertices(g); v != end; ++v) {
    const Vertex& vx = g[*v];
    if (vx.kind == VertexKind::kParameter) {
      const std::string owner = parent_of(vx.name);
      const int64_t n = numel_of(vx.outputs.at(0).shape);
      for (const std::string& s : enclosing_scopes(owner)) {
        out[s].parameters = checked_add(out[s].parameters, n, "parameters of scope '", s, "'");
      }
      continue;
    }
    if (vx.kind != VertexKind::kOp) continue;
    for (const std::string& s : enclosing_scopes(vx.scope)) {
      ScopeStats& st = out[s];
      int64_t& flops = vx.phase == Phase::kForward ? st.forward_flops : st.backward_flops;
      flops = checked_add(flops, vx.flops, phase_name(vx.phase), " FLOPs of scope '", s, "'");
      st.bytes_read = checked_add(st.bytes_read, vx.bytes_read, "bytes read in scope '", s, "'");
      st.bytes_written =
          checked_add(st.bytes_written, vx.bytes_written, "bytes written in scope '", s, "'");
      st.ops += 1;
    }
  }
  return out;
}

std::vector<BlockGroup> find_blocks(const nn::Module& module) {
  std::vector<BlockGroup> top;
  add_block_groups(module, "", top);
  // Ordered by parameters in double: only the order matters, and a product too large for int64
  // must not stop the search for blocks.
  std::stable_sort(top.begin(), top.end(), [](const BlockGroup& a, const BlockGroup& b) {
    return static_cast<double>(a.parameters_per_block) * static_cast<double>(a.blocks.size()) >
           static_cast<double>(b.parameters_per_block) * static_cast<double>(b.blocks.size());
  });
  return top;
}

std::vector<MlpPattern> find_mlp_patterns(const Trace& t) {
  static const std::set<std::string> activations = {"Gelu", "Silu", "Relu", "Swiglu"};
  const BoostGraph& g = t.graph.boost_graph();
  std::vector<MlpPattern> out;
  for (VertexId v : t.graph.ops()) {
    const Vertex& act = g[v];
    if (act.phase != Phase::kForward || !activations.count(act.op)) continue;
    MlpPattern p;
    p.activation = act.op;
    for (VertexId u : reach(g, v, /*upstream=*/true)) {
      if (g[u].op == "Linear") p.first.push_back(g[u].scope);
    }
    for (VertexId w : reach(g, v, /*upstream=*/false)) {
      if (g[w].op == "Linear") p.second = g[w].scope;
    }
    if (p.first.empty() || p.second.empty()) continue;
    p.scope = parent_of(p.second);
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<AttentionPattern> find_attention_patterns(const Trace& t) {
  const BoostGraph& g = t.graph.boost_graph();
  std::vector<AttentionPattern> out;
  for (VertexId v : t.graph.ops()) {
    const Vertex& att = g[v];
    if (att.phase != Phase::kForward || att.op != "Attention") continue;
    AttentionPattern p;
    p.attention_op = att.op;
    for (VertexId u : reach(g, v, /*upstream=*/true)) {
      if (g[u].op == "Linear" && std::find(p.qkv.begin(), p.qkv.end(), g[u].scope) == p.qkv.end()) {
        p.qkv.push_back(g[u].scope);
      }
    }
    for (VertexId w : reach(g, v, /*upstream=*/false)) {
      if (g[w].op == "Linear") p.proj = g[w].scope;
    }
    if (p.qkv.empty() || p.proj.empty()) continue;
    p.scope = att.scope;
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<VertexId> topological_order(const Trace& t) {
  std::vector<VertexId> order;
  boost::topological_sort(t.graph.boost_graph(), std::back_inserter(order));
  std::reverse(order.begin(), order.end());
  return order;
}

Liveness liveness(const Trace& t) {
  const Graph& g = t.graph;
  Liveness out;
  std::map<uint64_t, size_t> index;  // storage -> position in out.storages
  const int64_t nops = static_cast<int64_t>(g.ops().size());
  out.live_after_op.assign(static_cast<size_t>(std::max<int64_t>(nops, 0)), 0);
  int64_t live = 0;
  size_t e = 0;
  const auto& events = g.memory_events();
  // Running total in event order (exact), sampled after each op.
  for (int64_t op = -1; op < nops; ++op) {
    for (; e < events.size() && events[e].op_index == op; ++e) {
      const MemoryEvent& ev = events[e];
      live = checked_add(live, ev.bytes, "bytes alive after op ", op);
      if (ev.bytes > 0) {
        StorageLife s;
        s.storage = ev.storage;
        s.bytes = ev.bytes;
        s.born = ev.op_index;
        if (g.parameter_storages().count(ev.storage)) {
          s.role = StorageLife::Role::kParameter;
        } else if (g.gradient_storages().count(ev.storage)) {
          s.role = StorageLife::Role::kGradient;
        } else if (g.input_storages().count(ev.storage)) {
          s.role = StorageLife::Role::kInput;
        }
        index[ev.storage] = out.storages.size();
        out.storages.push_back(s);
      } else if (auto it = index.find(ev.storage); it != index.end()) {
        out.storages[it->second].dies = ev.op_index;
      }
      if (live > out.peak_bytes) {
        out.peak_bytes = live;
        out.peak_op = std::min<int64_t>(op + 1, nops - 1);
      }
    }
    if (op >= 0) out.live_after_op[op] = live;
  }
  // Everything freed by the trace's own clean-up after the last op (parameters restored, the
  // meta gradients dropped) is alive at the end of the step.
  for (StorageLife& s : out.storages) {
    if (s.dies == nops - 1 && s.role != StorageLife::Role::kActivation) s.dies = -1;
  }
  const int64_t boundary = g.backward_begin();
  for (const StorageLife& s : out.storages) {
    if (s.role != StorageLife::Role::kActivation) continue;
    if (s.born < boundary && (s.dies < 0 || s.dies >= boundary - 1)) {
      out.saved_activation_bytes =
          checked_add(out.saved_activation_bytes, s.bytes, "activation bytes saved for backward");
    }
  }
  return out;
}

double optimizer_state_factor(const std::string& optimizer) {
  if (optimizer == "adamw" || optimizer == "adam") return 2.0;
  if (optimizer == "sgd_momentum") return 1.0;
  if (optimizer == "sgd") return 0.0;
  // Another optimizer's k parameter-sized buffers (optimizer_with_state_buffers).
  constexpr const char* kBuffers = "buffers:";
  if (optimizer.rfind(kBuffers, 0) == 0) {
    const std::string k = optimizer.substr(std::char_traits<char>::length(kBuffers));
    ACC_CHECK(!k.empty() && k.size() <= 6 && k.find_first_not_of("0123456789") == std::string::npos,
              "optimizer '", optimizer, "': expected buffers:<count>");
    return static_cast<double>(std::stoi(k));
  }
  ACC_THROW(ValueError, "unknown optimizer '", optimizer,
            "' (expected adamw, adam, sgd_momentum, sgd or buffers:<count>)");
}

std::string optimizer_with_state_buffers(int buffers) {
  ACC_CHECK(buffers >= 0, "an optimizer keeps >= 0 state buffers per parameter, got ", buffers);
  switch (buffers) {
    case 0:
      return "sgd";
    case 1:
      return "sgd_momentum";
    case 2:
      return "adamw";
    default:
      return "buffers:" + std::to_string(buffers);
  }
}

int64_t optimizer_state_bytes(const std::string& optimizer, int64_t parameter_bytes) {
  // The factors are whole numbers: exact in int64, and checked like every other byte count.
  return checked_mul(static_cast<int64_t>(optimizer_state_factor(optimizer)), parameter_bytes,
                     optimizer, " state bytes of the parameters");
}

MemoryEstimate estimate_memory(const Trace& t, const std::string& optimizer) {
  MemoryEstimate m;
  const Graph& g = t.graph;
  m.optimizer_state = optimizer_state_bytes(optimizer, t.parameter_bytes);
  int64_t live = 0, activations = 0;
  bool backward = false;
  for (const MemoryEvent& ev : g.memory_events()) {
    if (!backward && ev.op_index >= g.backward_begin()) {
      backward = true;
      m.activations_saved = activations;
    }
    const bool param = g.parameter_storages().count(ev.storage) > 0;
    const bool grad = g.gradient_storages().count(ev.storage) > 0;
    const bool input = g.input_storages().count(ev.storage) > 0;
    if (ev.bytes > 0) {
      if (param) m.parameters = checked_add(m.parameters, ev.bytes, "parameter bytes");
      if (grad) m.gradients = checked_add(m.gradients, ev.bytes, "gradient bytes");
    }
    live = checked_add(live, ev.bytes, "bytes alive in the step");
    if (!param && !grad && !input) {
      activations = checked_add(activations, ev.bytes, "activation bytes alive in the step");
    }
    m.activations_peak = std::max(m.activations_peak, activations);
    m.accumulating_peak = std::max(
        m.accumulating_peak, grad && ev.bytes > 0
                                 ? checked_add(activations, ev.bytes, "bytes of an accumulation")
                                 : activations);
    m.peak = std::max(m.peak, live);
  }
  if (!backward) m.activations_saved = activations;
  m.peak = checked_add(m.peak, m.optimizer_state, "peak bytes of the step");
  return m;
}

ComputeEstimate estimate_compute(const Trace& t) {
  ComputeEstimate c;
  for (VertexId v : t.graph.ops()) {
    const Vertex& vx = t.graph.vertex(v);
    int64_t& flops = vx.phase == Phase::kForward ? c.forward_flops : c.backward_flops;
    flops = checked_add(flops, vx.flops, phase_name(vx.phase), " FLOPs of the step");
  }
  return c;
}

int64_t ComputeEstimate::total() const {
  return checked_add(forward_flops, backward_flops, "FLOPs forward + backward");
}

std::map<std::pair<std::string, CommKind>, CommStats> comm_stats(const Trace& t) {
  std::map<std::pair<std::string, CommKind>, CommStats> out;
  std::map<std::string, int> sizes;
  for (VertexId v : t.graph.ops()) {
    const Vertex& vx = t.graph.vertex(v);
    if (!vx.comm) continue;
    const CommRecord& c = *vx.comm;
    const auto [size, fresh] = sizes.try_emplace(c.group, c.group_size);
    ACC_CHECK(fresh || size->second == c.group_size, "trace: group '", c.group,
              "' appears with sizes ", size->second, " and ", c.group_size, " (at ", vx.name, ")");
    CommStats& st = out[{c.group, c.kind}];
    st.group_size = c.group_size;
    st.ops += 1;
    int64_t& bytes = vx.phase == Phase::kForward ? st.forward_bytes : st.backward_bytes;
    bytes = checked_add(bytes, c.bytes, phase_name(vx.phase), " ", comm_kind_name(c.kind),
                        " bytes of group '", c.group, "'");
  }
  return out;
}

int64_t CommStats::bytes() const {
  return checked_add(forward_bytes, backward_bytes, "communication bytes forward + backward");
}

}  // namespace acc::trace
