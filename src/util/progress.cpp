#include "acc/util/progress.hpp"

#include <atomic>
#include <mutex>

namespace acc::progress {
namespace {

struct Slot {
  std::atomic<bool> active{false};
  std::mutex mu;
  std::shared_ptr<Listener> listener;
};

Slot& slot() {
  static Slot s;
  return s;
}

std::shared_ptr<Listener> current() {
  Slot& s = slot();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.listener;
}

}  // namespace

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kUpdate:
      return "update";
    case Phase::kCollective:
      return "collective";
    case Phase::kSave:
      return "save";
    case Phase::kLoad:
      return "load";
  }
  return "unknown";
}

const char* point_name(Point p) {
  switch (p) {
    case Point::kMidWrite:
      return "mid_write";
    case Point::kBeforeRename:
      return "before_rename";
    case Point::kAfterRename:
      return "after_rename";
  }
  return "unknown";
}

void set_listener(std::shared_ptr<Listener> listener) {
  Slot& s = slot();
  std::lock_guard<std::mutex> lock(s.mu);
  s.active = listener != nullptr;
  s.listener = std::move(listener);
}

void step(int64_t step) {
  if (!detail::listening()) return;
  if (auto l = current()) l->on_step(step);
}

void phase(Phase p) {
  if (detail::listening()) detail::phase_with(p, "");
}

void module(const std::string& name) {
  if (!detail::listening()) return;
  if (auto l = current()) l->on_module(name);
}

void issued() {
  if (!detail::listening()) return;
  if (auto l = current()) l->on_issued();
}

void point(Point p, int64_t step) {
  if (!detail::listening()) return;
  if (auto l = current()) l->on_point(p, step);
}

namespace detail {

bool listening() {
  return slot().active.load(std::memory_order_relaxed);
}

void phase_with(Phase p, const std::string& what) {
  if (auto l = current()) l->on_phase(p, what);
}

}  // namespace detail
}  // namespace acc::progress
