#pragma once
// A ring buffer of the last operations of a process group: what was called, with which sequence
// number and payload, when it was queued, started and finished, and its state. Dumped to the log
// when an operation times out, so that comparing the dumps of all ranks names the rank and the
// operation that stalled.
//
// Two kinds of sequence numbers: collectives count in the group's one sequence (every rank issues
// them in the same order), point-to-point messages in a sequence of their own per peer and
// direction: the n-th send from rank a to rank b on a group pairs with b's n-th recv from a. A
// rank waiting in "recv seq 14 from rank 1" is matched with rank 1's "send seq 14 to rank 2",
// whatever collectives either issued in between.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace acc::dist {

enum class RecordState { kQueued, kStarted, kCompleted, kFailed, kTimedOut };
/// "queued", "started", "completed", "failed", "timed_out" (the words of the JSON dumps).
const char* record_state_name(RecordState s);
/// Whether an operation in this state is still waited for: queued, started or timed out (a timed
/// out operation stays in flight: MPI may still complete it).
bool is_in_flight(RecordState s);

/// The direction of a point-to-point message, as seen by the rank that records it.
enum class P2PDirection { kSend, kRecv };
/// "send", "recv".
const char* p2p_direction_name(P2PDirection d);

struct FlightRecord {
  std::string group;
  /// The group's collective sequence number, or for a point-to-point message (p2p set) its number
  /// among the messages to (send) or from (recv) `peer`.
  uint64_t seq = 0;
  std::string op;
  int64_t bytes = 0;
  std::string dtype;
  int peer = -1;                    // root / src / dst where the op has one, as a rank of the group
  std::optional<P2PDirection> p2p;  // set for send and recv
  int tag = -1;                     // send / recv: the caller's tag
  double enqueue_ms = 0, start_ms = -1, end_ms = -1;  // since process start; -1: not yet
  RecordState state = RecordState::kQueued;
};

class FlightRecorder {
 public:
  /// Capacity from ACC_FLIGHT_RECORDER_SIZE (default 256).
  FlightRecorder();
  /// Adds an entry and returns its slot id for the updates below.
  size_t record(FlightRecord r);
  void mark_started(size_t id);
  void mark_finished(size_t id, RecordState state);
  /// Entries oldest first.
  std::vector<FlightRecord> entries() const;
  /// When the last entry finished (any final state), now_ms() time; -1 when none has. What a
  /// watchdog polls for progress without copying the entries.
  double last_finished_ms() const;
  /// [{"group", "seq", "op", "bytes", "dtype", "peer", "p2p" (send entries: "send", recv: "recv",
  /// collectives: null), "tag", "enqueue_ms", "start_ms", "end_ms", "state"}] oldest first.
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
