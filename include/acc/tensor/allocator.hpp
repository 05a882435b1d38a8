#pragma once
// Host memory for tensors. Every tensor allocation goes through here so that the bytes in use and
// their peak are known exactly (the memory estimator of the search is validated against these
// figures). Freed blocks are kept in a size-binned cache and reused, so a training loop in its
// steady state does no system allocation and takes no page faults; ACC_ALLOCATOR=malloc turns
// the cache off (every free returns memory to the system), which is useful under valgrind.
// Blocks of 2 MiB and more are mapped 2 MiB aligned and advised for transparent huge pages (fewer
// TLB misses in strided passes over large activations); ACC_HUGE_PAGES=0 turns that off.

#include <cstddef>
#include <cstdint>

namespace acc::memory {

/// A block of host memory; `capacity` is what it really holds (at least the bytes asked for).
struct Block {
  void* ptr = nullptr;
  size_t capacity = 0;
};

/// 64-byte aligned block of at least `nbytes`; counted in current/peak (as `nbytes`). Sizes are
/// rounded up to a bin (below 1 MiB a multiple of 4 KiB, above it one of four steps per power of
/// two); a cached block of that bin is reused, else one of the next bin up (so that a tensor just
/// over a power of two, such as one with padded rows, and one of exactly that size can share
/// blocks), else a new block is taken from the system. Throws acc::OutOfMemoryError when the
/// system is out of memory or the allocation would pass set_limit()'s budget.
Block allocate(size_t nbytes);
/// Returns a block from allocate(); `nbytes` must be the size it was requested with.
void deallocate(const Block& block, size_t nbytes);

/// A budget for current_bytes(): an allocation that would take it past `bytes` throws
/// acc::OutOfMemoryError naming both figures and allocates nothing (0: no budget, the default).
/// Process-wide; the strategy search sets it around each dry-run so that a candidate over the
/// budget fails as it would on a smaller machine. Throws acc::ValueError when negative.
void set_limit(int64_t bytes);
int64_t limit();

/// Sets the limit for a scope and restores the previous one.
class LimitGuard {
 public:
  explicit LimitGuard(int64_t bytes) : previous_(limit()) { set_limit(bytes); }
  ~LimitGuard() { set_limit(previous_); }
  LimitGuard(const LimitGuard&) = delete;
  LimitGuard& operator=(const LimitGuard&) = delete;

 private:
  int64_t previous_;
};

/// Bytes held by live tensors (requested sizes, not rounded).
int64_t current_bytes();
/// Highest current_bytes() since start or the last reset_peak().
int64_t peak_bytes();
/// Sets the peak to the current figure.
void reset_peak();
/// Bytes held from the system, live plus cached.
int64_t reserved_bytes();
/// Returns every cached block to the system.
void empty_cache();

}  // namespace acc::memory
