#pragma once
// The save protocol (checkpoint.hpp) in its parts, for save() and AsyncSaver: prepare
// (collective: the temporary directory), write (this rank's shard, nothing collective: it may run
// on a background thread), agree (collective: did every rank succeed), commit (rank 0, nothing
// collective: it may run on a background thread) and share the commit's outcome (collective).

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "acc/checkpoint/root_lock.hpp"
#include "acc/checkpoint/save.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/dist/sharding.hpp"

namespace acc::ckpt::detail {

struct PendingSave {
  std::optional<RootLock> lock;  // rank 0's, for this save, when the process did not hold it
  std::string root, tmp;
  int64_t step = 0;
  Header header;
  SaveOptions options;
  std::string pieces, error;            // the write's outcome
  std::string committed, commit_error;  // rank 0's commit's
};

/// Throws acc::ValueError for a step outside [0, kMaxStep] or bad options, naming them.
void check_options(int64_t step, const SaveOptions& o);

/// Rank 0 takes the root's lock (unless this process holds it), makes the temporary directory
/// (removing those of saves that died) and names it to every rank. Collective; throws
/// acc::IoError on every rank when rank 0 fails.
void prepare(PendingSave& p, dist::ProcessGroup& group);

/// This rank's shard (an empty file when it holds nothing of replica 0). Never throws: the outcome
/// is in p.pieces or p.error, for agree() to share.
void write_shard(PendingSave& p, const dist::PlacementTable& table, int rank, bool pipelined);

/// Everyone learns whether anyone failed, with the messages of those that did: throws acc::IoError
/// on every rank when any did (rank 0 removes the temporary directory). Returns the ranks' pieces
/// on rank 0, for commit_here().
std::vector<nlohmann::json> agree(PendingSave& p, dist::ProcessGroup& group);

/// Rank 0's commit of the agreed save (nothing collective: it may run on a background thread).
/// Never throws: the outcome is in p.committed or p.commit_error, for share_commit().
void commit_here(PendingSave& p, const std::vector<nlohmann::json>& per_rank, int world);

/// Every rank learns rank 0's outcome: the committed directory, or acc::IoError.
std::string share_commit(const PendingSave& p, dist::ProcessGroup& group);

/// agree, commit_here on rank 0, share_commit.
std::string finish_save(PendingSave& p, dist::ProcessGroup& group);

}  // namespace acc::ckpt::detail
