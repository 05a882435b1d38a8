#pragma once
// acc-run's policy, as a library (elastic/README.md): launch the job through mpirun on the nodes
// of a hostfile, watch it end, decide which nodes are lost (a health check: mpirun starting one
// process there), relaunch on the nodes left while at least the minimum remain, up to a number of
// restarts, and keep an incident log (JOB/incidents.jsonl).

#include <string>
#include <utility>
#include <vector>

namespace acc::elastic {

struct LaunchOptions {
  std::vector<std::string> nodes;  // the hostfile's, in order
  int min_nodes = 1, max_nodes = 1;
  int nproc_per_node = 1;
  int max_restarts = 0;
  std::string job_dir;
  std::vector<std::string> command;      // the program and its arguments
  std::vector<std::string> mpirun_args;  // passed to every mpirun before the hosts
  std::string mpirun = "mpirun";
  double health_timeout_s = 10.0;
};

/// Host names of an OpenMPI-style hostfile ("host [slots=N]" per line, '#' comments), in order.
/// Throws acc::IoError when it cannot be read, acc::ValueError naming the line for a repeated or
/// malformed host, or when it names none.
std::vector<std::string> read_hostfile(const std::string& path);

/// "MIN:MAX" or "N" (MIN = MAX = N), 1 <= MIN <= MAX; acc::ValueError naming the text otherwise.
std::pair<int, int> parse_nnodes(const std::string& text);

/// The mpirun command line of attempt `attempt` on `nodes`: the ranks spread nproc_per_node per
/// node, the job directory and attempt number exported, and every ACC_* variable of acc-run's
/// environment (ACC_FAULT, ACC_HANG_TIMEOUT_SEC, ...), OPENBLAS_NUM_THREADS and OMP_NUM_THREADS
/// forwarded.
std::vector<std::string> mpirun_command(const LaunchOptions& o,
                                        const std::vector<std::string>& nodes, int attempt);

/// Runs the job to its end under the policy above; returns acc-run's exit code: 0 when an attempt
/// finished with 0, else the last attempt's exit code (1 when it ended by a signal or fewer than
/// min_nodes nodes are left).
int run_elastic(const LaunchOptions& o);

}  // namespace acc::elastic
