#pragma once
// Every rank's placement table on every rank (entries without their tensors, gathered as text),
// for the coverage checks of dist::coverage_errors.

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "acc/dist/agreement.hpp"
#include "acc/dist/sharding.hpp"

namespace acc::test {

/// Rank r's entries at index r. Collective over `group`.
inline std::vector<dist::PlacementTable> every_rank_table(dist::ProcessGroup& group,
                                                          const dist::PlacementTable& mine) {
  nlohmann::json text = nlohmann::json::array();
  for (const auto& e : mine) {
    nlohmann::json j = {
        {"name", e.name},       {"param", e.param},        {"kind", static_cast<int>(e.kind)},
        {"field", e.field},     {"shape", e.global_shape}, {"offsets", e.box.offsets},
        {"sizes", e.box.sizes}, {"replica", e.replica},    {"replicas", e.replicas}};
    if (e.flat) j["flat"] = {e.flat->offset, e.flat->length};
    text.push_back(std::move(j));
  }
  std::vector<dist::PlacementTable> tables;
  for (const std::string& rank_text : dist::allgather_text(group, text.dump())) {
    dist::PlacementTable t;
    for (const auto& j : nlohmann::json::parse(rank_text)) {
      dist::PlacementEntry e;
      e.name = j.at("name");
      e.param = j.at("param");
      e.kind = static_cast<dist::TensorKind>(j.at("kind").get<int>());
      e.field = j.at("field");
      e.global_shape = j.at("shape").get<Shape>();
      e.box.offsets = j.at("offsets").get<std::vector<int64_t>>();
      e.box.sizes = j.at("sizes").get<std::vector<int64_t>>();
      e.replica = j.at("replica");
      e.replicas = j.at("replicas");
      if (j.contains("flat")) e.flat = dist::FlatRange{j["flat"][0], j["flat"][1]};
      t.push_back(std::move(e));
    }
    tables.push_back(std::move(t));
  }
  return tables;
}

}  // namespace acc::test
