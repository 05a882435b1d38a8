#include "acc/elastic/launcher.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "acc/elastic/agent.hpp"
#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/parse.hpp"
#include "job_files.hpp"

extern char** environ;

namespace acc::elastic {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using detail::try_read_json;
using detail::wall_seconds;

namespace {

double seconds_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration<double>(now - t).count();
}

// The hang detector's analysis written since `since` (this attempt's), if any.
std::optional<nlohmann::json> hang_analysis_since(const std::string& job_dir,
                                                  Clock::time_point since) {
  const auto written_after = fs::file_time_type::clock::now() - (Clock::now() - since);
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(fs::path(job_dir) / "hang", ec)) {
    const fs::path a = d.path() / "analysis.json";
    if (fs::exists(a, ec) && fs::last_write_time(a, ec) >= written_after) {
      if (auto j = detail::try_read_json(a)) return j;
    }
  }
  return std::nullopt;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

// acc-run's own stop signals (SIGTERM, SIGINT). The handler only counts them; the loop that waits
// for a process acts on them (run_attempt): the first is forwarded to the job, a second kills it
// at once.
std::atomic<int> g_stop_signal{0};  // the first one received
std::atomic<int> g_stop_count{0};

void on_stop_signal(int sig) {
  int none = 0;
  g_stop_signal.compare_exchange_strong(none, sig);
  g_stop_count.fetch_add(1);
}

void on_sigpipe(int) {}

// The handlers, for the life of run_elastic (the old ones are put back after it). mpirun and the
// ranks run in process groups of their own, so a signal to acc-run reaches only acc-run: without
// these, `kill <acc-run>` or Ctrl-C ended acc-run alone and the job trained on.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    g_stop_count = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    ::sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGTERM, &sa, &old_term_);
    ::sigaction(SIGINT, &sa, &old_int_);
    // mpirun's output is relayed through acc-run (OutputRelay): a closed stdout must fail that
    // write, not kill acc-run and leave the job running. A handler rather than SIG_IGN, which
    // mpirun would inherit across exec.
    sa.sa_handler = on_sigpipe;
    ::sigaction(SIGPIPE, &sa, &old_pipe_);
  }
  ~StopSignals() {
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGPIPE, &old_pipe_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_term_, old_int_, old_pipe_;  // filled by sigaction
};

std::string signal_name(int sig) {
  if (sig == SIGTERM) return "SIGTERM";
  if (sig == SIGINT) return "SIGINT";
  return "signal " + std::to_string(sig);
}

// mpirun's stdout and stderr, relayed to acc-run's as they come and read for OpenMPI's words for a
// program it could not start. Its exit code cannot tell that from a rank's failure (a path that
// cannot be executed gives 132, also 128 + SIGILL; a name not on PATH 134, also 128 + SIGABRT);
// its output does: "N total processes failed to start" on stdout and "mpirun was unable to
// launch / find / start the specified ..." on stderr (OpenMPI 4's help-orterun.txt).
class OutputRelay {
 public:
  OutputRelay() {
    for (auto& p : pipes_) {
      ACC_CHECK_AS(IoError, ::pipe2(p, O_CLOEXEC) == 0, "acc-run: cannot make a pipe (",
                   std::strerror(errno), ")");
    }
  }
  ~OutputRelay() {
    for (auto& p : pipes_) {
      for (int& fd : p) {
        if (fd >= 0) ::close(fd);
      }
    }
  }
  OutputRelay(const OutputRelay&) = delete;
  OutputRelay& operator=(const OutputRelay&) = delete;

  // In the child, before exec: its stdout and stderr become the pipes (dup2 clears O_CLOEXEC).
  void in_child() const {
    ::dup2(pipes_[0][1], STDOUT_FILENO);
    ::dup2(pipes_[1][1], STDERR_FILENO);
  }
  // In acc-run after the fork: only the child writes.
  void in_parent() {
    for (auto& p : pipes_) {
      ::close(p[1]);
      p[1] = -1;
      ::fcntl(p[0], F_SETFL, ::fcntl(p[0], F_GETFL) | O_NONBLOCK);
    }
  }
  // Relays what arrives within `wait` (returns as soon as something did).
  void pump(std::chrono::milliseconds wait) {
    pollfd fds[2];
    int which[2], n = 0;
    for (int i = 0; i < 2; ++i) {
      if (pipes_[i][0] < 0) continue;
      fds[n] = {pipes_[i][0], POLLIN, 0};
      which[n++] = i;
    }
    if (n == 0) {
      std::this_thread::sleep_for(wait);
      return;
    }
    if (::poll(fds, static_cast<nfds_t>(n), static_cast<int>(wait.count())) <= 0) return;
    for (int k = 0; k < n; ++k) {
      if (fds[k].revents) read_some(which[k]);
    }
  }
  // Relays what is left: once mpirun has ended, everything it wrote is in the pipes.
  void drain() {
    for (int i = 0; i < 2; ++i) {
      while (read_some(i)) {
      }
      check(line_[i]);
      line_[i].clear();
    }
  }
  // The line in which mpirun said it could not start the program, or "" when it did not.
  const std::string& launch_failure() const { return failure_; }

 private:
  // Reads and relays one chunk; false when there was nothing to read (or the pipe is closed).
  bool read_some(int i) {
    int& fd = pipes_[i][0];
    if (fd < 0) return false;
    char buf[1 << 16];
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      for (ssize_t done = 0; done < n;) {  // a write error (acc-run's output closed) drops it
        const ssize_t w = ::write(i == 0 ? STDOUT_FILENO : STDERR_FILENO, buf + done,
                                  static_cast<size_t>(n - done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        done += w;
      }
      scan(i, buf, static_cast<size_t>(n));
      return true;
    }
    if (n < 0 && errno == EINTR) return true;
    if (n == 0 || errno != EAGAIN) {
      ::close(fd);
      fd = -1;
    }
    return false;
  }
  void scan(int i, const char* buf, size_t n) {
    line_[i].append(buf, n);
    for (size_t nl; (nl = line_[i].find('\n')) != std::string::npos;) {
      check(line_[i].substr(0, nl));
      line_[i].erase(0, nl + 1);
    }
    if (line_[i].size() > 4096) {  // no marker is that far into a line
      check(line_[i]);
      line_[i].clear();
    }
  }
  void check(const std::string& line) {
    static const char* const kMarkers[] = {"total processes failed to start",
                                           "was unable to launch the specified application",
                                           "was unable to find the specified executable",
                                           "was unable to start the specified application"};
    if (!failure_.empty()) return;
    for (const char* m : kMarkers) {
      if (line.find(m) != std::string::npos) {
        const size_t a = line.find_first_not_of(" \t\r");
        failure_ = line.substr(a, line.find_last_not_of(" \t\r") - a + 1);
        return;
      }
    }
  }
  int pipes_[2][2] = {{-1, -1}, {-1, -1}};
  std::string line_[2], failure_;
};

// What run_attempt does with acc-run's stop signals: a health check is killed at once; the job is
// asked first (the signal forwarded to mpirun, which passes SIGTERM to the ranks and ends), and
// killed, mpirun's process group with SIGKILL, at a second signal or when it has not ended within
// the grace period.
enum class OnStop { kKill, kForward };

struct Ended {
  int code = 0;                // the exit code, or 128 + the signal
  std::string launch_failure;  // with a relay: mpirun's words for a program it could not start
  std::string stopped;         // what a stop signal did ("forwarded it to mpirun, ..."), or ""
};

// Runs argv in its own process group; polls `tick` every 100 ms while it runs (tick() returning
// true ends it: SIGKILL to the group), and acts on acc-run's stop signals (`on_stop`). With
// `relay`, the process's output goes through acc-run (OutputRelay). When it ends (an exit, a
// signal, a crash of mpirun itself), whatever is left of its group is killed and reaped (orphans
// come back to acc-run, a child subreaper, and keep the group): nothing of the attempt is left.
template <class Tick>
Ended run_attempt(const std::vector<std::string>& argv, Tick&& tick, OnStop on_stop = OnStop::kKill,
                  double grace_s = 0, bool relay_output = false) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::optional<OutputRelay> relay;
  if (relay_output) relay.emplace();
  const pid_t pid = ::fork();
  ACC_CHECK_AS(IoError, pid >= 0, "acc-run: fork failed (", std::strerror(errno), ")");
  if (pid == 0) {
    ::setpgid(0, 0);
    if (relay) relay->in_child();
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "acc-run: cannot run '%s': %s\n", args[0], std::strerror(errno));
    std::_Exit(127);
  }
  ::setpgid(pid, pid);
  if (relay) relay->in_parent();
  Ended ended;
  int status = 0;
  bool killed = false;
  std::optional<Clock::time_point> forwarded;
  auto next_tick = Clock::now();
  while (true) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) break;
    const auto now = Clock::now();
    if (const int stops = g_stop_count.load(); stops > 0 && !killed) {
      const std::string sig = signal_name(g_stop_signal.load());
      std::string kill_why;
      if (on_stop == OnStop::kKill) {
        kill_why = "killed";
      } else if (stops > 1) {
        kill_why = "a second signal came: the job was killed at once";
      } else if (!forwarded) {
        forwarded = now;
        ended.stopped = "forwarded it to mpirun, which ended the job";
        logging::warn(
            "acc-run: {}: stopping the job (forwarded to mpirun; killed if it has not ended in "
            "{:g} s; a second SIGTERM or SIGINT kills it at once)",
            sig, grace_s);
        ::kill(pid, g_stop_signal.load());
      } else if (seconds_since(*forwarded, now) > grace_s) {
        kill_why = fmt::format(
            "the job had not ended {:g} s after it was forwarded to mpirun: it was killed",
            grace_s);
      }
      if (!kill_why.empty()) {
        ended.stopped = kill_why;
        if (on_stop == OnStop::kForward) logging::warn("acc-run: {}: {}", sig, kill_why);
        ::kill(-pid, SIGKILL);
        killed = true;
      }
    } else if (stops == 0 && now >= next_tick) {
      next_tick = now + std::chrono::milliseconds(100);
      if (tick()) ::kill(-pid, SIGKILL);
    }
    if (relay) {
      relay->pump(std::chrono::milliseconds(20));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ::kill(-pid, SIGKILL);
  // Reap the group's leftovers (orphans handed to us included), for up to 5 s.
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < until) {
    const pid_t w = ::waitpid(-pid, nullptr, WNOHANG);
    if (w > 0) continue;
    if (w < 0 && errno == ECHILD) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (relay) {
    relay->drain();
    ended.launch_failure = relay->launch_failure();
  }
  ended.code = 1;
  if (WIFEXITED(status)) ended.code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) ended.code = 128 + WTERMSIG(status);
  return ended;
}

// Kills and reaps every child acc-run has left: an attempt's ranks sit in process groups of their
// own (orted makes one per rank) and come back to acc-run, the child subreaper, when their
// daemon dies. Repeated for up to 3 s, as grandchildren keep arriving while their parents die.
// Called with no health check running (those are children too).
void kill_children() {
  const pid_t me = ::getpid();
  const auto until = Clock::now() + std::chrono::seconds(3);
  while (Clock::now() < until) {
    std::vector<pid_t> kids;
    std::error_code ec;
    for (const auto& d : fs::directory_iterator("/proc", ec)) {
      const std::string name = d.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(d.path() / "stat");
      std::string line;
      if (!std::getline(stat, line)) continue;
      const size_t close = line.rfind(')');  // "pid (comm) state ppid ..."
      if (close == std::string::npos) continue;
      std::istringstream rest(line.substr(close + 1));
      char state = 0;
      pid_t ppid = 0;
      rest >> state >> ppid;
      if (ppid == me) kids.push_back(static_cast<pid_t>(std::stol(name)));
    }
    if (kids.empty()) return;
    for (pid_t k : kids) ::kill(k, SIGKILL);
    for (pid_t k : kids) ::waitpid(k, nullptr, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// A node is healthy when mpirun can start a process there within the timeout. mpirun told to stop
// (SIGTERM) waits for its daemons, and one on a lost node may never answer: 2 s after the TERM,
// `timeout -k` sends KILL (run_attempt then kills and reaps the probe's process group).
bool healthy(const LaunchOptions& o, const std::string& node) {
  std::vector<std::string> argv = {"timeout", "-k", "2", std::to_string(o.health_timeout_s),
                                   o.mpirun};
  argv.insert(argv.end(), o.mpirun_args.begin(), o.mpirun_args.end());
  for (const std::string& a : {std::string("--host"), node + ":1", std::string("-np"),
                               std::string("1"), std::string("true")}) {
    argv.push_back(a);
  }
  return run_attempt(argv, [] { return false; }).code == 0;
}

// The nodes that answer and those that do not, checked side by side.
std::pair<std::vector<std::string>, std::vector<std::string>> check_nodes(
    const LaunchOptions& o, const std::vector<std::string>& nodes) {
  std::vector<std::future<bool>> checks;
  for (const auto& n : nodes) checks.push_back(std::async(std::launch::async, healthy, o, n));
  std::vector<std::string> left, lost;
  for (size_t i = 0; i < nodes.size(); ++i) (checks[i].get() ? left : lost).push_back(nodes[i]);
  return {left, lost};
}

}  // namespace

std::vector<std::string> read_hostfile(const std::string& path) {
  std::ifstream in(path);
  ACC_CHECK_AS(IoError, in.is_open(), "acc-run: cannot read the hostfile '", path, "' (",
               std::strerror(errno), ")");
  std::vector<std::string> hosts;
  std::set<std::string> seen;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string host, extra;
    if (!(words >> host)) continue;
    while (words >> extra) {
      ACC_CHECK(extra.rfind("slots=", 0) == 0 || extra.rfind("max_slots=", 0) == 0,
                "acc-run: hostfile '", path, "' line ", n, ": unexpected '", extra,
                "' (expected HOST [slots=N])");
    }
    ACC_CHECK(seen.insert(host).second, "acc-run: hostfile '", path, "' line ", n, ": host '", host,
              "' is listed twice");
    hosts.push_back(host);
  }
  ACC_CHECK(!hosts.empty(), "acc-run: hostfile '", path, "' names no host");
  return hosts;
}

std::pair<int, int> parse_nnodes(const std::string& text) {
  const size_t colon = text.find(':');
  const int64_t lo = parse_int64(text.substr(0, colon), "--nnodes '" + text + "' MIN");
  const int64_t hi = colon == std::string::npos
                         ? lo
                         : parse_int64(text.substr(colon + 1), "--nnodes '" + text + "' MAX");
  ACC_CHECK(lo >= 1 && lo <= hi && hi < (1 << 20), "--nnodes '", text,
            "': need 1 <= MIN <= MAX (MIN:MAX or N)");
  return {static_cast<int>(lo), static_cast<int>(hi)};
}

std::vector<std::string> mpirun_command(const LaunchOptions& o,
                                        const std::vector<std::string>& nodes, int attempt) {
  std::vector<std::string> argv = {o.mpirun};
  argv.insert(argv.end(), o.mpirun_args.begin(), o.mpirun_args.end());
  std::string hosts;
  for (const auto& n : nodes) {
    hosts += (hosts.empty() ? "" : ",") + n + ":" + std::to_string(o.nproc_per_node);
  }
  for (const std::string& a : {std::string("--host"), hosts, std::string("-np"),
                               std::to_string(static_cast<int>(nodes.size()) * o.nproc_per_node),
                               std::string("-x"), "ACC_JOB_DIR=" + o.job_dir, std::string("-x"),
                               std::string(kAttemptEnv) + "=" + std::to_string(attempt)}) {
    argv.push_back(a);
  }
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (name == "ACC_JOB_DIR" || name == kAttemptEnv) continue;
    if (name.rfind("ACC_", 0) == 0 || name == "OPENBLAS_NUM_THREADS" || name == "OMP_NUM_THREADS") {
      argv.push_back("-x");
      argv.push_back(name);
    }
  }
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  return argv;
}

int run_attempt() {
  const std::optional<std::string> text = env::get(kAttemptEnv);
  if (!text) return 0;
  const int64_t attempt = parse_int64(*text, kAttemptEnv);
  ACC_CHECK(attempt >= 0 && attempt <= std::numeric_limits<int>::max(), kAttemptEnv,
            " must be a non-negative integer (acc-run's attempt), got '", *text, "'");
  return static_cast<int>(attempt);
}

int run_elastic(const LaunchOptions& o) {
  ACC_CHECK(!o.command.empty(), "acc-run: no program to run (give it after --)");
  ACC_CHECK(o.nproc_per_node >= 1, "acc-run: --nproc-per-node must be >= 1, got ",
            o.nproc_per_node);
  ACC_CHECK(o.max_restarts >= 0, "acc-run: --max-restarts must be >= 0, got ", o.max_restarts);
  check_duration_seconds(o.health_timeout_s, "acc-run: the health timeout");
  check_duration_seconds(o.stop_grace_s, "acc-run: the stop grace period", ZeroSeconds::kAllowed);
  const StopSignals stop_signals;
  (void)::prctl(PR_SET_CHILD_SUBREAPER, 1);  // the attempt's orphans come back to acc-run
  std::error_code ec;
  fs::create_directories(o.job_dir, ec);
  ACC_CHECK_AS(IoError, !ec, "acc-run: cannot make the job directory '", o.job_dir,
               "': ", ec.message());
  const fs::path incidents = fs::path(o.job_dir) / "incidents.jsonl";

  std::vector<std::string> nodes;
  {
    auto [left, lost] = check_nodes(o, o.nodes);
    for (const auto& n : lost) {
      logging::warn("acc-run: node {} does not answer (mpirun cannot start a process there)", n);
    }
    for (const auto& n : left) {
      if (static_cast<int>(nodes.size()) < o.max_nodes) nodes.push_back(n);
    }
  }
  // Incidents waiting for the next first step: the last attempt's, and those before it when
  // the attempts since ended before a first step (mpirun dying at start): their time to the first
  // step counts the whole way back to training.
  std::vector<nlohmann::json> open_incidents;
  auto write_incident = [&](const nlohmann::json& inc) {
    std::ofstream out(incidents, std::ios::app);
    out << inc.dump() << "\n";
    logging::info("acc-run: incident {}", inc.dump());
  };
  auto write_open = [&] {
    for (const auto& inc : open_incidents) write_incident(inc);
    open_incidents.clear();
  };
  // Once an attempt's progress file names its first step, the open incidents are complete.
  auto resolve_open = [&](const std::optional<nlohmann::json>& p) {
    if (open_incidents.empty() || !p || !p->contains("first_step")) return;
    for (nlohmann::json& inc : open_incidents) {
      inc["resumed_at_step"] = (*p)["first_step"];
      inc["first_step_at"] = (*p)["first_step_time"];
      const double failed = inc.contains("failed_at") ? inc["failed_at"].get<double>()
                                                      : inc["ended_at"].get<double>();
      inc["time_to_first_step_s"] = (*p)["first_step_time"].get<double>() - failed;
      if (inc.contains("last_step")) {
        inc["steps_lost"] = inc["last_step"].get<int64_t>() + 1 - (*p)["first_step"].get<int64_t>();
      }
    }
    write_open();
  };
  // acc-run was told to stop (SIGTERM, SIGINT) and the job has ended (run_attempt): what is left
  // of it is killed, the incidents are written, the last saying `what: stopped` and the signal,
  // and acc-run exits 128 + the signal.
  auto stop = [&](nlohmann::json inc, const std::string& how) {
    const int sig = g_stop_signal.load();
    kill_children();
    write_open();
    inc["what"] = "stopped";
    inc["signal"] = signal_name(sig);
    inc["summary"] = "acc-run received " + signal_name(sig) + "; " + how;
    if (!inc.contains("ended_at")) inc["ended_at"] = wall_seconds();
    write_incident(inc);
    logging::warn("acc-run: stopped by {}: nothing of the job is left; exiting with {}",
                  signal_name(sig), 128 + sig);
    return 128 + sig;
  };
  for (int attempt = 0;; ++attempt) {
    if (g_stop_signal.load() != 0) {  // between attempts (a node check may have been cut short)
      return stop({{"attempt", attempt}, {"nodes", nlohmann::json::array()}},
                  "stopped before attempt " + std::to_string(attempt) + " was launched");
    }
    if (static_cast<int>(nodes.size()) < o.min_nodes) {
      logging::error("acc-run: {} node(s) left, fewer than the minimum {}: giving up", nodes.size(),
                     o.min_nodes);
      write_open();
      return 1;
    }
    const std::vector<std::string> argv = mpirun_command(o, nodes, attempt);
    const fs::path progress =
        fs::path(o.job_dir) / "attempts" / ("attempt-" + std::to_string(attempt)) / "progress.json";
    logging::info("acc-run: attempt {} on {} node(s) ({}) x {}: {}", attempt, nodes.size(),
                  join(nodes, ","), o.nproc_per_node, join(argv, " "));
    const double started = wall_seconds();
    for (auto& inc : open_incidents) {
      if (!inc.contains("relaunched_at")) inc["relaunched_at"] = started;
    }
    // While the attempt runs: when its progress stalls, the nodes are checked (every 5 s at
    // most); a node that stops answering, or a hang analysis that mpirun outlives by 5 s, ends
    // the attempt (mpirun may wait for ever on a lost node's daemon).
    const auto attempt_start = Clock::now();
    auto last_change = attempt_start, last_check = attempt_start - std::chrono::hours(1);
    int64_t last_seen = -1;
    double step_s = 0;  // the attempt's mean step time so far
    std::future<std::pair<std::vector<std::string>, std::vector<std::string>>> check;
    std::optional<std::vector<std::string>> lost_in_attempt;
    std::optional<Clock::time_point> analysis_seen;
    auto tick = [&] {
      const auto now = Clock::now();
      const auto p = try_read_json(progress);
      if (p && p->contains("last_step") && (*p)["last_step"].get<int64_t>() != last_seen) {
        last_seen = (*p)["last_step"].get<int64_t>();
        last_change = now;
        const int64_t n = last_seen - (*p)["first_step"].get<int64_t>();
        if (n > 0) {
          step_s = ((*p)["last_step_time"].get<double>() - (*p)["first_step_time"].get<double>()) /
                   static_cast<double>(n);
        }
      }
      if (check.valid() && check.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        auto [left, lost] = check.get();
        if (!lost.empty()) {
          lost_in_attempt = lost;
          logging::warn("acc-run: node(s) {} stopped answering: ending attempt {}", join(lost, ","),
                        attempt);
          return true;
        }
      }
      const double stale = seconds_since(last_change, now);
      if (!check.valid() && stale > std::max(2.0, 3.0 * step_s) &&
          seconds_since(last_check, now) >= 5.0) {
        last_check = now;
        check = std::async(std::launch::async, check_nodes, std::cref(o), nodes);
      }
      if (!analysis_seen && hang_analysis_since(o.job_dir, attempt_start)) analysis_seen = now;
      if (analysis_seen && seconds_since(*analysis_seen, now) > 5.0) {
        logging::warn("acc-run: mpirun outlived the hang analysis by 5 s: ending attempt {}",
                      attempt);
        return true;
      }
      resolve_open(p);
      return false;
    };
    const Ended end =
        run_attempt(argv, tick, OnStop::kForward, o.stop_grace_s, /*relay_output=*/true);
    const int rc = end.code;
    if (check.valid()) check.wait();
    kill_children();
    const double ended = wall_seconds();
    resolve_open(try_read_json(progress));  // a first step after the last tick
    if (rc == 0) {
      write_open();
      logging::info("acc-run: attempt {} finished", attempt);
      return 0;
    }
    if (g_stop_signal.load() != 0) {
      nlohmann::json inc = {{"attempt", attempt},
                            {"exit_code", rc},
                            {"nodes", nodes},
                            {"started_at", started},
                            {"ended_at", ended}};
      if (const auto p = try_read_json(progress); p && p->contains("last_step")) {
        inc["last_step"] = (*p)["last_step"];
      }
      return stop(inc, end.stopped.empty() ? "the job ended" : end.stopped);
    }
    // What failed: the hang detector's analysis of this attempt, a fault that fired in it, else
    // the exit code alone.
    nlohmann::json inc = {{"attempt", attempt},
                          {"exit_code", rc},
                          {"nodes", nodes},
                          {"started_at", started},
                          {"ended_at", ended}};
    inc["what"] = rc == kHangExitCode ? "hang" : rc >= 128 ? "signal" : "exit";
    if (const auto a = hang_analysis_since(o.job_dir, attempt_start)) {
      inc["what"] = "hang";
      inc["summary"] = (*a)["summary"];
      inc["culprits"] = (*a)["culprits"];
    }
    for (const auto& d : fs::directory_iterator(fs::path(o.job_dir) / "faults", ec)) {
      const auto f = try_read_json(d.path());  // the agent's marker of a fault that fired
      const double t = f && f->is_object() ? f->value("time", 0.0) : 0.0;
      if (t >= started && (!inc.contains("failed_at") || t < inc["failed_at"].get<double>())) {
        inc["failed_at"] = t;
        inc["fault"] = (*f)["fault"];
      }
    }
    if (inc.contains("failed_at")) inc["time_to_detect_s"] = ended - inc["failed_at"].get<double>();
    if (const auto p = try_read_json(progress); p && p->contains("last_step")) {
      inc["last_step"] = (*p)["last_step"];
    }
    if (!end.launch_failure.empty()) {  // the same program fails the same way again: no restart
      inc["what"] = "launch failed";
      inc["summary"] =
          "mpirun could not start '" + o.command[0] + "': \"" + end.launch_failure + "\"";
      inc["gave_up"] =
          "a launch failure is not restartable (a program that is not there or cannot be "
          "executed, a working directory that is not there)";
      write_open();
      write_incident(inc);
      logging::error(
          "acc-run: mpirun could not start the program '{}' (it said: \"{}\"); a launch failure "
          "is not restartable: giving up, exit code {}",
          o.command[0], end.launch_failure, kLaunchFailedExitCode);
      return kLaunchFailedExitCode;
    }
    std::vector<std::string> left, lost;
    if (lost_in_attempt) {  // just checked: the attempt was ended for it
      lost = *lost_in_attempt;
      inc["what"] = "node lost";
      inc["summary"] = "node(s) " + join(lost, ",") +
                       " stopped answering while the job made no progress (mpirun cannot start a "
                       "process there: down, or its link cut)";
      for (const auto& n : nodes) {
        if (std::find(lost.begin(), lost.end(), n) == lost.end()) left.push_back(n);
      }
    } else {
      std::tie(left, lost) = check_nodes(o, nodes);
      if (g_stop_signal.load() != 0) {  // the check was cut short: its answer means nothing
        open_incidents.push_back(inc);
        continue;
      }
    }
    inc["lost_nodes"] = lost;
    inc["nodes_after"] = left;
    inc["checked_at"] = wall_seconds();
    logging::warn("acc-run: attempt {} ended with {} ({}){}", attempt, rc,
                  inc["what"].get<std::string>(),
                  lost.empty() ? "" : "; lost node(s) " + join(lost, ","));
    if (attempt >= o.max_restarts) {
      inc["gave_up"] = "max restarts " + std::to_string(o.max_restarts) + " reached";
      write_open();
      write_incident(inc);
      logging::error("acc-run: {} restart(s) done, giving up", o.max_restarts);
      return rc >= 128 ? 1 : rc;
    }
    open_incidents.push_back(inc);
    nodes = left;
  }
}

}  // namespace acc::elastic
