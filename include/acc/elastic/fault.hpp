#pragma once
// Fault injection for the elastic and checkpoint tests:
// ACC_FAULT=ACTION:rank=R:step=S[:phase=P|:point=P][:factor=F], several separated by ';'
// (elastic/README.md).
//   kill       rank R sends itself SIGKILL
//   stall      rank R stops making progress right before it issues its next collective (its
//              training thread sleeps for good; the process and its watchdog stay alive), as a
//              rank stuck in compute would; when a step begins with no collective issued since
//              the stall was reached (a one-rank job), it stops there
//   slow       every step of rank R from step S on takes F times as long (1 < F <= 1000)
//   kill-node  every rank on R's node (ACC_NODE, else the host name) sends itself SIGKILL
// The fault is reached at step S (the training loop's progress::step), or with phase=P at the
// first mark of phase P (forward, backward, update, collective, save, load) at step S or later; a
// load counts as the step of the checkpoint loaded (load:step=4 fires loading a checkpoint of step
// 4 or later, on a resume). With point=P (kill and kill-node only) it is reached inside a
// checkpoint save of step S or later, at P (progress::Point): mid_write (rank R's shard, after a
// chunk), before_rename or after_rename (the committing rank, rank 0, around the step
// directory's rename); these replace ACC_CKPT_CRASH. A fault that fires is remembered in the job
// directory by its text (JOB/faults/fired-<hash of the text>): a job restarted with the same
// directory does not inject it again, whatever its place in the list.

#include <optional>
#include <string>
#include <vector>

#include "acc/util/progress.hpp"

namespace acc::elastic {

enum class FaultAction { kKill, kStall, kSlow, kKillNode };

/// The largest slow factor: a step takes at most this many times as long (its sleep stays a few
/// step times, never past what a clock holds: 1e308 overflowed the sleep, which then did nothing).
/// A rank slowed more is stalled, which `stall` injects.
inline constexpr double kMaxSlowFactor = 1000;

const char* fault_action_name(FaultAction a);

struct FaultSpec {
  FaultAction action = FaultAction::kKill;
  int rank = 0;
  int64_t step = 0;
  std::optional<progress::Phase> phase;
  std::optional<progress::Point> point;  // kill and kill-node only; never with a phase
  double factor = 1.0;                   // slow only
  std::string text;                      // as written, for logs
};

/// Parses ACC_FAULT's grammar. Throws acc::ValueError naming the spec and the bad part: an
/// unknown action, key, phase or point, a key given twice, a missing rank or step, a negative
/// number, a slow factor not above 1 or above kMaxSlowFactor, a factor on another action, a point
/// on an action other than kill and kill-node or with a phase, or a spec listed twice.
std::vector<FaultSpec> parse_faults(const std::string& text);

}  // namespace acc::elastic
