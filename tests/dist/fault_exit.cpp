// Faults in the middle of a collective, run by fault_exit.sh under mpirun -np 2 (and under
// AddressSanitizer in scripts/test's ASan stage). Each rank prints "rank R: done" once its side
// behaved, then leaves. After a fault a rank leaves without MPI_Finalize (it would wait for the
// stuck peer), and mpirun then kills the ranks still running: so the ranks meet out of band (files
// in $FAULT_DIR) before printing, and a rank killed after "done" has passed.
//
//   timeout   rank 1 never joins an allreduce; rank 0's wait times out (1 s) and its finalize must
//             return within 2 s of the timeout (it used to drain for 10 s more).
//   unwind    rank 1 starts an allreduce and an exception unwinds past it, dropping the Work and
//             the tensor while rank 0 has not joined yet; the operation must still complete on
//             the engine's copy (no use-after-free) and both ranks leave cleanly.
//   mismatch  the ranks allreduce tensors of different sizes in chunks (ACC_MPI_MAX_COUNT), so
//             MPI fails the operation while some chunks may still be in flight; the tensor is
//             dropped at once and the heap is used, so a buffer freed under MPI shows up.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "acc/dist/dist.hpp"
#include "acc/util/error.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Both ranks reached this point (or 20 s passed): files in $FAULT_DIR, never MPI.
void meet(int rank) {
  const char* dir = std::getenv("FAULT_DIR");
  if (!dir) return;
  namespace fs = std::filesystem;
  std::FILE* f = std::fopen((fs::path(dir) / ("met." + std::to_string(rank))).c_str(), "w");
  if (f) std::fclose(f);
  const auto other = fs::path(dir) / ("met." + std::to_string(1 - rank));
  const auto t0 = Clock::now();
  while (!fs::exists(other) && ms_since(t0) < 20000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int run_timeout(int rank) {
  auto world = acc::dist::ProcessGroup::world();
  if (rank == 1) {
    meet(rank);  // never joins the allreduce
    std::printf("rank 1: done\n");
    acc::dist::finalize();
    return 0;
  }
  acc::Tensor t = acc::ones({1024});
  auto work = world->allreduce(t, acc::dist::ReduceOp::kSum, {.timeout = std::chrono::seconds(1)});
  Clock::time_point fault;
  try {
    work->wait();
    std::printf("rank 0: FAIL the allreduce completed without rank 1\n");
    return 1;
  } catch (const acc::TimeoutError& e) {
    fault = Clock::now();
    std::printf("rank 0: timed out as expected: %s\n", e.what());
  }
  work.reset();
  t = acc::Tensor();
  acc::dist::finalize();
  const double ms = ms_since(fault);
  std::printf("rank 0: finalize returned %.0f ms after the timeout\n", ms);
  if (ms >= 2000) return 1;
  meet(rank);
  std::printf("rank 0: done\n");
  return 0;
}

int run_unwind(int rank) {
  auto world = acc::dist::ProcessGroup::world();
  acc::Tensor expect_sum;
  if (rank == 1) {
    try {
      acc::Tensor t = acc::full({1 << 20}, 2.0f);
      auto work = world->allreduce(t);
      ACC_THROW(acc::ValueError, "deliberate failure with an allreduce in flight");
    } catch (const acc::ValueError& e) {
      std::printf("rank 1: unwound: %s\n", e.what());
    }
    // Churn the heap where the tensor was.
    for (int i = 0; i < 64; ++i) {
      acc::Tensor junk = acc::full({1 << 20}, -1.0f);
    }
    acc::dist::finalize();
    std::printf("rank 1: done\n");
    return 0;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // joins after rank 1 unwound
  acc::Tensor t = acc::full({1 << 20}, 1.0f);
  world->allreduce(t)->wait(std::chrono::seconds(30));
  const float v = t.data<float>()[12345];
  acc::dist::finalize();
  std::printf("rank 0: sum %.1f (expected 3.0)\n", v);
  if (v != 3.0f) return 1;
  std::printf("rank 0: done\n");
  return 0;
}

int run_mismatch(int rank) {
  auto world = acc::dist::ProcessGroup::world();
  const int64_t n = rank == 0 ? 4096 : 5000;
  try {
    acc::Tensor t = acc::ones({n});
    world->allreduce(t, acc::dist::ReduceOp::kSum, {.timeout = std::chrono::seconds(5)})->wait();
    std::printf("rank %d: the mismatched allreduce completed\n", rank);
  } catch (const acc::Error& e) {
    std::printf("rank %d: failed as it may: %s\n", rank, e.what());
  }
  for (int i = 0; i < 64; ++i) {
    acc::Tensor junk = acc::full({4096}, -1.0f);
  }
  meet(rank);
  std::printf("rank %d: done\n", rank);
  acc::dist::finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach the file even if mpirun kills us
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    acc::dist::init(argc, argv);
    const int rank = acc::dist::rank();
    if (mode == "timeout") return run_timeout(rank);
    if (mode == "unwind") return run_unwind(rank);
    if (mode == "mismatch") return run_mismatch(rank);
    std::fprintf(stderr, "usage: fault_exit timeout|unwind|mismatch\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fault_exit: unexpected error: %s\n", e.what());
  }
  acc::dist::finalize();
  return 2;
}
