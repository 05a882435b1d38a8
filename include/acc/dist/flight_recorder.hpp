#pragma once
// A ring buffer of the last collectives of a process group: what was called, with which sequence
// number and payload, when it was queued, started and finished, and its state. Dumped to the log
// when a collective times out, so that comparing the dumps of all ranks names the rank and the
// collective that stalled.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace acc::dist {

struct FlightRecord {
  std::string group;
  uint64_t seq = 0;
  std::string op;
  int64_t bytes = 0;
  std::string dtype;
  int peer = -1;                                      // root / src / dst where the op has one
  double enqueue_ms = 0, start_ms = -1, end_ms = -1;  // since process start; -1: not yet
  std::string state = "queued";  // queued | started | completed | failed | timed_out
};

class FlightRecorder {
 public:
  /// Capacity from ACC_FLIGHT_RECORDER_SIZE (default 256).
  FlightRecorder();
  /// Adds an entry and returns its slot id for the updates below.
  size_t record(FlightRecord r);
  void mark_started(size_t id);
  void mark_finished(size_t id, const std::string& state);
  /// Entries oldest first.
  std::vector<FlightRecord> entries() const;
  /// When the last entry finished (any final state), now_ms() time; -1 when none has. What a
  /// watchdog polls for progress without copying the entries.
  double last_finished_ms() const;
  nlohmann::json to_json() const;
  /// Writes every entry to the log (one line each), with `reason` first.
  void dump_to_log(const std::string& reason) const;
  static double now_ms();

 private:
  mutable std::mutex mu_;
  std::vector<FlightRecord> ring_;
  std::vector<size_t> ids_;  // slot -> id stored there
  size_t next_ = 0;
  double last_finished_ms_ = -1;
  size_t capacity_;
};

}  // namespace acc::dist
