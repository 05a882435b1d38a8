#pragma once
// Fault injection for the crash tests (checkpoint/README.md).

#include <cstdint>

namespace acc::ckpt::detail {

/// ACC_CKPT_CRASH=POINT:rank=R[:step=S] kills rank R with SIGKILL at POINT of a save (of step S,
/// else of any step): "mid_write" (after the first chunk of its shard), "before_rename" (rank 0:
/// metadata.json written, the directory not yet renamed) or "after_rename" (rank 0: renamed,
/// `latest` not yet updated). Throws acc::ValueError for a malformed ACC_CKPT_CRASH.
void crash_point(const char* point, int rank, int64_t step);

}  // namespace acc::ckpt::detail
