#pragma once
// The processes of an elastic test's job, and acc-run started in the background so that a test
// can signal it.

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace acc::test {

/// The processes whose environment has ACC_JOB_DIR=job (mpirun exports it to every rank), by pid
/// and command: what a job left behind (other tests' jobs, running beside, have other ones).
inline std::vector<std::string> processes_of(const std::filesystem::path& job) {
  const std::string want = "ACC_JOB_DIR=" + job.string();
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& d : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string pid = d.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream env(d.path() / "environ", std::ios::binary);
    std::string var;
    while (std::getline(env, var, '\0')) {
      if (var == want) {
        std::ifstream cmd(d.path() / "cmdline");
        std::string c;
        std::getline(cmd, c, '\0');
        out.push_back(pid + " " + c);
        break;
      }
    }
  }
  return out;
}

/// The processes of the job once none is left, or those still there `within` from now.
inline std::vector<std::string> processes_left(const std::filesystem::path& job,
                                               std::chrono::duration<double> within) {
  const auto until = std::chrono::steady_clock::now() + within;
  std::vector<std::string> left = processes_of(job);
  while (!left.empty() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    left = processes_of(job);
  }
  return left;
}

/// A shell command run in the background (sh -c, with `exec` so that the pid is the command's),
/// its output to a file.
class Background {
 public:
  Background(const std::string& command, const std::filesystem::path& output) : output_(output) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Background() {
    if (pid_ > 0 && !status_) {  // a failed test: leave nothing running
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }
  /// Its exit code once it ends within `within` (minus the signal when one killed it: 143 is an
  /// exit code, -15 death by SIGTERM), else nullopt.
  std::optional<int> wait(std::chrono::duration<double> within) {
    const auto until = std::chrono::steady_clock::now() + within;
    while (!status_) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
      } else if (std::chrono::steady_clock::now() >= until) {
        return std::nullopt;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    return status_;
  }
  std::string output() const {
    std::ifstream in(output_);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

 private:
  pid_t pid_ = -1;
  std::filesystem::path output_;
  std::optional<int> status_;
};

}  // namespace acc::test
