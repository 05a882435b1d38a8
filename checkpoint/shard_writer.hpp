#pragma once
// The storage side of a save: one rank's shard file, chunks appended, each compressed with zstd on
// its own and checksummed with xxh64; their descriptions as JSON for rank 0 (file index = the
// rank).
//
// The disk works while the next chunks compress: each chunk's write-back is started as soon as it
// is written (sync_file_range), so the closing fsync finds little left to flush (it was a third of
// a save's time when the whole shard was flushed at the end); the write-back of chunks more than
// kWritebackLagBytes behind is waited for, which bounds the dirty pages of a large shard (a lag of
// 32 MiB made the 17M GPT's save 20% slower: the disk wants deep queues). Pipelined (a synchronous
// save, where training waits anyway), the checksums and writes run on a second thread while the
// caller compresses the next chunks: compression, and checksum plus the copy into the page cache,
// each take about half the disk's time here, and in one thread they added up to more than it
// (bench_checkpoint: 0.75 of the disk's rate in one thread, 0.93 pipelined). An async save's
// writer stays one thread beside training.

#include <zstd.h>

#include <nlohmann/json.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "acc/checkpoint/format.hpp"
#include "acc/checkpoint/save.hpp"
#include "acc/dist/sharding.hpp"

namespace acc::ckpt::detail {

class ShardWriter {
 public:
  /// Creates the file at `path` (rank `rank`'s shard of step `step`). Throws acc::IoError when it
  /// cannot.
  ShardWriter(std::string path, int rank, int64_t step, bool pipelined);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  /// Appends the entry's held elements, in chunks of at most o.chunk_bytes. Throws acc::IoError
  /// when compressing or (already) writing failed.
  void add(const dist::PlacementEntry& e, const SaveOptions& o);
  /// Every chunk written and the file on the disk (fsynced, closed); the chunks' descriptions, one
  /// object per entry added. Throws acc::IoError naming the file and the system's error.
  nlohmann::json close();

 private:
  static constexpr int64_t kWritebackLagBytes = int64_t{256} << 20;
  struct Block {
    std::vector<char> data;
    size_t size = 0;
    uint64_t* xxh64 = nullptr;  // where its checksum goes
  };
  struct Piece {
    dist::PlacementEntry entry;
    size_t begin, end;  // its chunks in chunks_
  };

  std::unique_ptr<Block> take_free();
  void submit(std::unique_ptr<Block> b);
  void file_thread();
  void stop();
  // Appends the block, starts its write-back and waits for what lies more than the lag behind
  // (advisory: a file system without sync_file_range leaves it all to the closing fsync).
  void write_block(const Block& b);

  std::string path_;
  int rank_;
  int64_t step_;
  int fd_ = -1;
  // One compression context and a few output buffers for the whole shard: a context or a 4 MiB
  // buffer made per chunk costs its page faults every time (they were most of a save's time).
  std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> cctx_{ZSTD_createCCtx(), ZSTD_freeCCtx};
  int64_t pos_ = 0;  // the file's size once every submitted chunk is written
  std::vector<Piece> pieces_;
  std::deque<ChunkInfo> chunks_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Block>> free_;
  std::deque<std::unique_ptr<Block>> full_;
  bool done_ = false;
  std::string io_error_;
  int64_t written_ = 0, synced_ = 0;  // the file side's
  std::thread io_;
};

}  // namespace acc::ckpt::detail
