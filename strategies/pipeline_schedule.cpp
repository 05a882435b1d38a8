// Pipeline schedules: the builders (plain functions over micro-batches, as Megatron's
// schedules.py) and the validator that runs before any of them executes.

#include "acc/strategies/pipeline_schedule.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>

#include "acc/util/error.hpp"

namespace acc::strategies {

const char* schedule_kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  for (ScheduleKind k :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved}) {
    if (name == schedule_kind_name(k)) return k;
  }
  ACC_THROW(ValueError, "pipeline schedule '", name,
            "' is unknown (known: gpipe, 1f1b, interleaved)");
}

std::string to_string(const PipeAction& a, bool with_stage) {
  // Appended piece by piece: GCC 12 reports a false -Wrestrict overlap for "F" + to_string().
  std::string s(1, a.step == PipeStep::kForward ? 'F' : 'B');
  s += std::to_string(a.micro_batch);
  if (with_stage) {
    s += '@';
    s += std::to_string(a.stage);
  }
  return s;
}

std::string PipelineSchedule::to_string() const {
  std::ostringstream os;
  for (size_t r = 0; r < actions.size(); ++r) {
    os << "rank " << r << ":";
    for (const PipeAction& a : actions[r])
      os << " " << strategies::to_string(a, virtual_stages > 1);
    os << "\n";
  }
  return os.str();
}

namespace {

// Megatron's interleaved order: the k-th forward (or backward) of a rank runs micro-batch
// (k / (p v)) p + k % p through its chunk (k % (p v)) / p, counted from the last chunk for
// backwards. Micro-batches go p at a time through every chunk before the next p start.
PipeAction interleaved_action(PipeStep step, int k, int rank, int p, int v) {
  const int group = k % (p * v);
  int chunk = group / p;
  if (step == PipeStep::kBackward) chunk = v - 1 - chunk;
  return {step, (k / (p * v)) * p + k % p, chunk * p + rank};
}

}  // namespace

PipelineSchedule make_schedule(ScheduleKind kind, int ranks, int virtual_stages,
                               int micro_batches) {
  const char* name = schedule_kind_name(kind);
  ACC_CHECK(ranks >= 1, "pipeline schedule ", name, ": ranks must be >= 1, got ", ranks);
  ACC_CHECK(micro_batches >= 1, "pipeline schedule ", name, ": micro_batches must be >= 1, got ",
            micro_batches);
  if (kind == ScheduleKind::kInterleaved) {
    ACC_CHECK(virtual_stages >= 2, "pipeline schedule interleaved: virtual must be >= 2, got ",
              virtual_stages, " (with one stage per rank use 1f1b)");
    ACC_CHECK(micro_batches % ranks == 0, "pipeline schedule interleaved: micro_batches ",
              micro_batches, " must be a multiple of the pipeline's ", ranks,
              " ranks (micro-batches go through every virtual stage ", ranks, " at a time)");
  } else {
    ACC_CHECK(virtual_stages == 1, "pipeline schedule ", name, ": virtual must be 1, got ",
              virtual_stages, " (virtual stages need the interleaved schedule)");
  }
  PipelineSchedule s;
  s.kind = kind;
  s.ranks = ranks;
  s.virtual_stages = virtual_stages;
  s.micro_batches = micro_batches;
  s.actions.resize(static_cast<size_t>(ranks));
  s.max_in_flight.resize(static_cast<size_t>(ranks));
  const int m = micro_batches, p = ranks, v = virtual_stages;
  for (int r = 0; r < p; ++r) {
    auto& out = s.actions[static_cast<size_t>(r)];
    switch (kind) {
      case ScheduleKind::kGPipe:
        for (int i = 0; i < m; ++i) out.push_back({PipeStep::kForward, i, r});
        for (int i = 0; i < m; ++i) out.push_back({PipeStep::kBackward, i, r});
        s.max_in_flight[static_cast<size_t>(r)] = m;
        break;
      case ScheduleKind::kOneFOneB: {
        const int warmup = std::min(p - r - 1, m);
        for (int i = 0; i < warmup; ++i) out.push_back({PipeStep::kForward, i, r});
        for (int i = 0; i < m - warmup; ++i) {
          out.push_back({PipeStep::kForward, warmup + i, r});
          out.push_back({PipeStep::kBackward, i, r});
        }
        for (int i = m - warmup; i < m; ++i) out.push_back({PipeStep::kBackward, i, r});
        s.max_in_flight[static_cast<size_t>(r)] = std::min(p - r, m);
        break;
      }
      case ScheduleKind::kInterleaved: {
        const int total = m * v;
        const int warmup = m == p ? total : std::min(2 * (p - r - 1) + (v - 1) * p, total);
        for (int k = 0; k < warmup; ++k) {
          out.push_back(interleaved_action(PipeStep::kForward, k, r, p, v));
        }
        for (int k = 0; k < total - warmup; ++k) {
          out.push_back(interleaved_action(PipeStep::kForward, warmup + k, r, p, v));
          out.push_back(interleaved_action(PipeStep::kBackward, k, r, p, v));
        }
        for (int k = total - warmup; k < total; ++k) {
          out.push_back(interleaved_action(PipeStep::kBackward, k, r, p, v));
        }
        s.max_in_flight[static_cast<size_t>(r)] = std::min(warmup + 1, total);
        break;
      }
    }
  }
  return s;
}

namespace {

// One message of the pipeline: an activation (forward) or a gradient (backward) of a
// micro-batch, between two stages.
struct Message {
  PipeStep step;
  int micro_batch;
  int from_stage;
  bool operator<(const Message& o) const {
    return std::tie(step, micro_batch, from_stage) < std::tie(o.step, o.micro_batch, o.from_stage);
  }
  bool operator==(const Message& o) const = default;
};

std::string describe(const Message& m) {
  return std::string(m.step == PipeStep::kForward ? "the activation" : "the gradient") +
         " of micro-batch " + std::to_string(m.micro_batch) + " from stage " +
         std::to_string(m.from_stage);
}

std::string where(int rank, size_t index, const PipeAction& a) {
  return "rank " + std::to_string(rank) + " step " + std::to_string(index) + " (" +
         to_string(a, true) + ")";
}

// What an action receives (before it computes) and sends (after).
struct Io {
  bool receives = false, sends = false;
  Message in, out;
  int from_rank = -1, to_rank = -1;
};

Io io_of(const PipelineSchedule& s, const PipeAction& a) {
  Io io;
  const int last = s.num_stages() - 1;
  if (a.step == PipeStep::kForward) {
    if (a.stage > 0) {
      io.receives = true;
      io.in = {PipeStep::kForward, a.micro_batch, a.stage - 1};
      io.from_rank = s.rank_of_stage(a.stage - 1);
    }
    if (a.stage < last) {
      io.sends = true;
      io.out = {PipeStep::kForward, a.micro_batch, a.stage};
      io.to_rank = s.rank_of_stage(a.stage + 1);
    }
  } else {
    if (a.stage < last) {
      io.receives = true;
      io.in = {PipeStep::kBackward, a.micro_batch, a.stage + 1};
      io.from_rank = s.rank_of_stage(a.stage + 1);
    }
    if (a.stage > 0) {
      io.sends = true;
      io.out = {PipeStep::kBackward, a.micro_batch, a.stage};
      io.to_rank = s.rank_of_stage(a.stage - 1);
    }
  }
  return io;
}

}  // namespace

std::shared_ptr<const PipelineSchedule> checked_schedule(ScheduleKind kind, int ranks,
                                                         int virtual_stages, int micro_batches) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int, int>, std::shared_ptr<const PipelineSchedule>> checked;
  const auto key = std::make_tuple(static_cast<int>(kind), ranks, virtual_stages, micro_batches);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = checked.find(key); it != checked.end()) return it->second;
  }
  auto s = std::make_shared<const PipelineSchedule>(
      make_schedule(kind, ranks, virtual_stages, micro_batches));
  validate(*s);
  std::lock_guard<std::mutex> lock(mutex);
  constexpr size_t kMaxKept = 512;  // a search's distinct schedules; beyond, start over
  if (checked.size() >= kMaxKept) checked.clear();
  checked.emplace(key, s);
  return s;
}

void validate(const PipelineSchedule& s) {
  const int p = s.ranks, S = s.num_stages(), m = s.micro_batches;
  ACC_CHECK(p >= 1 && s.virtual_stages >= 1 && m >= 1, "pipeline schedule: ranks ", p, ", virtual ",
            s.virtual_stages, " and micro_batches ", m, " must all be >= 1");
  ACC_CHECK(
      static_cast<int>(s.actions.size()) == p && static_cast<int>(s.max_in_flight.size()) == p,
      "pipeline schedule: ", s.actions.size(), " action lists and ", s.max_in_flight.size(),
      " in-flight bounds for ", p, " ranks");
  // Each rank on its own: stages, duplicates, order of forward and backward, in-flight bound.
  // What a rank has run, by (step, micro-batch, stage): flat, as the search validates schedules
  // of pp 64 x hundreds of micro-batches (a std::set of them took 10 ms a schedule).
  const auto slots = static_cast<size_t>(2) * static_cast<size_t>(m) * static_cast<size_t>(S);
  auto slot = [&](PipeStep step, int mb, int stage) {
    return (static_cast<size_t>(step == PipeStep::kForward ? 0 : 1) * static_cast<size_t>(m) +
            static_cast<size_t>(mb)) *
               static_cast<size_t>(S) +
           static_cast<size_t>(stage);
  };
  std::vector<char> seen;
  for (int r = 0; r < p; ++r) {
    const auto& list = s.actions[static_cast<size_t>(r)];
    seen.assign(slots, 0);
    int in_flight = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const PipeAction& a = list[i];
      ACC_CHECK(a.micro_batch >= 0 && a.micro_batch < m && a.stage >= 0 && a.stage < S,
                "pipeline schedule: ", where(r, i, a), " is outside ", m, " micro-batches and ", S,
                " stages");
      ACC_CHECK(s.rank_of_stage(a.stage) == r, "pipeline schedule: ", where(r, i, a),
                " runs stage ", a.stage, ", which rank ", s.rank_of_stage(a.stage), " holds");
      char& ran = seen[slot(a.step, a.micro_batch, a.stage)];
      ACC_CHECK(!ran, "pipeline schedule: ", where(r, i, a), " is listed twice");
      ran = 1;
      if (a.step == PipeStep::kBackward) {
        ACC_CHECK(seen[slot(PipeStep::kForward, a.micro_batch, a.stage)],
                  "pipeline schedule: ", where(r, i, a), " comes before its forward");
        --in_flight;
      } else {
        ++in_flight;
        ACC_CHECK(in_flight <= s.max_in_flight[static_cast<size_t>(r)],
                  "pipeline schedule: ", where(r, i, a), " holds ", in_flight,
                  " micro-batches in flight, the schedule ", "promises at most ",
                  s.max_in_flight[static_cast<size_t>(r)]);
      }
    }
    for (int st = r; st < S; st += p) {
      for (int mb = 0; mb < m; ++mb) {
        for (PipeStep step : {PipeStep::kForward, PipeStep::kBackward}) {
          ACC_CHECK(seen[slot(step, mb, st)], "pipeline schedule: rank ", r, " never runs ",
                    to_string(PipeAction{step, mb, st}, true), " (",
                    step == PipeStep::kForward ? "forward" : "backward", " of micro-batch ", mb,
                    " through stage ", st, ")");
        }
      }
    }
  }
  // Messages between each ordered pair of ranks, in the order each end lists them, with the
  // index of the action that lists them (named only in an error).
  std::map<std::pair<int, int>, std::vector<std::pair<Message, size_t>>> sent, received;
  for (int r = 0; r < p; ++r) {
    const auto& list = s.actions[static_cast<size_t>(r)];
    for (size_t i = 0; i < list.size(); ++i) {
      const Io io = io_of(s, list[i]);
      if (io.receives) received[{io.from_rank, r}].emplace_back(io.in, i);
      if (io.sends) sent[{r, io.to_rank}].emplace_back(io.out, i);
    }
  }
  auto listed = [&](int r, size_t i) { return where(r, i, s.actions[static_cast<size_t>(r)][i]); };
  for (const auto& [pair, recvs] : received) {
    const auto& sends = sent[pair];
    for (size_t n = 0; n < recvs.size() && n < sends.size(); ++n) {
      ACC_CHECK(recvs[n].first == sends[n].first,
                "pipeline schedule: unmatched message: ", listed(pair.second, recvs[n].second),
                " receives ", describe(recvs[n].first), " as message ", n, " from rank ",
                pair.first, ", but rank ", pair.first, "'s message ", n, " to rank ", pair.second,
                " is ", describe(sends[n].first), " (", listed(pair.first, sends[n].second), ")");
    }
  }
  // Run it: a receive waits for its message's send; sends never wait (the runtime posts them and
  // waits for them at the end of the step: dist::DeferredSends).
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::set<Message> posted;  // messages sent so far
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& list = s.actions[static_cast<size_t>(r)];
      auto& at = next[static_cast<size_t>(r)];
      for (; at < list.size(); ++at, progress = true) {
        const Io io = io_of(s, list[at]);
        if (io.receives && !posted.count(io.in)) break;
        if (io.sends) posted.insert(io.out);
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < p; ++r) {
    const auto& list = s.actions[static_cast<size_t>(r)];
    const size_t at = next[static_cast<size_t>(r)];
    if (at == list.size()) continue;
    const Io io = io_of(s, list[at]);
    stuck += "; " + where(r, at, list[at]) + " waits to receive " + describe(io.in) +
             " from rank " + std::to_string(io.from_rank);
  }
  ACC_CHECK(stuck.empty(), "pipeline schedule deadlocks", stuck);
}

double schedule_time(const std::vector<double>& per_micro_batch, int micro_batches,
                     int virtual_stages) {
  ACC_CHECK(!per_micro_batch.empty() && micro_batches >= 1 && virtual_stages >= 1,
            "schedule_time: needs a rank, micro_batches >= 1 and virtual_stages >= 1, got ",
            per_micro_batch.size(), " ranks, ", micro_batches, " and ", virtual_stages);
  double sum = 0, slowest = 0;
  for (const double t : per_micro_batch) {
    sum += t;
    slowest = std::max(slowest, t);
  }
  return micro_batches * slowest + (sum - slowest) / virtual_stages;
}

double simulated_schedule_time(const PipelineSchedule& schedule,
                               const std::vector<ActionCosts>& per_rank,
                               const std::function<double(int computing)>& slowdown) {
  const int p = schedule.ranks;
  const int S = schedule.num_stages();
  ACC_CHECK(per_rank.size() == static_cast<size_t>(p) && schedule.actions.size() == per_rank.size(),
            "simulated_schedule_time: the schedule has ", p, " ranks, got the costs of ",
            per_rank.size());
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const ActionCosts& c = per_rank[r];
    for (const double v : {c.forward_s, c.backward_s, c.forward_comm_s, c.backward_comm_s}) {
      ACC_CHECK(std::isfinite(v) && v >= 0,
                "simulated_schedule_time: an action's seconds must be finite and >= 0, got ", v,
                " for rank ", r);
    }
  }
  const size_t m = static_cast<size_t>(schedule.micro_batches);
  // When each (micro-batch, stage)'s forward and backward finished (-1: not yet).
  std::vector<double> forward_done(m * static_cast<size_t>(S), -1.0);
  std::vector<double> backward_done(m * static_cast<size_t>(S), -1.0);
  auto at = [S](const PipeAction& a) {
    return static_cast<size_t>(a.micro_batch) * static_cast<size_t>(S) +
           static_cast<size_t>(a.stage);
  };
  // Whether action `a`'s input has been sent: the stage before's forward, the stage after's
  // backward (and, for a backward, its own forward, which validate() puts before it on the rank).
  auto ready = [&](const PipeAction& a) {
    if (a.step == PipeStep::kForward) {
      return a.stage == 0 || forward_done[at(a) - 1] >= 0;
    }
    return a.stage == S - 1 || backward_done[at(a) + 1] >= 0;
  };
  enum class Phase { kWaiting, kCommunicating, kComputing, kDone };
  const size_t P = static_cast<size_t>(p);
  std::vector<Phase> phase(P, Phase::kWaiting);
  std::vector<size_t> next(P, 0);
  std::vector<double> until(P, 0), left(P, 0);
  double t = 0;
  for (;;) {
    // Every rank whose next action can start starts it (a zero-length phase passes at once).
    for (bool moved = true; moved;) {
      moved = false;
      for (size_t r = 0; r < P; ++r) {
        const auto& list = schedule.actions[r];
        if (phase[r] == Phase::kWaiting) {
          if (next[r] == list.size()) {
            phase[r] = Phase::kDone;
          } else if (ready(list[next[r]])) {
            const bool fwd = list[next[r]].step == PipeStep::kForward;
            phase[r] = Phase::kCommunicating;
            until[r] = t + (fwd ? per_rank[r].forward_comm_s : per_rank[r].backward_comm_s);
          }
        }
        if (phase[r] == Phase::kCommunicating && until[r] <= t) {
          const bool fwd = list[next[r]].step == PipeStep::kForward;
          phase[r] = Phase::kComputing;
          left[r] = fwd ? per_rank[r].forward_s : per_rank[r].backward_s;
        }
        if (phase[r] == Phase::kComputing && left[r] <= 0) {
          const PipeAction& a = list[next[r]];
          (a.step == PipeStep::kForward ? forward_done : backward_done)[at(a)] = t;
          ++next[r];
          phase[r] = Phase::kWaiting;
          moved = true;
        }
      }
    }
    int computing = 0;
    double dt = std::numeric_limits<double>::infinity();
    for (size_t r = 0; r < P; ++r) {
      if (phase[r] == Phase::kComputing) ++computing;
      if (phase[r] == Phase::kCommunicating) dt = std::min(dt, until[r] - t);
    }
    double rate = 0;
    if (computing > 0) {
      const double slow = slowdown(computing);
      ACC_CHECK(std::isfinite(slow) && slow >= 1, "simulated_schedule_time: the slowdown of ",
                computing, " ranks computing at once must be finite and >= 1, got ", slow);
      rate = 1.0 / slow;
      for (size_t r = 0; r < P; ++r) {
        if (phase[r] == Phase::kComputing) dt = std::min(dt, left[r] / rate);
      }
    }
    if (!std::isfinite(dt)) {
      // Nothing communicates or computes: every rank is done, or the schedule deadlocks (which
      // validate() refuses before a schedule is handed out).
      for (size_t r = 0; r < P; ++r) {
        ACC_CHECK_INTERNAL(phase[r] == Phase::kDone, "simulated_schedule_time: rank ", r,
                           " waits forever at its action ", next[r], " (an unvalidated schedule)");
      }
      return t;
    }
    // The rank(s) that set dt finish their phase now exactly, the rest keep what is left.
    for (size_t r = 0; r < P; ++r) {
      if (phase[r] == Phase::kComputing) {
        left[r] = left[r] / rate <= dt ? 0 : left[r] - dt * rate;
      } else if (phase[r] == Phase::kCommunicating && until[r] - t <= dt) {
        until[r] = t + dt;
      }
    }
    t += dt;
  }
}

}  // namespace acc::strategies
