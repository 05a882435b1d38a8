#pragma once
// acc-run's policy, as a library (elastic/README.md): launch the job through mpirun on the nodes
// of a hostfile, watch it end, decide which nodes are lost (a health check: mpirun starting one
// process there), relaunch on the nodes left while at least the minimum remain, up to a number of
// restarts, and keep an incident log (JOB/incidents.jsonl).
//
// Signals: mpirun and the ranks run in process groups of their own, so SIGTERM or SIGINT (Ctrl-C)
// reaches acc-run alone. acc-run forwards the first to mpirun (which passes SIGTERM to the ranks
// and ends), waits for the job to end, kills whatever is left after the grace period (mpirun's
// process group, then every process of the job, its children by the subreaper), and on a second
// signal does so at once; it then writes the incident (`what: stopped`, the signal) and exits
// 128 + the signal. Nothing of the job is left on any node: the processes on other nodes die with
// their daemons, whose lifeline to mpirun is gone.
//
// A launch failure (mpirun says it could not start the program: not there, not executable, a
// working directory that is not there) is not restartable: the same program fails the same way on
// every attempt. acc-run says so and stops with kLaunchFailedExitCode.

#include <string>
#include <utility>
#include <vector>

namespace acc::elastic {

/// acc-run's exit code after a launch failure, as a shell's for a command it cannot run.
inline constexpr int kLaunchFailedExitCode = 127;

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
  /// After a SIGTERM or SIGINT is forwarded to mpirun, how long the job has to end before it is
  /// killed (mpirun itself kills ranks that ignore its SIGTERM after a few seconds).
  double stop_grace_s = 5.0;
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

/// The variable through which acc-run tells a job its attempt: 0 at the first launch, n after the
/// n-th restart (mpirun_command exports it to every rank).
inline constexpr const char* kAttemptEnv = "ACC_RUN_ATTEMPT";

/// This job's attempt under acc-run (kAttemptEnv), 0 when it is unset (outside acc-run). Throws
/// acc::ValueError naming the variable and its value when it is not a non-negative integer.
int run_attempt();

/// Runs the job to its end under the policy above; returns acc-run's exit code: 0 when an attempt
/// finished with 0, 128 + the signal when acc-run was stopped by SIGTERM or SIGINT (its handlers
/// are installed for the call), kLaunchFailedExitCode after a launch failure, else the last
/// attempt's exit code (1 when it ended by a signal or fewer than min_nodes nodes are left).
/// Throws acc::ValueError for bad options (durations: finite, at most 7 days), acc::IoError when
/// the job directory cannot be made.
int run_elastic(const LaunchOptions& o);

}  // namespace acc::elastic
