#include "acc/tensor/threading.hpp"

#include <cblas.h>
#include <tbb/global_control.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "acc/util/env.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

GemmThreading mode_from_env() {
  const std::string m = env::get_string("ACC_GEMM_THREADING", "openblas");
  if (m == "openblas") return GemmThreading::kOpenBlas;
  if (m == "tbb") return GemmThreading::kTbb;
  ACC_THROW(ValueError, "ACC_GEMM_THREADING must be openblas or tbb, got '", m, "'");
}

struct ThreadState {
  std::mutex mu;
  std::atomic<int> threads{0};  // 0: not configured yet
  GemmThreading gemm = mode_from_env();
  std::unique_ptr<tbb::global_control> control;
};

ThreadState& thread_state() {
  static ThreadState* s = new ThreadState();
  return *s;
}

}  // namespace

void set_num_threads(int n) {
  ACC_CHECK(n >= 1, "number of threads must be >= 1, got ", n);
  ThreadState& s = thread_state();
  std::lock_guard<std::mutex> lock(s.mu);
  openblas_set_num_threads(s.gemm == GemmThreading::kTbb ? 1 : n);
  s.control.reset();
  s.control =
      std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism, n);
  s.threads = n;
}

GemmThreading gemm_threading() {
  return thread_state().gemm;
}

void set_gemm_threading(GemmThreading mode) {
  ThreadState& s = thread_state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.gemm = mode;
  }
  if (s.threads.load() > 0) set_num_threads(s.threads.load());
}

int get_num_threads() {
  int n = thread_state().threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  init_threads_from_env();
  return thread_state().threads.load();
}

void init_threads_from_env() {
  if (thread_state().threads.load() > 0) return;
  int64_t n = env::get_int("ACC_NUM_THREADS", 1);
  ACC_CHECK(n >= 1 && n <= 1024, "ACC_NUM_THREADS must be in [1, 1024], got ", n);
  set_num_threads(static_cast<int>(n));
}

namespace detail {
bool use_parallel(int64_t n, int64_t grain) {
  return n > grain && get_num_threads() > 1;
}
}  // namespace detail

}  // namespace acc
