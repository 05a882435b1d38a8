#include "acc/trace/dump.hpp"

#include <sstream>

#include "acc/trace/passes.hpp"

namespace acc::trace {
namespace {

nlohmann::json tensor_json(const TensorInfo& t) {
  return {{"id", t.id},
          {"storage", t.storage},
          {"shape", t.shape},
          {"dtype", dtype_name(t.dtype)},
          {"bytes", t.nbytes}};
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

nlohmann::json to_json(const Trace& t) {
  const BoostGraph& g = t.graph.boost_graph();
  nlohmann::json vertices = nlohmann::json::array();
  for (auto [v, end] = boost::vertices(g); v != end; ++v) {
    const Vertex& vx = g[*v];
    nlohmann::json j = {{"id", vx.id},
                        {"kind", vertex_kind_name(vx.kind)},
                        {"op", vx.op},
                        {"name", vx.name},
                        {"scope", vx.scope},
                        {"phase", phase_name(vx.phase)},
                        {"index", vx.index},
                        {"flops", vx.flops},
                        {"bytes_read", vx.bytes_read},
                        {"bytes_written", vx.bytes_written},
                        {"saves_activations", vx.saves_activations}};
    if (vx.comm) {
      j["comm"] = {{"kind", comm_kind_name(vx.comm->kind)},
                   {"group", vx.comm->group},
                   {"group_size", vx.comm->group_size},
                   {"bytes", vx.comm->bytes},
                   {"peer", vx.comm->peer}};
    }
    j["inputs"] = nlohmann::json::array();
    for (const auto& ti : vx.inputs) j["inputs"].push_back(tensor_json(ti));
    j["outputs"] = nlohmann::json::array();
    for (const auto& ti : vx.outputs) j["outputs"].push_back(tensor_json(ti));
    vertices.push_back(std::move(j));
  }
  nlohmann::json edges = nlohmann::json::array();
  for (auto [e, end] = boost::edges(g); e != end; ++e) {
    edges.push_back({{"from", g[boost::source(*e, g)].id},
                     {"to", g[boost::target(*e, g)].id},
                     {"tensor", g[*e].tensor},
                     {"bytes", g[*e].nbytes}});
  }
  const ComputeEstimate c = estimate_compute(t);
  const MemoryEstimate m = estimate_memory(t);
  nlohmann::json mlp = nlohmann::json::array(), attn = nlohmann::json::array();
  for (const auto& p : find_mlp_patterns(t)) {
    mlp.push_back({{"scope", p.scope},
                   {"first", p.first},
                   {"activation", p.activation},
                   {"second", p.second}});
  }
  for (const auto& p : find_attention_patterns(t)) {
    attn.push_back({{"scope", p.scope}, {"qkv", p.qkv}, {"proj", p.proj}});
  }
  nlohmann::json scopes = nlohmann::json::object();
  for (const auto& [scope, st] : scope_stats(t)) {
    scopes[scope.empty() ? "<model>" : scope] = {{"forward_flops", st.forward_flops},
                                                 {"backward_flops", st.backward_flops},
                                                 {"bytes_read", st.bytes_read},
                                                 {"bytes_written", st.bytes_written},
                                                 {"ops", st.ops},
                                                 {"parameters", st.parameters}};
  }
  nlohmann::json communication = nlohmann::json::array();
  for (const auto& [key, st] : comm_stats(t)) {
    communication.push_back({{"group", key.first},
                             {"kind", comm_kind_name(key.second)},
                             {"group_size", st.group_size},
                             {"ops", st.ops},
                             {"forward_bytes", st.forward_bytes},
                             {"backward_bytes", st.backward_bytes}});
  }
  nlohmann::json inputs = nlohmann::json::array();
  for (const Shape& s : t.input_shapes) inputs.push_back(s);
  nlohmann::json out = {{"model", t.model_type},
                        {"parameters", t.num_parameters},
                        {"inputs", inputs},
                        {"options",
                         {{"backward", t.options.backward},
                          {"recompute", recompute_name(t.options.recompute)},
                          {"recompute_blocks", t.options.recompute_blocks},
                          {"bf16_activations", t.options.bf16_activations}}},
                        {"summary",
                         {{"forward_flops", c.forward_flops},
                          {"backward_flops", c.backward_flops},
                          {"memory",
                           {{"parameters", m.parameters},
                            {"gradients", m.gradients},
                            {"optimizer_state_adamw", m.optimizer_state},
                            {"activations_peak", m.activations_peak},
                            {"peak", m.peak}}},
                          {"mlp_patterns", mlp},
                          {"attention_patterns", attn}}},
                        {"scopes", scopes},
                        {"vertices", vertices},
                        {"edges", edges}};
  // Only where there is some: this JSON is what trace::model_trace_hash hashes, the key of every
  // checkpoint and strategy cache, so a field every dump gained would have changed the hash of
  // every model and orphaned them all (tests/checkpoint/v1_checkpoint_test.cpp checks a model's
  // hash against the one a release wrote).
  if (!communication.empty()) out["summary"]["communication"] = communication;
  return out;
}

std::string to_dot(const Trace& t) {
  const BoostGraph& g = t.graph.boost_graph();
  std::ostringstream os;
  os << "digraph trace {\n  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];\n";
  for (auto [v, end] = boost::vertices(g); v != end; ++v) {
    const Vertex& vx = g[*v];
    std::string label = vx.name;
    if (vx.kind == VertexKind::kOp) label += "\\n" + vx.op;
    if (!vx.outputs.empty()) label += "\\n" + to_string(vx.outputs.front().shape);
    if (vx.flops > 0) label += "\\n" + std::to_string(vx.flops) + " flops";
    if (vx.comm) {
      label += "\\n" + std::string(comm_kind_name(vx.comm->kind)) + " '" + vx.comm->group + "' x" +
               std::to_string(vx.comm->group_size) + " " + std::to_string(vx.comm->bytes) + " B";
    }
    const char* shape = vx.kind != VertexKind::kOp    ? "note"
                        : vx.phase == Phase::kForward ? "box"
                                                      : "ellipse";
    // Communication stands out: it is what a parallel layout adds to the graph.
    os << "  n" << vx.id << " [shape=" << shape << (vx.comm ? ", color=blue, penwidth=2" : "")
       << ", label=\"" << escape(label) << "\"];\n";
  }
  for (auto [e, end] = boost::edges(g); e != end; ++e) {
    os << "  n" << g[boost::source(*e, g)].id << " -> n" << g[boost::target(*e, g)].id
       << " [label=\"t" << g[*e].tensor << "\"];\n";
  }
  os << "}\n";
  return os.str();
}

}  // namespace acc::trace
