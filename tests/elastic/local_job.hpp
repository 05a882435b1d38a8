#pragma once
// acc-run on this machine's localhost, as the elastic and example tests launch a job under it.
// Needs the compile definitions ACC_RUN_BIN and MPIEXEC_BIN of the tests that include it.

#include <filesystem>
#include <fstream>
#include <string>

namespace acc::test {

/// The command that runs `program` (a command line) under acc-run with `ranks` ranks on one node
/// (localhost, oversubscribed, unbound), `max_restarts`, the job directory dir/job and the
/// environment assignments `env` ("ACC_FAULT=...") and `mpirun_args` added to mpirun's; writes
/// its hostfile dir/hosts.
inline std::string local_acc_run(const std::filesystem::path& dir, int ranks, int max_restarts,
                                 const std::string& env, const std::string& program,
                                 const std::string& mpirun_args = "") {
  { std::ofstream(dir / "hosts") << "localhost slots=" << ranks << "\n"; }
  return env + " " + ACC_RUN_BIN + " --hostfile " + (dir / "hosts").string() +
         " --nnodes 1 --nproc-per-node " + std::to_string(ranks) + " --max-restarts " +
         std::to_string(max_restarts) + " --job-dir " + (dir / "job").string() + " --mpirun " +
         MPIEXEC_BIN + " --mpirun-args '--oversubscribe --bind-to none" +
         (mpirun_args.empty() ? "" : " " + mpirun_args) + "' -- " + program;
}

}  // namespace acc::test
