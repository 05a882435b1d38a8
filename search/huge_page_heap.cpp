// The planner's tools (acc-search, bench_plan) take tcmalloc's memory from the system in 64 MiB
// regions aligned to 2 MiB and marked for transparent huge pages (madvise MADV_HUGEPAGE, which
// the kernel's default "madvise" mode honours), instead of tcmalloc's own small sbrk steps.
//
// Why: a plan-only search keeps its traces (thousands of about 130 KB each) for the time model,
// so its heap only grows, and every fresh 4 KiB page is a fault: bench_plan's cold 1.7B pass
// faulted 139,000 times for its 570 MB, and faults, tcmalloc's span Populate and the first
// touches in operator new were a third of its profile on the VM. With these regions: 3,400
// faults (benchmarks/README.md has the side-by-side times).
//
// Linked into those executables only (acc_link_fast_malloc), never into the libraries: a user's
// program keeps its allocator. ACC_HUGE_PAGES=0 leaves tcmalloc's own system allocator (the A/B
// switch for the benchmark). A kernel without transparent huge pages refuses the madvise and the
// regions are ordinary pages; a region that cannot be mapped falls back to tcmalloc's allocator.

#include <gperftools/malloc_extension.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

class HugePageHeap final : public SysAllocator {
 public:
  explicit HugePageHeap(SysAllocator* fallback) : fallback_(fallback) {}

  // tcmalloc calls it under its own lock (system-alloc.cc), one call at a time.
  void* Alloc(size_t size, size_t* actual_size, size_t alignment) override {
    const size_t align = std::max<size_t>(alignment, kPage);
    // An alignment beyond a huge page, or a size near the address space's: tcmalloc's own.
    if (align > kHuge || size > kLargest) return fall_back(size, actual_size, alignment);
    uintptr_t p = round_up(next_, align);
    if (next_ == 0 || p > end_ || size > end_ - p) {
      // A new region (what is left of the last one stays unused, never touched: no memory).
      const size_t bytes = std::max(kRegion, round_up(size, kHuge));
      void* m = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) return fall_back(size, actual_size, alignment);
      const uintptr_t base = round_up(reinterpret_cast<uintptr_t>(m), kHuge);
      (void)madvise(reinterpret_cast<void*>(base), bytes, MADV_HUGEPAGE);
      next_ = base;
      end_ = base + bytes;
      p = round_up(next_, align);
    }
    next_ = p + size;
    if (actual_size != nullptr) *actual_size = size;
    return reinterpret_cast<void*>(p);
  }

 private:
  static constexpr size_t kPage = 4096, kHuge = size_t{2} << 20, kRegion = size_t{64} << 20;
  static constexpr size_t kLargest = size_t{1} << 46;
  static uintptr_t round_up(uintptr_t x, size_t a) { return (x + a - 1) / a * a; }
  void* fall_back(size_t size, size_t* actual_size, size_t alignment) {
    return fallback_ != nullptr ? fallback_->Alloc(size, actual_size, alignment) : nullptr;
  }

  SysAllocator* fallback_;
  uintptr_t next_ = 0, end_ = 0;
};

// Before main, so that the search's heap grows from the regions. Never destroyed: tcmalloc may
// ask for memory while the process exits.
const bool kInstalled = [] {
  // Before main nothing can be refused with an exit code: another value than 0 or 1 is named on
  // stderr and the default kept.
  const char* env = std::getenv("ACC_HUGE_PAGES");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  if (env != nullptr && std::strcmp(env, "1") != 0) {
    std::fprintf(stderr, "warning: ACC_HUGE_PAGES must be 0 or 1, got '%s': huge pages stay on\n",
                 env);
  }
  // tcmalloc installs its own system allocator when it first asks the system for memory, over
  // whatever was set before: make sure that has happened (libstdc++'s start-up allocates, but a
  // program need not), and keep tcmalloc's as the fallback.
  void* volatile first = std::malloc(64);
  std::free(first);
  MallocExtension* ext = MallocExtension::instance();
  SysAllocator* own = ext->GetSystemAllocator();
  if (own == nullptr) return false;
  ext->SetSystemAllocator(new HugePageHeap(own));
  return true;
}();

}  // namespace
