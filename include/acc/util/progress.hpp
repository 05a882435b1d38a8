#pragma once
// What the training thread is doing, for whoever watches it: the training loop marks each step,
// the Trainer its phases, a process group each collective it issues, checkpoints their saves and
// loads, modules (forward) and gradient ops (backward) the module they compute in. The hang
// detector (acc/elastic/agent.hpp) turns the marks into progress and the phase a stalled rank was
// in; fault injection (ACC_FAULT) fires at them. Without a listener a mark costs one atomic load.
//
// Points are marks of another kind: places inside a checkpoint save where the crash tests kill a
// rank (ACC_FAULT kill:rank=R:step=S:point=P, elastic/README.md). They live here, in the lowest
// layer, because the checkpoint library that reaches them sits below the elastic agent that arms
// them: the checkpoint marks its points, the agent listens, and neither includes the other.

#include <cstdint>
#include <memory>
#include <string>

namespace acc::progress {

enum class Phase { kForward, kBackward, kUpdate, kCollective, kSave, kLoad };

/// "forward", "backward", "update", "collective", "save", "load".
const char* phase_name(Phase p);

/// Places inside a checkpoint save (checkpoint/README.md, "Commit"):
///   kMidWrite      a rank's shard file: after each chunk it writes
///   kBeforeRename  the committing rank (rank 0): metadata.json written, the step directory not
///                  yet renamed into place
///   kAfterRename   the committing rank: renamed (the step is committed), `latest` not yet moved
enum class Point { kMidWrite, kBeforeRename, kAfterRename };
inline constexpr Point kPoints[] = {Point::kMidWrite, Point::kBeforeRename, Point::kAfterRename};

/// "mid_write", "before_rename", "after_rename".
const char* point_name(Point p);

class Listener {
 public:
  virtual ~Listener() = default;
  /// Step `step` of the training loop begins.
  virtual void on_step(int64_t step) = 0;
  /// The marking thread enters `phase`; `what` says more ("allreduce seq 12 of group 'world'").
  virtual void on_phase(Phase phase, const std::string& what) = 0;
  /// The marking thread now computes inside module `name` (a dotted path, "" outside any).
  virtual void on_module(const std::string& name) = 0;
  /// The collective the thread marked last is issued (in its group's flight recorder).
  virtual void on_issued() = 0;
  /// The save of checkpoint step `step` reached `point`, on any thread (an async save writes and
  /// commits on a thread of its own).
  virtual void on_point(Point point, int64_t step) = 0;
};

/// The process's one listener (nullptr: none). Marks already under way finish with the old one.
void set_listener(std::shared_ptr<Listener> listener);

void step(int64_t step);
void phase(Phase p);
/// The module the thread computes in: forward marks each module as it is called and left (the
/// scope stack of acc/tensor/observer.hpp), backward each gradient op's module as it runs, so that
/// a hang report can say "in backward of transformer.h.7.mlp".
void module(const std::string& name);
/// After phase(kCollective, ...): the collective is recorded and issued. A rank whose last mark is
/// a collective not issued stopped right before it.
void issued();
/// The save of step `step` reached `p` (any thread).
void point(Point p, int64_t step);
/// As phase(p), with `what` made only when someone listens.
template <class MakeWhat>
void phase(Phase p, MakeWhat&& make_what);

namespace detail {
bool listening();
void phase_with(Phase p, const std::string& what);
}  // namespace detail

template <class MakeWhat>
void phase(Phase p, MakeWhat&& make_what) {
  if (detail::listening()) detail::phase_with(p, make_what());
}

}  // namespace acc::progress
