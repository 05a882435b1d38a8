#pragma once
// Dumps of a trace: JSON (nlohmann) and Graphviz DOT. Both use the trace's stable vertex ids and
// dotted names only, so the same model and inputs give byte-identical dumps on every rank and run.

#include <nlohmann/json.hpp>

#include <string>

#include "acc/trace/tracer.hpp"

namespace acc::trace {

/// {"model", "parameters", "inputs", "options", "vertices": [...], "edges": [...],
///  "summary": {flops, memory, communication, blocks, patterns}}. A communication vertex has
/// "comm": {"kind", "group", "group_size", "bytes", "peer"}; summary.communication is comm_stats:
/// [{"group", "kind", "group_size", "ops", "forward_bytes", "backward_bytes"}].
nlohmann::json to_json(const Trace& t);

/// digraph with one node per vertex (label: name, op, output shape, FLOPs, communication) and one
/// edge per tensor; forward ops are boxes, backward ops ellipses, parameters and inputs notes,
/// communication vertices drawn in bold blue.
std::string to_dot(const Trace& t);

}  // namespace acc::trace
