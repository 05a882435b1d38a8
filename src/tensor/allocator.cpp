#include "acc/tensor/allocator.hpp"

#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "acc/util/env.hpp"
#include "acc/util/error.hpp"

namespace acc::memory {
namespace {

constexpr size_t kAlign = 64;
// Blocks of at least this size are mapped on their own, 2 MiB aligned, and advised for
// transparent huge pages: with 4 KiB pages the strided passes over large activations (GEMM
// packing, the rows of a (B, T, 3C) qkv tensor) miss the TLB on nearly every row.
constexpr size_t kHugePage = size_t{2} << 20;

// Sizes are rounded up to a bin so that blocks of nearly equal size are shared: below 1 MiB to a
// multiple of 4 KiB, above it to one of four steps per power of two (at most 25% slack).
size_t bin_size(size_t n) {
  if (n == 0) return kAlign;
  if (n < (1u << 20)) return (n + 4095) & ~size_t{4095};
  size_t p = size_t{1} << (63 - __builtin_clzll(n));  // largest power of two <= n
  size_t step = p / 4;
  return (n + step - 1) / step * step;
}

struct State {
  std::mutex mu;
  std::multimap<size_t, void*> cache;  // bin size -> free block
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> reserved{0};
  std::atomic<int64_t> limit{0};  // 0: none
  bool caching = env::get_string("ACC_ALLOCATOR", "caching") != "malloc";
  bool huge_pages = env::get_int("ACC_HUGE_PAGES", 1) != 0;
};

State& state() {
  static State* s = new State();  // never destroyed: tensors may outlive static destruction
  return *s;
}

bool is_huge(size_t bin) {
  return bin >= kHugePage && state().huge_pages;
}

// A 2 MiB aligned mapping of `bytes` advised for huge pages, or null.
void* map_huge(size_t bytes) {
  const size_t len = bytes + kHugePage;
  void* raw = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + len, used_end = aligned + bytes;
  const size_t page = 4096;
  const uintptr_t tail = (used_end + page - 1) & ~(page - 1);
  if (end > tail) munmap(reinterpret_cast<void*>(tail), end - tail);
  void* p = reinterpret_cast<void*>(aligned);
  madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP the block still works
  return p;
}

void system_free(void* p, size_t bin) {
  if (is_huge(bin)) {
    munmap(p, bin);
  } else {
    std::free(p);
  }
}

void* system_alloc(size_t bytes) {
  auto try_alloc = [bytes] {
    return is_huge(bytes) ? map_huge(bytes) : std::aligned_alloc(kAlign, bytes);
  };
  void* p = try_alloc();
  if (p == nullptr) {
    // Give the cache back and try once more before reporting.
    empty_cache();
    p = try_alloc();
  }
  ACC_CHECK_AS(OutOfMemoryError, p != nullptr, "out of memory allocating ", bytes,
               " bytes (in use ", state().current.load(), ", reserved ", state().reserved.load(),
               ")");
  return p;
}

}  // namespace

Block allocate(size_t nbytes) {
  State& s = state();
  const size_t bin = bin_size(nbytes);
  // Counted first, so that the budget is checked against the figure this allocation makes.
  const int64_t n = static_cast<int64_t>(nbytes);
  const int64_t cur = s.current.fetch_add(n) + n;
  const int64_t limit = s.limit.load();
  if (limit > 0 && cur > limit) {
    s.current.fetch_sub(n);
    ACC_THROW(OutOfMemoryError, "allocating ", nbytes, " bytes would bring tensor memory to ", cur,
              " bytes, over the budget of ", limit, " bytes (acc::memory::set_limit)");
  }
  Block b;
  if (s.caching) {
    std::lock_guard<std::mutex> lock(s.mu);
    // The smallest cached block of this bin or the next one up.
    auto it = s.cache.lower_bound(bin);
    if (it != s.cache.end() && it->first <= bin_size(bin + 1)) {
      b = {it->second, it->first};
      s.cache.erase(it);
    }
  }
  if (b.ptr == nullptr) {
    try {
      b = {system_alloc(bin), bin};
    } catch (...) {
      s.current.fetch_sub(n);
      throw;
    }
    s.reserved += static_cast<int64_t>(bin);
  }
  int64_t pk = s.peak.load();
  while (cur > pk && !s.peak.compare_exchange_weak(pk, cur)) {
  }
  return b;
}

void deallocate(const Block& block, size_t nbytes) {
  if (block.ptr == nullptr) return;
  State& s = state();
  s.current -= static_cast<int64_t>(nbytes);
  if (s.caching) {
    std::lock_guard<std::mutex> lock(s.mu);
    s.cache.emplace(block.capacity, block.ptr);
    return;
  }
  s.reserved -= static_cast<int64_t>(block.capacity);
  system_free(block.ptr, block.capacity);
}

void set_limit(int64_t bytes) {
  ACC_CHECK(bytes >= 0, "memory limit must be >= 0 bytes (0: none), got ", bytes);
  state().limit = bytes;
}
int64_t limit() {
  return state().limit.load();
}

int64_t current_bytes() {
  return state().current.load();
}
int64_t peak_bytes() {
  return state().peak.load();
}
void reset_peak() {
  state().peak.store(state().current.load());
}
int64_t reserved_bytes() {
  return state().reserved.load();
}

void empty_cache() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& [bin, p] : s.cache) {
    system_free(p, bin);
    s.reserved -= static_cast<int64_t>(bin);
  }
  s.cache.clear();
}

}  // namespace acc::memory
