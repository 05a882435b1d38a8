#pragma once
// Runs a shell command for the end-to-end tests of the command-line tools: its exit code and
// its stdout and stderr together.

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace acc::test {

struct CommandResult {
  int exit_code;       // -1 when the command did not exit normally (a signal) or popen failed
  std::string output;  // stdout + stderr
};

inline CommandResult run_command(const std::string& command) {
  CommandResult r{0, ""};
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  while (fgets(buf, sizeof(buf), p)) r.output += buf;
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace acc::test
