#include "acc/dist/flight_recorder.hpp"

#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"

namespace acc::dist {

const char* record_state_name(RecordState s) {
  switch (s) {
    case RecordState::kQueued:
      return "queued";
    case RecordState::kStarted:
      return "started";
    case RecordState::kCompleted:
      return "completed";
    case RecordState::kFailed:
      return "failed";
    case RecordState::kTimedOut:
      return "timed_out";
  }
  return "?";
}

bool is_in_flight(RecordState s) {
  return s == RecordState::kQueued || s == RecordState::kStarted || s == RecordState::kTimedOut;
}

const char* p2p_direction_name(P2PDirection d) {
  return d == P2PDirection::kSend ? "send" : "recv";
}

double FlightRecorder::now_ms() {
  static const auto start = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

FlightRecorder::FlightRecorder() {
  const int64_t cap = env::get_int("ACC_FLIGHT_RECORDER_SIZE", 256);
  ACC_CHECK(cap >= 1, "ACC_FLIGHT_RECORDER_SIZE must be >= 1, got ", cap);
  capacity_ = static_cast<size_t>(cap);
}

size_t FlightRecorder::record(FlightRecord r) {
  std::lock_guard<std::mutex> lock(mu_);
  r.enqueue_ms = now_ms();
  const size_t id = next_++;
  if (ring_.size() < capacity_) {
    ring_.push_back(std::move(r));
    ids_.push_back(id);
  } else {
    ring_[id % capacity_] = std::move(r);
    ids_[id % capacity_] = id;
  }
  return id;
}

void FlightRecorder::mark_started(size_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t slot = id % capacity_;
  if (slot < ring_.size() && ids_[slot] == id) {
    ring_[slot].start_ms = now_ms();
    ring_[slot].state = RecordState::kStarted;
  }
}

void FlightRecorder::mark_finished(size_t id, RecordState state) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t slot = id % capacity_;
  if (slot < ring_.size() && ids_[slot] == id) {
    ring_[slot].end_ms = now_ms();
    ring_[slot].state = state;
    last_finished_ms_ = ring_[slot].end_ms;
  }
}

double FlightRecorder::last_finished_ms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_finished_ms_;
}

std::vector<FlightRecord> FlightRecorder::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightRecord> out;
  const size_t n = ring_.size();
  const size_t first = next_ > n ? next_ - n : 0;
  for (size_t id = first; id < next_; ++id) out.push_back(ring_[id % capacity_]);
  return out;
}

nlohmann::json FlightRecorder::to_json() const {
  nlohmann::json arr = nlohmann::json::array();
  for (const FlightRecord& r : entries()) {
    arr.push_back({{"group", r.group},
                   {"seq", r.seq},
                   {"op", r.op},
                   {"bytes", r.bytes},
                   {"dtype", r.dtype},
                   {"peer", r.peer},
                   {"p2p", r.p2p ? nlohmann::json(p2p_direction_name(*r.p2p)) : nlohmann::json()},
                   {"tag", r.tag},
                   {"enqueue_ms", r.enqueue_ms},
                   {"start_ms", r.start_ms},
                   {"end_ms", r.end_ms},
                   {"state", record_state_name(r.state)}});
  }
  return arr;
}

void FlightRecorder::dump_to_log(const std::string& reason) const {
  logging::error("flight recorder dump: {}", reason);
  for (const auto& j : to_json()) logging::error("flight recorder: {}", j.dump());
}

}  // namespace acc::dist
