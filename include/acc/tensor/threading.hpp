#pragma once
// One threading policy for the process: set_num_threads(n) sizes OpenBLAS and the TBB arena
// together, so that ranks x threads never exceeds the cores. The default comes from
// ACC_NUM_THREADS, else 1 (multi-rank runs oversubscribe otherwise; single-process tools pass
// --threads).

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cstdint>

namespace acc {

/// How GEMMs use the threads: kOpenBlas lets OpenBLAS run its own pthreads; kTbb keeps OpenBLAS
/// single-threaded and splits each large GEMM into per-thread blocks run as TBB tasks, so that one
/// pool serves everything (no OpenBLAS threads spinning while TBB works). ACC_GEMM_THREADING=
/// openblas|tbb chooses; the default is the faster one measured on this machine
/// (benchmarks/README.md).
enum class GemmThreading { kOpenBlas, kTbb };
/// Throws acc::ValueError when ACC_GEMM_THREADING holds anything else.
GemmThreading gemm_threading();
void set_gemm_threading(GemmThreading mode);

/// Throws acc::ValueError unless n >= 1.
void set_num_threads(int n);
int get_num_threads();
/// Applies ACC_NUM_THREADS (default 1) unless set_num_threads was already called.
void init_threads_from_env();

namespace detail {
bool use_parallel(int64_t n, int64_t grain);
}

/// fn(begin, end) over [0, n) in chunks of at least `grain` items, in parallel when more than one
/// thread is configured. Callers must make chunks independent.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& fn) {
  if (n <= 0) return;
  if (!detail::use_parallel(n, grain)) {
    fn(int64_t{0}, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, grain),
                    [&](const tbb::blocked_range<int64_t>& r) { fn(r.begin(), r.end()); });
}

}  // namespace acc
