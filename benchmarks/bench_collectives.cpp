// bench_collectives: time of acc::dist collectives under mpirun, one JSON line per (op, size) on
// rank 0: the median over --reps of the slowest rank's time, and the bus bandwidth in the
// convention of nccl-tests (allreduce moves 2 (W - 1) / W of the buffer per rank, reduce-scatter
// and allgather (W - 1) / W).
//
//   mpirun -np 2 build/benchmarks/bench_collectives [--mib 1,16,68] [--reps 5]

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "acc/dist/dist.hpp"
#include "acc/search/calibration.hpp"
#include "acc/util/error.hpp"
#include "bench_util.hpp"

int main(int argc, char** argv) {
  std::string sizes = "1,16,68";
  int reps = 5;
  CLI::App app{"acc::dist collective timings"};
  app.add_option("--mib", sizes, "comma-separated f32 buffer sizes in MiB (the full tensor)")
      ->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions per op and size")->capture_default_str();
  std::vector<int64_t> gemm{512, 32, 128};
  int64_t wait_calls = 64;
  app.add_option("--wait-gemm", gemm,
                 "m,n,k of the GEMM each rank runs before every all-reduce of the in-step wait")
      ->delimiter(',')
      ->expected(3)
      ->capture_default_str();
  int wait_group = 0;
  app.add_option("--wait-group", wait_group,
                 "ranks of each contiguous group the in-step all-reduces are over (0: the world)")
      ->capture_default_str();
  int wait_stride = 1;
  app.add_option("--wait-stride", wait_stride,
                 "rank distance within each in-step wait group (1: contiguous, as tp's; the "
                 "group size: an outer mesh dimension's, as pp's or dp's over tp)")
      ->capture_default_str();
  app.add_option("--wait-calls", wait_calls,
                 "GEMM + all-reduce pairs of each in-step wait pass (0: no in-step wait)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  int rc = 0;
  try {
    using namespace acc;
    ACC_CHECK(reps >= 1, "--reps must be >= 1, got ", reps);
    ACC_CHECK(wait_calls >= 0, "--wait-calls must be >= 0, got ", wait_calls);
    for (int64_t d : gemm) ACC_CHECK(d >= 1, "--wait-gemm takes positive m,n,k, got ", d);
    // Every size is checked before anything is timed.
    std::vector<double> sizes_mib;
    std::stringstream ss(sizes);
    std::string item;
    while (std::getline(ss, item, ',')) {
      double mib = 0;
      size_t used = 0;
      try {
        mib = std::stod(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      ACC_CHECK(used == item.size() && mib > 0, "--mib takes positive sizes in MiB, got '", item,
                "' in '", sizes, "'");
      sizes_mib.push_back(mib);
    }
    ACC_CHECK(!sizes_mib.empty(), "--mib needs at least one size, got '", sizes, "'");
    dist::init(argc, argv);
    auto pg = dist::ProcessGroup::world();
    const int W = pg->size();
    // The search's own calibration of this group, measured first: each line then shows what the
    // search would price the collective at beside the median of the calls timed one by one.
    const search::CommCalibration fit = search::calibrate_collectives_for_search(*pg);
    for (const double mib : sizes_mib) {
      // The full buffer, rounded to a multiple of the world size.
      const int64_t n = std::max<int64_t>(W, static_cast<int64_t>(mib * (1 << 20) / 4) / W * W);
      Tensor full = ones({n}), part = ones({n / W});
      struct Op {
        const char* name;
        double bus_factor;
        std::function<dist::WorkPtr()> run;
      };
      const std::vector<Op> ops = {
          {"allreduce", 2.0 * (W - 1) / W, [&] { return pg->allreduce(full); }},
          {"reduce_scatter", 1.0 * (W - 1) / W, [&] { return pg->reduce_scatter(part, full); }},
          {"allgather", 1.0 * (W - 1) / W, [&] { return pg->allgather(full, part); }},
      };
      // The all-reduce as a step runs it: between GEMMs, every rank at once, beyond its fit
      // (search::measure_collective_wait at this size).
      double in_step_wait_ms = -1;
      if (W > 1 && wait_calls > 0) {
        in_step_wait_ms =
            1e3 * search::measure_collective_wait(*pg, wait_group > 0 ? wait_group : W,
                                                  {gemm[0], gemm[1], gemm[2], false, false},
                                                  wait_calls, fit, n * 4, wait_stride);
      }
      for (const Op& op : ops) {
        std::vector<double> ms;
        for (int i = 0; i < reps + 1; ++i) {
          pg->barrier()->wait();
          const auto t0 = std::chrono::steady_clock::now();
          op.run()->wait();
          Tensor t = from_vector(
              std::vector<float>{static_cast<float>(
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                      .count())},
              {1});
          pg->allreduce(t, dist::ReduceOp::kMax)->wait();
          if (i > 0) ms.push_back(t.item());  // the first is a warm-up
        }
        const double med = acc::bench::median(ms);
        if (pg->rank() == 0) {
          const double bytes = static_cast<double>(n) * 4;
          nlohmann::json out = {
              {"op", op.name},
              {"world", W},
              {"bytes", bytes},
              {"median_ms", med},
              {"calibrated_ms",
               W > 1 ? fit.seconds(op.name, static_cast<int64_t>(bytes)) * 1e3 : 0.0},
              {"bus_gb_per_s", bytes * op.bus_factor / (med / 1e3) / 1e9}};
          if (in_step_wait_ms >= 0 && op.name == std::string("allreduce")) {
            out["in_step_wait_ms"] = in_step_wait_ms;
          }
          std::printf("%s\n", out.dump().c_str());
          std::fflush(stdout);
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: error: %s\n", e.what());
    rc = 1;
  }
  acc::dist::finalize();
  return rc;
}
