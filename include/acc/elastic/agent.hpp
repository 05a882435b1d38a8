#pragma once
// The per-rank elastic agent: a hang detector (a watchdog thread over the progress marks of
// acc/util/progress.hpp and the flight recorders of the process groups it watches) and the fault
// injection of ACC_FAULT (acc/elastic/fault.hpp). Works in any mpirun job, with or without
// acc-run. elastic/README.md has the whole story.
//
// On a hang (no progress for the timeout) each rank writes a report (its step, phase, module, and
// per watched group the last completed sequence number and the collectives in flight) to
// JOB/hang/<run>/rank-R.json, out of band (files, never the stuck communicator), waits up to the
// grace period for the others' reports, and the lowest rank that reported writes analysis.json
// (analyze_hang) and logs it: which ranks wait in which collective (op, sequence number, group) or
// message (send or recv, its own sequence number, peer), which rank lags and where it is, which
// ranks wrote nothing (stopped or dead). Every rank then
// ends its process with kHangExitCode, the hang detector's last resort, so the launcher restarts
// the job.

#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "acc/dist/process_group.hpp"

namespace acc::elastic {

/// A rank's exit code after a hang (EX_TEMPFAIL: try again).
inline constexpr int kHangExitCode = 75;

struct AgentOptions {
  /// Where reports and fault markers go: "" means ACC_JOB_DIR, else a new directory
  /// ./acc-job-<time>-<pid> that rank 0 names to every rank, made only when something is written
  /// to it. A directory given is made at start.
  std::string job_dir;
  /// A fixed hang timeout in seconds; default ACC_HANG_TIMEOUT_SEC, else learned
  /// (Agent::timeout_s). Like every duration here (and ACC_STRAGGLER_MIN_SEC), a finite number of
  /// seconds, at most 604800 (7 days, acc::kMaxDurationSeconds): a larger one is refused, not
  /// read as "no timeout".
  std::optional<double> hang_timeout_s;
  /// How long a rank that found a hang waits for the other ranks' reports.
  double grace_s = 2.0;
  /// Fault specs; default ACC_FAULT.
  std::optional<std::string> faults;
  /// report_stragglers compares the ranks every this many steps (0: never); default
  /// ACC_STRAGGLER_EVERY, else 50.
  std::optional<int64_t> straggler_every;
  /// A rank busier per step than this factor x the median of the others is a straggler; default
  /// ACC_STRAGGLER_FACTOR, else 1.5.
  std::optional<double> straggler_factor;
  /// ... when it is also busier by at least this many seconds per step: below it the difference
  /// costs the job nothing worth a warning, and millisecond steps are all noise (measured: ranks
  /// of a tiny model named at 0.004 s against 0.002 s); default ACC_STRAGGLER_MIN_SEC, else 0.01.
  std::optional<double> straggler_min_s;
};

class Agent {
 public:
  /// Starts the agent of this rank: a collective over `world` (the job directory, the run's id,
  /// every rank's node). Watches `world`'s flight recorder; installs itself as the progress
  /// listener. Throws acc::ValueError for a bad ACC_FAULT, ACC_STRAGGLER_EVERY or
  /// ACC_STRAGGLER_FACTOR, or a bad duration (ACC_HANG_TIMEOUT_SEC, ACC_STRAGGLER_MIN_SEC or the
  /// options' own: not finite, negative or above 7 days), acc::IoError when the job directory
  /// cannot be made.
  static std::unique_ptr<Agent> start(dist::ProcessGroupPtr world, AgentOptions options = {});
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  /// Also report this group's collectives (a trainer's data-parallel group, a mesh's groups).
  void watch(dist::ProcessGroupPtr group);
  const std::string& job_dir() const;
  /// The hang timeout now: the fixed one, else learned from the step times seen: 10 x the
  /// longest of the last 20 steps, at least 60 s; 600 s before 3 steps were seen and while a
  /// checkpoint is saved or loaded (first steps, dry-runs and saves are slow by nature).
  double timeout_s() const;
  /// Call after every step, on every rank (a collective over the world every straggler_every
  /// steps, nothing otherwise): compares the ranks' busy time per step (the step's time less the
  /// time blocked in collectives, median over the steps since the last comparison) and logs, on
  /// rank 0, each rank busier than straggler_factor x the median of the others (and by at least
  /// straggler_min_s). Returns those
  /// ranks (empty between comparisons).
  std::vector<int> report_stragglers();

  struct State;

 private:
  explicit Agent(std::shared_ptr<State> s);
  std::shared_ptr<State> s_;
};

/// The analysis of a hang from the ranks' reports (reports[r]: rank r's, nullopt when it wrote
/// none): {"summary": text, "groups": [{"group", "op", "seq", "waiting": [ranks], "lagging":
/// [{"rank", "last_completed_seq", "step", "phase", "what", "module", "entering"}]}],
/// "p2p": [{"group", "op" (send | recv), "seq", "rank", "peer", "tag", "peer_issued_seq",
/// "peer_last_completed_seq", "peer_waiting", "lagging": {...} when the peer has not issued the
/// matching message}], "not_reporting": [ranks], "partition", "culprits": [ranks]}. Collectives
/// are matched by the group's sequence number; a send or recv by its own number among the
/// messages between its two ranks ("rank 2 waits in recv seq 14 from rank 1 of group 'pp'; rank 1
/// last issued send seq 13 to rank 2 and is in ..."). Ranks are world ranks. A pure function, for
/// the tests.
nlohmann::json analyze_hang(const std::vector<std::optional<nlohmann::json>>& reports);

}  // namespace acc::elastic
