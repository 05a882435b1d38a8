#pragma once
// Sharded checkpoints: every rank writes the parameters and optimizer state it holds, as the
// strategy layer's placement table says (strategies/placement.hpp), and any rank of any layout
// reads back exactly the regions it holds. No case per strategy: a whole replica (ddp) is written
// once (by replica 0's holder), a flat shard (zero, fsdp) by its owner, and a loader of another
// world size or method finds its regions in the chunks that overlap them.
//
// Commit protocol (save): the shards go into ROOT/.tmp-step-NNNNNNNN-<id>/ and are fsynced; the
// ranks then agree that every one succeeded (any failure fails the save on every rank, naming the
// ranks and their errors, and nothing is committed); rank 0 writes metadata.json (temporary +
// fsync + rename), renames the directory to ROOT/step-NNNNNNNN, fsyncs ROOT, and points
// ROOT/latest at it the same way. A reader therefore sees a committed step whole or not at all; a
// crash at any point leaves the previous committed step loadable (a leftover .tmp-* directory is
// removed by the next save, which holds the root's lock: root_lock.hpp).
//
// Format: acc/checkpoint/format.hpp and checkpoint/README.md. The namespace is acc::ckpt
// (acc::recompute, acc/autograd/recompute.hpp, is activation recomputation; the strategy method
// that applies it keeps the name "checkpoint" in strategy JSON, as ATorch calls it).

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "acc/checkpoint/format.hpp"
#include "acc/checkpoint/layout.hpp"
#include "acc/checkpoint/root_lock.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/dist/sharding.hpp"
#include "acc/strategies/strategy.hpp"

namespace acc::ckpt {

struct SaveOptions {
  int64_t chunk_bytes = int64_t{4} << 20;  // uncompressed bytes per chunk, at most
  /// zstd's level: -1 (a fast level) by default. fp32 weights and optimizer state barely compress
  /// (level 1: 1.08x on a trained GPT, level -1: 1.003x) and level 1 halves the load speed
  /// (benchmarks/bench_checkpoint: 0.93 against 1.81 GB/s); a higher level buys smaller files.
  int zstd_level = -1;
  int keep_last = 0;  // committed steps kept after this one (0: all)
};

/// What the checkpoint says about its run, besides the tensors.
struct Header {
  std::string model_trace_hash;
  nlohmann::json strategy = nlohmann::json::array();
  nlohmann::json extra = nlohmann::json::object();  // schedule position, RNG, data position, ...
};

/// Saves the parameters and optimizer state of `table` as step `step` under `root` (created when
/// missing); returns the committed step directory. A collective over `group`: every rank calls it
/// with its own table. Rank 0 writes under the root's lock: its own for the save when no
/// RootLock of this process holds it (root_lock.hpp). Throws acc::IoError on every rank when any
/// rank fails (nothing committed, the previous steps untouched), another job holds the root's
/// lock (naming it), or, once the step is committed, `latest` cannot be moved (saying so);
/// acc::ValueError for a step outside [0, kMaxStep] or bad options.
std::string save(const std::string& root, int64_t step, const dist::PlacementTable& table,
                 const Header& header, dist::ProcessGroup& group, const SaveOptions& options = {});

/// metadata.json of a step directory, validated (format.hpp). Throws acc::IoError when it cannot
/// be read or the directory leads out of its root through a symlink (layout.hpp), acc::ValueError
/// naming the field when it is malformed or hostile, or when a step-N directory's name disagrees
/// with its metadata's step.
Metadata read_metadata(const std::string& step_dir);

/// Fills the parameter and optimizer-state entries of `table` in place (their `local` tensors)
/// from the checkpoint in `step_dir`, described by `meta` (read_metadata): for each entry it reads
/// only the chunks that overlap the entry's range, checks each chunk's bytes against the file's
/// size and its xxh64 before decompressing, and copies the overlap. Every rank reads what it needs
/// on its own (nothing collective). Throws acc::ValueError naming what differs when the table does
/// not fit the checkpoint (a tensor missing from it, another shape or dtype), and acc::IoError
/// naming the file and chunk for a missing, unreadable (the system's error named) or truncated
/// shard, one reached through a symlink out of the checkpoint root, a checksum mismatch or a chunk
/// that does not decompress to its size. Gradients are not in checkpoints and are left alone.
void load(const std::string& step_dir, const Metadata& meta, const dist::PlacementTable& table);

/// A Trainer's parameters, optimizer state and optimizer step counts (every rank's, gathered into
/// metadata.extra["optimizer_steps"]), with the model's trace hash and the trainer's strategy in
/// the header and `extra` beside them. A collective over the trainer's group; as save().
std::string save_trainer(const std::string& root, int64_t step, strategies::Trainer& trainer,
                         const std::string& model_trace_hash, nlohmann::json extra = {},
                         const SaveOptions& options = {});

/// save_trainer without stopping training for the write: save() gathers the header (collective)
/// and starts a background thread that copies the state this rank saves to host memory while the
/// next step's forward and backward run (that step's update waits for the copy: Trainer::
/// before_next_update) and then writes the shard. poll(), called at each step boundary (one small
/// all-reduce while a save is pending, nothing otherwise), agrees once every rank's write is done,
/// and then hands the commit to rank 0's background thread; a later poll() returns the committed
/// directory. finish() does what is left at once. A save() while one is pending finishes that one
/// first. Until the next step() the trainer's state must change only through step() (call finish()
/// before loading into it). save(), poll() and finish() are collectives over the trainer's group;
/// errors are those of save(), thrown by the call that learns them. Rank 0 holds the root's lock
/// from save() until the commit's outcome is known, unless this process holds it already (a job's
/// RootLock). The copy's buffers are kept for the next save (one host copy of this rank's share of
/// the state). Dropping a saver with a save pending leaves it uncommitted unless rank 0 was already
/// committing it (logged; the next save removes its temporary directory).
class AsyncSaver {
 public:
  explicit AsyncSaver(std::string root, SaveOptions options = {});
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  void save(int64_t step, strategies::Trainer& trainer, const std::string& model_trace_hash,
            nlohmann::json extra = {});
  /// The committed step directory when this call learnt that the pending save is committed.
  std::optional<std::string> poll();
  /// Waits for the pending save and commits it; std::nullopt when none was pending.
  std::optional<std::string> finish();
  bool pending() const;

 private:
  // Takes the pending save one phase on once every rank's part of the current one is done: the
  // writes agreed and rank 0's commit started, or the commit's outcome shared.
  std::optional<std::string> advance();
  struct State;
  std::unique_ptr<State> s_;
};

/// Loads a checkpoint written by save_trainer from any layout into `trainer` (any world size and
/// data-parallel method): parameters, optimizer state and step counts. Throws acc::ValueError
/// naming both hashes when the checkpoint is of another model (`model_trace_hash` differs), and
/// what load() throws. Returns the checkpoint's metadata (step, extra) for the caller's own state.
/// Not collective.
Metadata load_trainer(const std::string& step_dir, strategies::Trainer& trainer,
                      const std::string& model_trace_hash);

/// Writes every parameter of the checkpoint in `step_dir`, whole, to a safetensors file at `out`
/// (PyTorch's safetensors loads it; train_gpt --init-from takes it), with the step and, when the
/// checkpoint's extra has them, model_type and config in its metadata. Returns the number of
/// tensors. Throws acc::IoError before reading anything when `out` lies inside a checkpoint
/// (check_outside_checkpoints: its own input included), and what read_metadata, load and
/// io::save_safetensors (temporary file, fsync, rename) throw.
size_t export_safetensors(const std::string& step_dir, const std::string& out);

struct Resumed {
  std::string dir;  // the step directory loaded
  Metadata metadata;
  std::vector<std::string> skipped;  // newer committed steps that failed to load, with why
};

/// Resumes `trainer` from the newest loadable checkpoint under `root` (or from `root` itself when
/// it is a step directory): the newest committed step first (resolve), then, when `fall_back`, each
/// older committed step in turn while loading fails on any rank (a corrupt or missing shard, a
/// checksum mismatch), logging which it skipped and why. Collective over the trainer's group: rank
/// 0 lists the steps, and every rank loads the same one (a failure on one rank fails that step on
/// all). Returns std::nullopt when there is no committed step at all. Throws acc::IoError naming
/// every step tried and the ranks' errors when none loads (or the first fails and fall_back is
/// off), and acc::ValueError at once for a checkpoint of another model (falling back would not
/// help).
std::optional<Resumed> resume(const std::string& root, strategies::Trainer& trainer,
                              const std::string& model_trace_hash, bool fall_back = true);

}  // namespace acc::ckpt
