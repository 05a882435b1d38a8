#include "shard_writer.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "acc/util/error.hpp"
#include "acc/util/progress.hpp"
#include "entries.hpp"

namespace acc::ckpt::detail {

using dist::PlacementEntry;

ShardWriter::ShardWriter(std::string path, int rank, int64_t step, bool pipelined)
    : path_(std::move(path)), rank_(rank), step_(step) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ACC_CHECK_AS(IoError, fd_ >= 0, "checkpoint: cannot create '", path_, "' (", std::strerror(errno),
               ")");
  ACC_CHECK_AS(IoError, cctx_ != nullptr, "checkpoint: zstd could not make a context");
  for (int i = 0; i < (pipelined ? 3 : 1); ++i) free_.push_back(std::make_unique<Block>());
  if (pipelined) io_ = std::thread([this] { file_thread(); });
}

ShardWriter::~ShardWriter() {
  stop();
  if (fd_ >= 0) ::close(fd_);
}

void ShardWriter::add(const PlacementEntry& e, const SaveOptions& o) {
  const Tensor t = contiguous_local(e);
  const auto* src = static_cast<const char*>(t.raw_data());
  const int64_t elem = static_cast<int64_t>(element_size(e.dtype));
  const int64_t per_chunk = std::max<int64_t>(1, o.chunk_bytes / elem);
  // The held elements are the box's, or a flat range of them; a chunk is a flat range of the box
  // unless it holds all of it.
  const int64_t held = e.held_numel(), box_numel = e.box.numel();
  const int64_t base = e.flat ? e.flat->offset : 0;
  Piece piece{e, chunks_.size(), 0};
  for (int64_t k = 0; k < held; k += per_chunk) {
    const int64_t n = std::min(per_chunk, held - k);
    const size_t raw = static_cast<size_t>(n * elem);
    std::unique_ptr<Block> b = take_free();
    b->data.resize(ZSTD_compressBound(raw));
    const size_t z = ZSTD_compressCCtx(cctx_.get(), b->data.data(), b->data.size(), src + k * elem,
                                       raw, o.zstd_level);
    ACC_CHECK_AS(IoError, !ZSTD_isError(z), "checkpoint: compressing '", e.name,
                 "' failed: ", ZSTD_getErrorName(z));
    b->size = z;
    ChunkInfo c;
    c.file = rank_;
    c.box = e.box;
    if (n != box_numel) c.flat = dist::FlatRange{base + k, n};
    c.byte_offset = pos_;
    c.byte_length = static_cast<int64_t>(z);
    chunks_.push_back(std::move(c));
    b->xxh64 = &chunks_.back().xxh64;  // the file side checksums it (deque: a stable address)
    pos_ += static_cast<int64_t>(z);
    submit(std::move(b));
  }
  piece.end = chunks_.size();
  pieces_.push_back(std::move(piece));
}

nlohmann::json ShardWriter::close() {
  stop();
  ACC_CHECK_AS(IoError, io_error_.empty(), io_error_);
  ACC_CHECK_AS(IoError, ::fsync(fd_) == 0, "checkpoint: flushing '", path_, "' to disk failed (",
               std::strerror(errno), ")");
  const int rc = ::close(fd_);
  fd_ = -1;
  ACC_CHECK_AS(IoError, rc == 0, "checkpoint: closing '", path_, "' failed (", std::strerror(errno),
               ")");
  // In metadata.json's own form (Metadata::to_json), but for the checksums: numbers here.
  nlohmann::json out = nlohmann::json::array();
  for (const Piece& p : pieces_) {
    nlohmann::json chunks = nlohmann::json::array();
    for (size_t i = p.begin; i < p.end; ++i) {
      const ChunkInfo& c = chunks_[i];
      nlohmann::json j = {{"file", c.file}, {"offsets", c.box.offsets}, {"sizes", c.box.sizes}};
      if (c.flat) j["flat"] = {{"offset", c.flat->offset}, {"length", c.flat->length}};
      j["byte_offset"] = c.byte_offset;
      j["byte_length"] = c.byte_length;
      j["xxh64"] = c.xxh64;
      chunks.push_back(std::move(j));
    }
    const PlacementEntry& e = p.entry;
    out.push_back({{"name", e.name},
                   {"kind", dist::tensor_kind_name(e.kind)},
                   {"param", e.param},
                   {"field", e.field},
                   {"shape", e.global_shape},
                   {"dtype", dtype_name(e.dtype)},
                   {"chunks", std::move(chunks)}});
  }
  return out;
}

std::unique_ptr<ShardWriter::Block> ShardWriter::take_free() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !free_.empty() || !io_error_.empty(); });
  ACC_CHECK_AS(IoError, io_error_.empty(), io_error_);
  std::unique_ptr<Block> b = std::move(free_.back());
  free_.pop_back();
  return b;
}

void ShardWriter::submit(std::unique_ptr<Block> b) {
  if (!io_.joinable()) {  // not pipelined: write it here
    write_block(*b);
    free_.push_back(std::move(b));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    full_.push_back(std::move(b));
  }
  cv_.notify_all();
}

void ShardWriter::file_thread() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return !full_.empty() || done_; });
    if (full_.empty()) return;
    std::unique_ptr<Block> b = std::move(full_.front());
    full_.pop_front();
    lock.unlock();
    std::string error;
    try {
      write_block(*b);
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    free_.push_back(std::move(b));
    if (!error.empty()) {
      io_error_ = error;
      cv_.notify_all();
      return;
    }
    cv_.notify_all();
  }
}

void ShardWriter::stop() {
  if (!io_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  io_.join();
}

void ShardWriter::write_block(const Block& b) {
  *b.xxh64 = XXH64(b.data.data(), b.size, 0);
  const char* data = b.data.data();
  size_t n = b.size;
  while (n > 0) {
    const ssize_t w = ::write(fd_, data, n);
    if (w < 0 && errno == EINTR) continue;
    ACC_CHECK_AS(IoError, w > 0, "checkpoint: writing '", path_, "' failed (",
                 std::strerror(w < 0 ? errno : EIO), ")");
    data += w;
    n -= static_cast<size_t>(w);
  }
  (void)::sync_file_range(fd_, written_, static_cast<off_t>(b.size), SYNC_FILE_RANGE_WRITE);
  written_ += static_cast<int64_t>(b.size);
  const int64_t target = written_ - kWritebackLagBytes;
  if (target > synced_) {
    (void)::sync_file_range(
        fd_, synced_, target - synced_,
        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    synced_ = target;
  }
  progress::point(progress::Point::kMidWrite, step_);  // the crash tests kill a rank here
}

}  // namespace acc::ckpt::detail
