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

/// 64-byte aligned block of at least `nbytes`; counted in current/peak. Throws acc::Error when
/// the system is out of memory.
void* allocate(size_t nbytes);
/// Returns a block from allocate(); `nbytes` must be the size it was allocated with.
void deallocate(void* ptr, size_t nbytes);

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
