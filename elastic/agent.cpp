#include "acc/elastic/agent.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "acc/dist/agreement.hpp"
#include "acc/dist/flight_recorder.hpp"
#include "acc/elastic/fault.hpp"
#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/hash.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/parse.hpp"
#include "acc/util/progress.hpp"
#include "job_files.hpp"

namespace acc::elastic {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using detail::wall_seconds;

namespace {

constexpr double kFloorS = 60.0;       // the learned timeout is never below this
constexpr double kAllowanceS = 600.0;  // first steps, saves and loads
constexpr double kFactor = 10.0;       // over the longest recent step
constexpr size_t kRecentSteps = 20;
constexpr int64_t kStepsBeforeLearning = 3;

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// The node this rank runs on: ACC_NODE (acc-run's rsh agent sets it for namespace "nodes", which
// share one host name), else the host name.
std::string node_name() {
  if (auto n = env::get("ACC_NODE")) return *n;
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

// This rank's listening endpoint, "ip,ip,...:port" (its IPv4 addresses, loopback when it has no
// other), or "" when no socket could be made (then nobody probes it).
std::string listen_endpoint(int& fd) {
  fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    fd = -1;
    return "";
  }
  std::string ips;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK)) {
        continue;
      }
      char buf[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf,
                  sizeof(buf));
      ips += (ips.empty() ? "" : ",") + std::string(buf);
    }
    ::freeifaddrs(list);
  }
  if (ips.empty()) ips = "127.0.0.1";
  return ips + ":" + std::to_string(ntohs(a.sin_port));
}

// Whether a TCP connection to any address of the endpoint completes within 1 s.
bool reachable(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos) return true;
  const int port = std::atoi(endpoint.c_str() + colon + 1);
  std::istringstream ips(endpoint.substr(0, colon));
  for (std::string ip; std::getline(ips, ip, ',');) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    bool ok = ::inet_pton(AF_INET, ip.c_str(), &a.sin_addr) == 1;
    if (ok && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ok = false;
      if (errno == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        int err = 0;
        socklen_t len = sizeof(err);
        ok = ::poll(&p, 1, 1000) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 &&
             err == 0;
      }
    }
    ::close(fd);
    if (ok) return true;
  }
  return false;
}

// The marker of a fault that fired: JOB/faults/fired-<FNV-1a of its text, 16 hex digits>.
std::string fired_marker_name(const std::string& text) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(fnv1a64(text)));
  return std::string("fired-") + hex;
}

// The texts of the faults that fired in earlier runs of the job, from their markers' contents
// (the name is only a hash).
std::set<std::string> fired_faults(const std::string& job_dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(fs::path(job_dir) / "faults", ec)) {
    const auto marker = detail::try_read_json(d.path());
    if (marker && marker->is_object() && marker->contains("fault") &&
        (*marker)["fault"].is_string()) {
      out.insert((*marker)["fault"].get<std::string>());
    }
  }
  return out;
}

// Where a rank's training thread is, as its hang report says: before its first step, at the start
// of a step, or in a phase the training loop marked. A collective is no phase of its own here: it
// is what the rank is about to issue (`entering`) within the phase it is in.
enum class RankPhase { kStart, kStep, kForward, kBackward, kUpdate, kSave, kLoad };

// "start", "step", and progress::phase_name's words for the others (the reports' "phase").
const char* rank_phase_name(RankPhase p) {
  switch (p) {
    case RankPhase::kStart:
      return "start";
    case RankPhase::kStep:
      return "step";
    case RankPhase::kForward:
      return progress::phase_name(progress::Phase::kForward);
    case RankPhase::kBackward:
      return progress::phase_name(progress::Phase::kBackward);
    case RankPhase::kUpdate:
      return progress::phase_name(progress::Phase::kUpdate);
    case RankPhase::kSave:
      return progress::phase_name(progress::Phase::kSave);
    case RankPhase::kLoad:
      return progress::phase_name(progress::Phase::kLoad);
  }
  return "?";
}

// The phase a mark puts the rank in; nullopt for a collective's mark (see RankPhase).
std::optional<RankPhase> rank_phase(progress::Phase p) {
  switch (p) {
    case progress::Phase::kForward:
      return RankPhase::kForward;
    case progress::Phase::kBackward:
      return RankPhase::kBackward;
    case progress::Phase::kUpdate:
      return RankPhase::kUpdate;
    case progress::Phase::kSave:
      return RankPhase::kSave;
    case progress::Phase::kLoad:
      return RankPhase::kLoad;
    case progress::Phase::kCollective:
      return std::nullopt;
  }
  return std::nullopt;
}

// Whether an in-flight entry of a report is a point-to-point message (numbered apart).
bool is_p2p(const nlohmann::json& entry) {
  return entry.contains("p2p") && entry["p2p"].is_string();
}

// Where a rank's report puts it: "is in backward of transformer.h.7.mlp at step 3, about to issue
// allreduce.sum seq 68 of group 'world'".
std::string where_text(const nlohmann::json& report) {
  std::string w = "is in " + report.value("phase", std::string("?"));
  if (const std::string m = report.value("module", std::string()); !m.empty()) w += " of " + m;
  if (const std::string what = report.value("what", std::string()); !what.empty()) {
    w += " (" + what + ")";
  }
  w += " at step " + std::to_string(report.value("step", int64_t{-1}));
  if (const std::string e = report.value("entering", std::string()); !e.empty()) {
    w += ", about to issue " + e;
  }
  return w;
}

}  // namespace

struct Agent::State : progress::Listener {
  // Set at start.
  int rank = 0, world = 1;
  std::vector<std::string> nodes;  // by rank
  std::string job_dir, run_dir;
  std::optional<double> fixed_timeout;
  double grace_s = 2.0;
  struct Pending {
    FaultSpec spec;
    bool fired = false;  // slow only: it stays, slowing every step from its first
    // Stall only: the step it was reached at; it then waits for the next collective.
    std::optional<int64_t> armed_at;
  };
  std::vector<Pending> faults;  // those not fired in an earlier run
  // Reachability: every rank listens on a TCP port (the kernel completes a connection without an
  // accept) and knows every rank's addresses and port; a hang report says which ranks it cannot
  // reach, which names a partition (a link down) for what it is.
  int listen_fd = -1;  // closed with the state (also when start() throws after opening it)
  ~State() override {
    if (listen_fd >= 0) ::close(listen_fd);
  }
  std::vector<std::string> endpoints;  // by rank: "ip,ip,...:port"

  mutable std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::thread watchdog;
  std::vector<dist::ProcessGroupPtr> groups;
  Clock::time_point last_progress = Clock::now();
  std::optional<Clock::time_point> step_started;
  std::deque<double> recent;  // step times, as the other ranks see them (slowness included)
  double last_work_s = 0;     // the last step's time without injected slowness
  double wait_at_step = 0;    // dist::wait_seconds() when the step began
  std::vector<double> busy;   // per step since the last straggler comparison: time not waiting
  int64_t straggler_every = 50, steps_to_compare = 0;
  // Under acc-run (ACC_RUN_ATTEMPT set), rank 0 keeps JOB/attempts/attempt-N/progress.json: the
  // attempt's first and last steps with their times, for acc-run's incident log.
  std::string progress_file;
  std::optional<std::pair<int64_t, double>> first_step;
  double straggler_factor = 1.5, straggler_min_s = 0.01;
  double injected_s = 0;  // slowness injected into the current step
  int64_t steps_seen = 0, step = -1;
  // Where the training thread is: its phase and what more the phase's mark said, the module it
  // computes in (forward and backward), and the collective or message it marked but has not
  // issued (a rank stopped right before issuing it).
  RankPhase phase = RankPhase::kStart;
  std::string what, module, entering;

  double timeout_locked() const {
    if (fixed_timeout) return *fixed_timeout;
    if (steps_seen < kStepsBeforeLearning || phase == RankPhase::kSave ||
        phase == RankPhase::kLoad) {
      return std::max(kFloorS, kAllowanceS);
    }
    const double longest = recent.empty() ? 0.0 : *std::max_element(recent.begin(), recent.end());
    return std::max(kFloorS, kFactor * longest);
  }

  bool applies(const FaultSpec& f) const {
    if (f.action == FaultAction::kKillNode) {
      return f.rank < world && nodes[static_cast<size_t>(f.rank)] == nodes[rank];
    }
    return f.rank == rank;
  }

  // The fault's marker: a restarted job (same job directory) does not inject it again. Keyed by
  // the fault's text (its name a hash of it, the text inside), so that a fault list edited
  // between runs skips only the faults that fired. Written to the disk before the fault fires (a
  // kill follows at once); a failure is logged, not fatal.
  void mark_fired(const FaultSpec& f) {
    const fs::path dir = fs::path(job_dir) / "faults";
    std::error_code ec;
    fs::create_directories(dir, ec);
    const nlohmann::json marker = {
        {"fault", f.text}, {"rank", rank}, {"step", step}, {"time", wall_seconds()}};
    try {
      write_text_file_atomically((dir / fired_marker_name(f.text)).string(), marker.dump() + "\n",
                                 "fault marker");
    } catch (const Error& e) {
      logging::warn("ACC_FAULT '{}': {}", f.text, e.what());
    }
  }

  // Fires what is due at this mark (`phase_mark`: the phase marked, nullopt at a step's start;
  // `what`: the mark's own words). A stall reached at another mark waits for the next collective
  // mark: the rank stops right before it issues that collective, as one stuck in compute would;
  // when a step begins with none issued since (a one-rank job issues none), it stops there.
  // Runs on the marking thread, without the lock.
  void fire_due(std::optional<progress::Phase> phase_mark, const std::string& what_now) {
    std::vector<Pending> due;
    double slow_s = 0;
    const bool at_collective = phase_mark == progress::Phase::kCollective;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto it = faults.begin(); it != faults.end();) {
        const FaultSpec& f = it->spec;
        if (f.point) {  // reached only at its point of a save (on_point)
          ++it;
          continue;
        }
        const bool at_mark = f.phase ? phase_mark == f.phase : !phase_mark.has_value();
        const bool reached = applies(f) && step >= f.step && at_mark;
        if (f.action == FaultAction::kStall && !at_collective) {
          if (reached && !it->armed_at) it->armed_at = step;
          const bool overdue = !phase_mark && it->armed_at && *it->armed_at < step;
          if (!overdue) {
            ++it;
            continue;
          }
        }
        if (!reached && !it->armed_at) {
          ++it;
          continue;
        }
        if (f.action == FaultAction::kSlow) {  // every step from here on; marked once
          slow_s = (f.factor - 1.0) * last_work_s;
          if (!it->fired) due.push_back(*it);
          it->fired = true;
          ++it;
          continue;
        }
        due.push_back(*it);
        it = faults.erase(it);
      }
      if (!phase_mark) injected_s = slow_s;  // what this step's start sleeps (none: 0)
    }
    for (const Pending& p : due) {
      const FaultSpec& f = p.spec;
      mark_fired(f);
      std::string where = f.phase ? progress::phase_name(*f.phase) : "start";
      if (f.action == FaultAction::kStall) {
        where = what_now.empty() ? "start of the step: no collective since step " +
                                       std::to_string(p.armed_at.value_or(step))
                                 : "before " + what_now;
      }
      logging::warn("ACC_FAULT '{}': {} rank {} at step {} ({})", f.text,
                    f.action == FaultAction::kSlow ? "slowing" : fault_action_name(f.action), rank,
                    step, where);
      logging::logger().flush();
      if (f.action == FaultAction::kKill || f.action == FaultAction::kKillNode) {
        ::kill(::getpid(), SIGKILL);
      }
      if (f.action == FaultAction::kStall) {
        while (true) std::this_thread::sleep_for(std::chrono::hours(1));  // the watchdog runs on
      }
    }
    // At most kMaxSlowFactor - 1 step times; bounded once more so that no step time makes a sleep
    // the clock cannot hold.
    if (slow_s > 0) {
      std::this_thread::sleep_for(
          std::chrono::duration<double>(std::min(slow_s, kMaxDurationSeconds)));
    }
  }

  void on_step(int64_t s) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto now = Clock::now();
      const double waited = dist::wait_seconds();
      if (step_started) {
        const double t = seconds(now - *step_started);
        recent.push_back(t);
        if (recent.size() > kRecentSteps) recent.pop_front();
        last_work_s = std::max(0.0, t - injected_s);
        busy.push_back(std::max(0.0, t - (waited - wait_at_step)));
        ++steps_seen;
      }
      wait_at_step = waited;
      step_started = now;
      step = s;
      phase = RankPhase::kStep;
      what.clear();
      module.clear();
      entering.clear();
      last_progress = now;
    }
    write_progress(s);
    fire_due(std::nullopt, "");
  }

  // A hint for acc-run, not durable state: written and renamed, never fsynced.
  void write_progress(int64_t s) {
    if (progress_file.empty()) return;
    const double now = wall_seconds();
    if (!first_step) first_step = {s, now};
    const nlohmann::json j = {{"first_step", first_step->first},
                              {"first_step_time", first_step->second},
                              {"last_step", s},
                              {"last_step_time", now}};
    const std::string tmp = progress_file + ".tmp";
    {
      std::ofstream out(tmp);
      out << j.dump();
      if (!out) return;
    }
    std::error_code ec;
    fs::rename(tmp, progress_file, ec);
  }

  void on_phase(progress::Phase p, const std::string& w) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      // Loading a checkpoint of step N puts the rank at step N (ACC_FAULT load faults count so).
      const std::string prefix = "checkpoint step ";
      if (p == progress::Phase::kLoad && w.rfind(prefix, 0) == 0) {
        try {
          step = std::stoll(w.substr(prefix.size()));
        } catch (const std::exception&) {
        }
      }
      if (const std::optional<RankPhase> now = rank_phase(p); !now) {
        entering = w;
      } else {
        phase = *now;
        what = w;
        module.clear();
        entering.clear();
      }
      last_progress = Clock::now();
    }
    fire_due(p, w);
  }

  // A point of a checkpoint save (progress::Point), on the thread that reached it: the training
  // thread, or an async save's writer. Its faults are kills: the process dies here, whatever
  // thread marks it.
  void on_point(progress::Point point, int64_t save_step) override {
    std::vector<FaultSpec> due;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto it = faults.begin(); it != faults.end();) {
        const FaultSpec& f = it->spec;
        if (f.point == point && applies(f) && save_step >= f.step) {
          due.push_back(f);
          it = faults.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const FaultSpec& f : due) {
      mark_fired(f);
      logging::warn("ACC_FAULT '{}': {} rank {} at {} of the save of step {}", f.text,
                    fault_action_name(f.action), rank, progress::point_name(point), save_step);
      logging::logger().flush();
      ::kill(::getpid(), SIGKILL);
    }
  }

  void on_module(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu);
    module = name;
    last_progress = Clock::now();
  }

  void on_issued() override {
    std::lock_guard<std::mutex> lock(mu);
    entering.clear();
  }

  // The ranks whose endpoint accepts no connection within 1 s (probed side by side).
  std::vector<int> unreachable_ranks() const {
    std::vector<std::future<bool>> probes(endpoints.size());
    for (size_t r = 0; r < endpoints.size(); ++r) {
      if (static_cast<int>(r) == rank || endpoints[r].empty()) continue;
      probes[r] = std::async(std::launch::async, reachable, endpoints[r]);
    }
    std::vector<int> out;
    for (size_t r = 0; r < probes.size(); ++r) {
      if (probes[r].valid() && !probes[r].get()) out.push_back(static_cast<int>(r));
    }
    return out;
  }

  // What a hang report says of one group: its collectives (issued, last completed, in flight),
  // and per peer and direction its point-to-point messages, numbered apart (issued, last
  // completed). Ranks named "peer_rank" are world ranks (the group's members), "peer" group ranks.
  nlohmann::json group_report(dist::ProcessGroup& g) const {
    const double now_ms = dist::FlightRecorder::now_ms();
    const std::vector<int>& members = g.members();
    auto world_rank = [&](int peer) {
      return peer >= 0 && static_cast<size_t>(peer) < members.size()
                 ? members[static_cast<size_t>(peer)]
                 : peer;
    };
    uint64_t last_completed = 0;
    std::map<std::pair<int, dist::P2PDirection>, uint64_t> p2p_completed;
    nlohmann::json in_flight = nlohmann::json::array(), recent_ops = nlohmann::json::array();
    const auto entries = g.flight_recorder().entries();
    for (size_t i = 0; i < entries.size(); ++i) {
      const dist::FlightRecord& e = entries[i];
      if (e.state == dist::RecordState::kCompleted) {
        uint64_t& last = e.p2p ? p2p_completed[{e.peer, *e.p2p}] : last_completed;
        last = std::max(last, e.seq);
      }
      nlohmann::json j = {
          {"op", e.op},       {"seq", e.seq},   {"state", dist::record_state_name(e.state)},
          {"bytes", e.bytes}, {"peer", e.peer}, {"age_s", (now_ms - e.enqueue_ms) / 1000.0}};
      if (e.p2p) {
        j["p2p"] = dist::p2p_direction_name(*e.p2p);
        j["peer_rank"] = world_rank(e.peer);
        j["tag"] = e.tag;
      }
      if (dist::is_in_flight(e.state)) in_flight.push_back(j);
      if (i + 8 >= entries.size()) recent_ops.push_back(j);
    }
    nlohmann::json p2p = nlohmann::json::array();
    for (int peer = 0; peer < g.size(); ++peer) {
      for (const dist::P2PDirection d : {dist::P2PDirection::kSend, dist::P2PDirection::kRecv}) {
        const uint64_t issued = g.p2p_sequence_number(peer, d);
        if (issued == 0) continue;
        const auto done = p2p_completed.find({peer, d});
        p2p.push_back({{"peer", peer},
                       {"peer_rank", world_rank(peer)},
                       {"direction", dist::p2p_direction_name(d)},
                       {"issued_seq", issued},
                       {"last_completed_seq", done == p2p_completed.end() ? 0 : done->second}});
      }
    }
    return {{"group", g.name()},
            {"rank", g.rank()},
            {"size", g.size()},
            {"members", members},
            {"issued_seq", g.sequence_number()},
            {"last_completed_seq", last_completed},
            {"in_flight", in_flight},
            {"p2p", p2p},
            {"recent", recent_ops}};
  }

  [[noreturn]] void on_hang(double idle_s, double timeout) {
    nlohmann::json report;
    std::vector<dist::ProcessGroupPtr> gs;
    {
      std::lock_guard<std::mutex> lock(mu);
      gs = groups;
      report = {{"rank", rank},      {"world", world},       {"node", nodes[rank]},
                {"pid", ::getpid()}, {"step", step},         {"phase", rank_phase_name(phase)},
                {"what", what},      {"module", module},     {"entering", entering},
                {"idle_s", idle_s},  {"timeout_s", timeout}, {"time", wall_seconds()}};
    }
    nlohmann::json groups_json = nlohmann::json::array();
    for (const auto& g : gs) groups_json.push_back(group_report(*g));
    report["groups"] = groups_json;
    report["unreachable"] = unreachable_ranks();
    const fs::path dir(run_dir);
    std::error_code made;
    fs::create_directories(dir, made);
    const fs::path mine = dir / ("rank-" + std::to_string(rank) + ".json");
    try {
      write_text_file_atomically(mine.string(), report.dump(1), "hang report");
    } catch (const std::exception& e) {
      logging::error("hang: could not write the report: {}", e.what());
    }
    logging::error("hang: no progress for {:.1f} s (timeout {:.1f} s): this rank {}; report {}",
                   idle_s, timeout, where_text(report), mine.string());
    // The others' reports, for up to the grace period.
    auto present = [&] {
      std::vector<std::optional<nlohmann::json>> out(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        out[static_cast<size_t>(r)] =
            detail::try_read_json(dir / ("rank-" + std::to_string(r) + ".json"));
      }
      return out;
    };
    const auto deadline = Clock::now() + std::chrono::duration<double>(grace_s);
    std::vector<std::optional<nlohmann::json>> reports = present();
    while (Clock::now() < deadline &&
           std::any_of(reports.begin(), reports.end(), [](const auto& r) { return !r; })) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      reports = present();
    }
    int lowest = rank;
    for (int r = 0; r < world; ++r) {
      if (reports[static_cast<size_t>(r)]) {
        lowest = std::min(lowest, r);
        break;
      }
    }
    const fs::path analysis_path = dir / "analysis.json";
    if (lowest == rank) {
      nlohmann::json a = analyze_hang(reports);
      a["detected_by"] = rank;
      a["timeout_s"] = timeout;
      try {
        write_text_file_atomically(analysis_path.string(), a.dump(1), "hang analysis");
      } catch (const std::exception& e) {
        logging::error("hang: could not write the analysis: {}", e.what());
      }
      logging::error("hang analysis: {} ({})", a["summary"].get<std::string>(),
                     analysis_path.string());
    } else {  // the analysing rank's exit must not kill it first (mpirun ends the job then)
      const auto until = Clock::now() + std::chrono::duration<double>(grace_s + 3.0);
      std::error_code ec;
      while (Clock::now() < until && !fs::exists(analysis_path, ec)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    logging::logger().flush();
    std::fflush(nullptr);
    std::_Exit(kHangExitCode);  // the last resort: the stuck communicator cannot be shut down
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      cv.wait_for(lock, std::chrono::milliseconds(100));
      if (stopping) return;
      const auto gs = groups;
      const double timeout = timeout_locked();
      double idle = seconds(Clock::now() - last_progress);
      lock.unlock();
      // A collective completing is progress too (a long all-reduce marks nothing while it runs).
      const double now_ms = dist::FlightRecorder::now_ms();
      for (const auto& g : gs) {
        const double end_ms = g->flight_recorder().last_finished_ms();
        if (end_ms >= 0) idle = std::min(idle, (now_ms - end_ms) / 1000.0);
      }
      if (idle > timeout) on_hang(idle, timeout);
      lock.lock();
    }
  }
};

Agent::Agent(std::shared_ptr<State> s) : s_(std::move(s)) {}

std::unique_ptr<Agent> Agent::start(dist::ProcessGroupPtr world, AgentOptions options) {
  ACC_CHECK(world != nullptr, "elastic::Agent::start: no process group");
  auto s = std::make_shared<State>();
  s->rank = world->rank();
  s->world = world->size();
  s->grace_s = check_duration_seconds(options.grace_s, "elastic: grace_s", ZeroSeconds::kAllowed);
  s->fixed_timeout = options.hang_timeout_s;
  if (s->fixed_timeout) {
    check_duration_seconds(*s->fixed_timeout, "elastic: the hang timeout");
  } else {
    s->fixed_timeout = env::get_seconds("ACC_HANG_TIMEOUT_SEC");
  }
  // ACC_CKPT_CRASH was the checkpoint's own crash injection: a run that still sets it would save
  // without the crash it asks for, and say nothing.
  const std::optional<std::string> old_crash = env::get("ACC_CKPT_CRASH");
  ACC_CHECK(!old_crash || old_crash->empty(),
            "ACC_CKPT_CRASH is no longer read: a crash inside a save is an ACC_FAULT, "
            "kill:rank=R:step=S:point=mid_write|before_rename|after_rename (elastic/README.md); "
            "got ACC_CKPT_CRASH='",
            old_crash.value_or(""), "'");
  const std::vector<FaultSpec> specs =
      parse_faults(options.faults ? *options.faults : env::get_string("ACC_FAULT", ""));

  // Rank 0 names the job directory and this run; every rank learns the ranks' nodes.
  std::string dir = options.job_dir.empty() ? env::get_string("ACC_JOB_DIR", "") : options.job_dir;
  std::string error, run;
  if (s->rank == 0) {
    try {
      const std::string stamp =
          std::to_string(std::time(nullptr)) + "-" + std::to_string(::getpid());
      run = "run-" + stamp;
      if (dir.empty()) {  // made when something is written to it (most runs write nothing)
        dir = (fs::current_path() / ("acc-job-" + stamp)).string();
      } else {
        std::error_code ec;
        fs::create_directories(dir, ec);
        ACC_CHECK_AS(IoError, !ec, "elastic: cannot make the job directory '", dir,
                     "': ", ec.message());
      }
    } catch (const Error& e) {
      error = e.what();
    }
  }
  error = dist::broadcast_text(*world, error, 0);
  ACC_CHECK_AS(IoError, error.empty(), error);
  s->job_dir = dist::broadcast_text(*world, dir, 0);
  s->run_dir = (fs::path(s->job_dir) / "hang" / dist::broadcast_text(*world, run, 0)).string();
  s->nodes = dist::allgather_text(*world, node_name());
  s->endpoints = dist::allgather_text(*world, listen_endpoint(s->listen_fd));
  const std::set<std::string> fired = fired_faults(s->job_dir);
  for (const FaultSpec& f : specs) {
    if (fired.count(f.text)) {
      if (s->rank == 0) logging::info("ACC_FAULT '{}' fired in an earlier run: not again", f.text);
      continue;
    }
    // A fault not yet fired must name a rank of this job (one that fired may not: the job may
    // have been restarted on fewer ranks since).
    ACC_CHECK(f.rank < s->world, "ACC_FAULT '", f.text, "': rank ", f.rank, " is not in a job of ",
              s->world, " rank(s)");
    s->faults.push_back({f, false, std::nullopt});
  }
  s->straggler_every =
      options.straggler_every ? *options.straggler_every : env::get_int("ACC_STRAGGLER_EVERY", 50);
  ACC_CHECK(s->straggler_every >= 0, "ACC_STRAGGLER_EVERY must be >= 0, got ", s->straggler_every);
  s->straggler_factor = options.straggler_factor ? *options.straggler_factor
                                                 : env::get_double("ACC_STRAGGLER_FACTOR", 1.5);
  ACC_CHECK(s->straggler_factor > 1.0, "ACC_STRAGGLER_FACTOR must be > 1, got ",
            s->straggler_factor);
  s->straggler_min_s =
      options.straggler_min_s
          ? check_duration_seconds(*options.straggler_min_s, "ACC_STRAGGLER_MIN_SEC",
                                   ZeroSeconds::kAllowed)
          : env::get_seconds("ACC_STRAGGLER_MIN_SEC", ZeroSeconds::kAllowed).value_or(0.01);
  if (const auto attempt = env::get("ACC_RUN_ATTEMPT"); attempt && s->rank == 0) {
    const fs::path dir = fs::path(s->job_dir) / "attempts" / ("attempt-" + *attempt);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (!ec) s->progress_file = (dir / "progress.json").string();
  }
  s->groups.push_back(world);
  s->last_progress = Clock::now();
  State* raw = s.get();
  s->watchdog = std::thread([raw] { raw->run(); });
  progress::set_listener(s);
  return std::unique_ptr<Agent>(new Agent(std::move(s)));
}

Agent::~Agent() {
  progress::set_listener(nullptr);
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stopping = true;
  }
  s_->cv.notify_all();
  if (s_->watchdog.joinable()) s_->watchdog.join();
  // A fault of this rank that never fired is worth a word: its step or phase never came.
  std::lock_guard<std::mutex> lock(s_->mu);
  for (const State::Pending& p : s_->faults) {
    if (!s_->applies(p.spec) || p.fired) continue;
    logging::warn("ACC_FAULT '{}' never fired on rank {} (the run ended at step {}{})", p.spec.text,
                  s_->rank, s_->step,
                  p.armed_at ? ", with no collective after it was reached" : "");
  }
}

void Agent::watch(dist::ProcessGroupPtr group) {
  ACC_CHECK(group != nullptr, "elastic::Agent::watch: no process group");
  std::lock_guard<std::mutex> lock(s_->mu);
  for (const auto& g : s_->groups) {
    if (g == group) return;
  }
  s_->groups.push_back(std::move(group));
}

const std::string& Agent::job_dir() const {
  return s_->job_dir;
}

double Agent::timeout_s() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->timeout_locked();
}

std::vector<int> Agent::report_stragglers() {
  State& s = *s_;
  std::vector<double> window;
  dist::ProcessGroupPtr world;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.straggler_every <= 0 || ++s.steps_to_compare < s.straggler_every) return {};
    s.steps_to_compare = 0;
    window.swap(s.busy);
    world = s.groups.front();
  }
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  const double mine = median(window);
  std::vector<double> all;
  for (const std::string& t : dist::allgather_text(*world, std::to_string(mine))) {
    all.push_back(std::stod(t));
  }
  std::vector<int> out;
  for (size_t r = 0; r < all.size() && all.size() > 1; ++r) {
    std::vector<double> others = all;
    others.erase(others.begin() + static_cast<std::ptrdiff_t>(r));
    const double m = median(others);
    if (m > 0 && all[r] > s.straggler_factor * m && all[r] - m >= s.straggler_min_s) {
      out.push_back(static_cast<int>(r));
      if (s.rank == 0) {
        logging::warn(
            "straggler: rank {} (node {}) is busy {:.3f} s per step over the last {} steps, "
            "{:.1f}x the median of the other ranks ({:.3f} s; ACC_STRAGGLER_FACTOR {})",
            r, s.nodes[r], all[r], window.size(), all[r] / m, m, s.straggler_factor);
      }
    }
  }
  return out;
}

namespace {

// What one rank's report says of its messages with one peer on one group: issued and last
// completed (the group report's "p2p"), and its oldest message in flight.
struct Channel {
  uint64_t issued = 0, last_completed = 0;
  std::optional<uint64_t> waiting;  // the oldest in flight
  int tag = -1;                     // of that one
};

// Keyed by (group, direction, peer's world rank).
using Channels = std::map<std::tuple<std::string, std::string, int>, Channel>;

Channels channels_of(const nlohmann::json& report) {
  Channels out;
  for (const auto& g : report.value("groups", nlohmann::json::array())) {
    const std::string group = g.value("group", "");
    for (const auto& c : g.value("p2p", nlohmann::json::array())) {
      Channel& ch = out[{group, c.value("direction", ""), c.value("peer_rank", -1)}];
      ch.issued = c.value("issued_seq", uint64_t{0});
      ch.last_completed = c.value("last_completed_seq", uint64_t{0});
    }
    for (const auto& e : g.value("in_flight", nlohmann::json::array())) {
      if (!is_p2p(e)) continue;
      Channel& ch = out[{group, e["p2p"].get<std::string>(), e.value("peer_rank", -1)}];
      const uint64_t seq = e.value("seq", uint64_t{0});
      if (!ch.waiting || seq < *ch.waiting) {
        ch.waiting = seq;
        ch.tag = e.value("tag", -1);
      }
    }
  }
  return out;
}

// The point-to-point part of analyze_hang: each message a rank waits in, matched with its peer's
// side of the same pair (the peer's messages the other way, numbered alike). A peer that has not
// issued the matching message is the culprit; one that has (both in flight) points at the link
// or, with other tags, at a schedule that sends something else under that number.
// " (stage 2)" for a world rank of a pipeline's group (a mesh group along pp: named "pp" or
// "pp of ..."), its position along pp as rank `reporter`'s report lists the group's members; ""
// for any other group. With virtual stages a rank holds several stages: the position is the first.
std::string stage_of(const nlohmann::json& report, const std::string& group, int world_rank) {
  if (group != "pp" && group.rfind("pp of ", 0) != 0) return "";
  for (const auto& g : report.value("groups", nlohmann::json::array())) {
    if (g.value("group", "") != group) continue;
    const auto members = g.value("members", std::vector<int>{});
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == world_rank) return " (stage " + std::to_string(i) + ")";
    }
  }
  return "";
}

nlohmann::json analyze_p2p(const std::vector<std::optional<nlohmann::json>>& reports,
                           std::set<int>& culprits, std::vector<std::string>& parts) {
  std::vector<Channels> chans(reports.size());
  for (size_t r = 0; r < reports.size(); ++r) {
    if (reports[r]) chans[r] = channels_of(*reports[r]);
  }
  nlohmann::json out = nlohmann::json::array();
  std::set<std::tuple<std::string, int, int, uint64_t>> told;  // (group, sender, receiver, seq)
  for (size_t r = 0; r < reports.size(); ++r) {
    for (const auto& [key, ch] : chans[r]) {
      if (!ch.waiting) continue;
      const auto& [group, dir, peer] = key;
      const bool sends = dir == "send";
      const int rank = static_cast<int>(r);
      const uint64_t seq = *ch.waiting;
      const int sender = sends ? rank : peer, receiver = sends ? peer : rank;
      if (!told.insert({group, sender, receiver, seq}).second) continue;
      const nlohmann::json& mine = *reports[r];
      const std::string what = dir + " seq " + std::to_string(seq) + (sends ? " to" : " from") +
                               " rank " + std::to_string(peer) + stage_of(mine, group, peer) +
                               " of " + dist::describe_group_name(group);
      nlohmann::json item = {{"group", group}, {"op", dir},    {"seq", seq},
                             {"rank", rank},   {"peer", peer}, {"tag", ch.tag}};
      std::string text =
          "rank " + std::to_string(rank) + stage_of(mine, group, rank) + " waits in " + what;
      const bool peer_reported =
          peer >= 0 && static_cast<size_t>(peer) < reports.size() && reports[peer];
      if (!peer_reported) {
        parts.push_back(text);  // the peer is named as silent below
        out.push_back(item);
        continue;
      }
      const std::string other_dir = sends ? "recv" : "send";
      Channel other;
      if (auto it = chans[peer].find({group, other_dir, rank}); it != chans[peer].end()) {
        other = it->second;
      }
      item["peer_issued_seq"] = other.issued;
      item["peer_last_completed_seq"] = other.last_completed;
      item["peer_waiting"] = other.waiting == seq;
      const std::string to_rank =
          (sends ? " from" : " to") + std::string(" rank ") + std::to_string(rank);
      const nlohmann::json& rep = *reports[peer];
      if (other.issued < seq) {
        culprits.insert(peer);
        item["lagging"] = {{"rank", peer},
                           {"step", rep.value("step", int64_t{-1})},
                           {"phase", rep.value("phase", std::string())},
                           {"what", rep.value("what", std::string())},
                           {"module", rep.value("module", std::string())},
                           {"entering", rep.value("entering", std::string())}};
        text += "; rank " + std::to_string(peer) +
                (other.issued == 0 ? " has issued no " + other_dir + to_rank
                                   : " last issued " + other_dir + " seq " +
                                         std::to_string(other.issued) + to_rank) +
                " and " + where_text(rep);
      } else if (other.waiting == seq && other.tag != ch.tag) {
        item["peer_tag"] = other.tag;
        text += "; rank " + std::to_string(peer) + " waits in its " + other_dir + " seq " +
                std::to_string(seq) + " with tag " + std::to_string(other.tag) +
                ", this one has tag " + std::to_string(ch.tag) +
                " (the two ranks pair different messages)";
      } else if (other.waiting == seq) {
        text += "; rank " + std::to_string(peer) + " waits in its " + other_dir + " seq " +
                std::to_string(seq) + " too (both issued: the link between them)";
      } else {
        text += "; rank " + std::to_string(peer) + " issued its " + other_dir + " seq " +
                std::to_string(seq) + " (last issued " + std::to_string(other.issued) +
                ", last completed " + std::to_string(other.last_completed) + ")";
      }
      parts.push_back(text);
      out.push_back(item);
    }
  }
  return out;
}

}  // namespace

nlohmann::json analyze_hang(const std::vector<std::optional<nlohmann::json>>& reports) {
  struct Member {
    int rank;
    uint64_t last_completed;
    std::optional<uint64_t> oldest;  // the oldest collective it waits in
    std::string op;
  };
  std::map<std::string, std::vector<Member>> by_group;
  nlohmann::json not_reporting = nlohmann::json::array();
  for (size_t r = 0; r < reports.size(); ++r) {
    if (!reports[r]) {
      not_reporting.push_back(static_cast<int>(r));
      continue;
    }
    for (const auto& g : reports[r]->value("groups", nlohmann::json::array())) {
      Member m{static_cast<int>(r), g.value("last_completed_seq", uint64_t{0}), std::nullopt, ""};
      for (const auto& e : g.value("in_flight", nlohmann::json::array())) {
        if (is_p2p(e)) continue;  // numbered apart: analysed below
        const uint64_t seq = e.value("seq", uint64_t{0});
        if (!m.oldest || seq < *m.oldest) {
          m.oldest = seq;
          m.op = e.value("op", "");
        }
      }
      by_group[g.value("group", "")].push_back(m);
    }
  }
  auto ranks_text = [](const std::vector<int>& rs) {
    std::string t = rs.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < rs.size(); ++i) {
      if (i) t += ',';
      t += std::to_string(rs[i]);
    }
    return t;
  };
  auto where = [&](int r) { return where_text(*reports[static_cast<size_t>(r)]); };
  nlohmann::json groups = nlohmann::json::array();
  std::set<int> culprits;
  std::vector<std::string> parts;
  for (const auto& [name, members] : by_group) {
    std::optional<uint64_t> stuck;
    std::string op;
    for (const Member& m : members) {
      if (m.oldest && (!stuck || *m.oldest < *stuck)) {
        stuck = m.oldest;
        op = m.op;
      }
    }
    if (!stuck) continue;
    std::vector<int> waiting;
    nlohmann::json lagging = nlohmann::json::array();
    std::string lag_text;
    for (const Member& m : members) {
      if (m.oldest == stuck) {
        waiting.push_back(m.rank);
      } else if (m.last_completed < *stuck) {
        const nlohmann::json& rep = *reports[static_cast<size_t>(m.rank)];
        lagging.push_back({{"rank", m.rank},
                           {"last_completed_seq", m.last_completed},
                           {"step", rep.value("step", int64_t{-1})},
                           {"phase", rep.value("phase", std::string())},
                           {"what", rep.value("what", std::string())},
                           {"module", rep.value("module", std::string())},
                           {"entering", rep.value("entering", std::string())}});
        culprits.insert(m.rank);
        lag_text += "; rank " + std::to_string(m.rank) + " last completed seq " +
                    std::to_string(m.last_completed) + " and " + where(m.rank);
      }
    }
    groups.push_back(
        {{"group", name}, {"op", op}, {"seq", *stuck}, {"waiting", waiting}, {"lagging", lagging}});
    parts.push_back(ranks_text(waiting) + " wait" + (waiting.size() == 1 ? "s" : "") + " in " + op +
                    " seq " + std::to_string(*stuck) + " of " + dist::describe_group_name(name) +
                    lag_text);
  }
  const nlohmann::json p2p = analyze_p2p(reports, culprits, parts);
  if (groups.empty() && p2p.empty()) {
    std::string t = "no collective in flight";
    for (size_t r = 0; r < reports.size(); ++r) {
      if (reports[r]) t += "; rank " + std::to_string(r) + " " + where(static_cast<int>(r));
    }
    parts.push_back(t);
  }
  // Ranks that could not reach others: a partition (a link down), whatever else is seen.
  // Said once per set of ranks that cannot reach the same others.
  nlohmann::json partition = nlohmann::json::array();
  std::map<std::vector<int>, std::vector<int>> cut_off;  // unreachable ranks -> who says so
  for (size_t r = 0; r < reports.size(); ++r) {
    if (!reports[r]) continue;
    const auto un = reports[r]->value("unreachable", std::vector<int>{});
    if (un.empty()) continue;
    partition.push_back({{"rank", static_cast<int>(r)}, {"unreachable", un}});
    cut_off[un].push_back(static_cast<int>(r));
  }
  for (const auto& [un, who] : cut_off) {
    parts.push_back(ranks_text(who) + " cannot reach " + ranks_text(un) +
                    " (a link down or a partition)");
  }
  for (const auto& r : not_reporting) {
    culprits.insert(r.get<int>());
    parts.push_back("rank " + std::to_string(r.get<int>()) + " wrote no report (stopped or dead)");
  }
  std::string summary;
  for (const auto& p : parts) summary += (summary.empty() ? "" : "; ") + p;
  return {{"summary", summary},
          {"groups", groups},
          {"p2p", p2p},
          {"not_reporting", not_reporting},
          {"partition", partition},
          {"culprits", std::vector<int>(culprits.begin(), culprits.end())}};
}

}  // namespace acc::elastic
