#include "acc/checkpoint/export.hpp"

#include "acc/checkpoint/layout.hpp"
#include "acc/checkpoint/load.hpp"
#include "acc/io/safetensors.hpp"
#include "acc/util/error.hpp"

namespace acc::ckpt {

using dist::PlacementEntry;
using dist::TensorKind;

size_t export_safetensors(const std::string& step_dir, const std::string& out) {
  check_outside_checkpoints(out, "export-safetensors: the output");
  const Metadata m = read_metadata(step_dir);
  dist::PlacementTable table;
  io::NamedTensors params;
  for (const TensorInfo& t : m.tensors) {
    if (t.kind != TensorKind::kParameter) continue;
    PlacementEntry e;
    e.name = t.name;
    e.param = t.param;
    e.kind = TensorKind::kParameter;
    e.global_shape = t.shape;
    e.dtype = t.dtype;
    e.box = dist::Box::whole(t.shape);
    e.local = empty({t.numel()}, {t.dtype});
    table.push_back(e);
    params.emplace_back(t.name, e.local.view(t.shape));
  }
  load(step_dir, m, table);
  io::Metadata meta = {{"step", std::to_string(m.step)}};
  if (m.extra.contains("model_type") && m.extra.at("model_type").is_string()) {
    meta["model_type"] = m.extra.at("model_type").get<std::string>();
  }
  if (m.extra.contains("config")) meta["config"] = m.extra.at("config").dump();
  io::save_safetensors(out, params, meta);
  return params.size();
}

}  // namespace acc::ckpt
