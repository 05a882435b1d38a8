#pragma once
// What a node offers the ranks of a job on it. acc::usable_cores() is one process's view: under
// mpirun's default binding (a core of its own per rank, at 2 ranks or fewer) each rank may run on
// one core, and "local ranks x threads > my cores" then called a node with a core per rank
// oversubscribed. The node's ranks are counted together here.

#include "acc/dist/process_group.hpp"

namespace acc::dist {

struct NodeCores {
  int ranks = 1;  // ranks of the group on this node (those with this host name)
  int cores = 1;  // CPUs in the union of their affinity masks, capped by the CPU quota
};

/// This rank's node as every rank of `group` describes itself (host name, affinity mask): one
/// all-gather of a short text, a collective with the group's usual timeout. Ranks are on one node
/// when their host names agree.
NodeCores node_cores(ProcessGroup& group);

}  // namespace acc::dist
