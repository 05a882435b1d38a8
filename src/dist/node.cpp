#include "acc/dist/node.hpp"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "acc/dist/agreement.hpp"
#include "acc/util/system.hpp"

namespace acc::dist {

NodeCores node_cores(ProcessGroup& group) {
  char buf[256] = {};
  const std::string host = ::gethostname(buf, sizeof(buf) - 1) == 0 ? buf : "unknown-host";
  const nlohmann::json me = {{"host", host}, {"cpus", affinity_cpus()}};
  NodeCores out;
  out.ranks = 0;
  std::set<int> all;
  for (const std::string& text : allgather_text(group, me.dump())) {
    const nlohmann::json r = nlohmann::json::parse(text);
    if (r.at("host") != host) continue;
    const auto cpus = r.at("cpus").get<std::vector<int>>();
    all.insert(cpus.begin(), cpus.end());
    ++out.ranks;
  }
  // The quota is the cgroup's, which the node's ranks share when they run in one (as under one
  // mpirun); an affinity the system did not report counts as one core.
  out.cores = capped_by_cpu_quota(std::max(1, static_cast<int>(all.size())));
  out.ranks = std::max(out.ranks, 1);
  return out;
}

}  // namespace acc::dist
