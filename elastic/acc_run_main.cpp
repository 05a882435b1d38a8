// acc-run: run a training job under mpirun and restart it after a failure on the nodes left
// (elastic/README.md).
//
//   acc-run --hostfile H --nnodes MIN:MAX --nproc-per-node N --max-restarts R [--job-dir D]
//           [--mpirun-args "..."] -- ./train_gpt ... --resume auto --ckpt-dir CK
//
// Exit codes: 0 when an attempt finished, 128 + the signal when stopped by SIGTERM or SIGINT
// (forwarded to the job, which is ended), 127 when mpirun could not start the program (a launch
// failure, not restarted), else the last attempt's (1 when fewer than MIN nodes are left or it
// ended by a signal), 2 for a bad command line.

#include <CLI/CLI.hpp>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <sstream>

#include "acc/elastic/launcher.hpp"
#include "acc/util/cli.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"

int main(int argc, char** argv) {
  std::string hostfile, nnodes = "1", job_dir, mpirun_args, mpirun = "mpirun";
  int nproc = 1, restarts = 3;
  double health_timeout = 10;
  std::vector<std::string> command;
  CLI::App app{"Run a job under mpirun; after a failure, restart it on the nodes left"};
  app.add_option("--hostfile", hostfile, "one host per line (HOST [slots=N])")->required();
  app.add_option("--nnodes", nnodes, "MIN:MAX nodes (or N)")->capture_default_str();
  app.add_option("--nproc-per-node", nproc)->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--max-restarts", restarts)->check(CLI::Range(0, 1000000))->capture_default_str();
  app.add_option("--job-dir", job_dir, "default ./acc-job-<time>");
  app.add_option("--mpirun-args", mpirun_args, "extra mpirun arguments, split at blanks");
  app.add_option("--mpirun", mpirun, "the mpirun to use")->capture_default_str();
  app.add_option("--health-timeout", health_timeout, "seconds for a node's health check")
      ->check(acc::cli::seconds(0.1, acc::cli::kClosed, 3600.0))
      ->capture_default_str();
  app.footer("The program and its arguments follow --, passed as they are.");
  // Everything after "--" is the command, untouched (CLI11 would read "[...]" as a list).
  int own = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      own = i;
      break;
    }
  }
  for (int i = own + 1; i < argc; ++i) command.emplace_back(argv[i]);
  if (const auto code = acc::cli::parse(app, own, argv)) return *code;
  if (command.empty()) {
    std::fprintf(stderr, "acc-run: no program to run: give it after --\n");
    return 2;
  }
  try {
    acc::elastic::LaunchOptions o;
    o.nodes = acc::elastic::read_hostfile(hostfile);
    std::tie(o.min_nodes, o.max_nodes) = acc::elastic::parse_nnodes(nnodes);
    o.nproc_per_node = nproc;
    o.max_restarts = restarts;
    o.job_dir =
        !job_dir.empty()
            ? job_dir
            : (std::filesystem::current_path() / ("acc-job-" + std::to_string(std::time(nullptr))))
                  .string();
    std::istringstream words(mpirun_args);
    for (std::string w; words >> w;) o.mpirun_args.push_back(w);
    o.mpirun = mpirun;
    o.health_timeout_s = health_timeout;
    o.command = command;
    return acc::elastic::run_elastic(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "acc-run: error: %s\n", e.what());
    return 1;
  }
}
