#include "acc/checkpoint/checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "acc/dist/agreement.hpp"
#include "acc/io/safetensors.hpp"
#include "acc/util/checked.hpp"
#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/parse.hpp"
#include "acc/util/progress.hpp"

namespace acc::ckpt {
namespace fs = std::filesystem;
namespace {

using dist::FlatRange;
using dist::PlacementEntry;
using dist::TensorKind;

// Fault injection for the crash tests (checkpoint/README.md): ACC_CKPT_CRASH=POINT:rank=R[:step=S]
// kills rank R with SIGKILL at POINT of a save (of step S, else of any step): "mid_write" (after
// the first chunk of its shard), "before_rename" (rank 0: metadata.json written, the directory
// not yet renamed) or "after_rename" (rank 0: renamed, `latest` not yet updated).
struct CrashSpec {
  std::string point;
  int rank = 0;
  int64_t step = -1;
};

std::optional<CrashSpec> crash_spec() {
  const auto text = env::get("ACC_CKPT_CRASH");
  if (!text || text->empty()) return std::nullopt;
  CrashSpec c;
  size_t start = 0;
  for (size_t i = 0; start <= text->size(); ++i) {
    const size_t end = std::min(text->find(':', start), text->size());
    const std::string part = text->substr(start, end - start);
    if (i == 0) {
      c.point = part;
    } else if (part.rfind("rank=", 0) == 0) {
      c.rank = static_cast<int>(parse_int64(part.substr(5), "ACC_CKPT_CRASH rank"));
    } else if (part.rfind("step=", 0) == 0) {
      c.step = parse_int64(part.substr(5), "ACC_CKPT_CRASH step");
    } else {
      ACC_THROW(ValueError, "ACC_CKPT_CRASH='", *text, "': unknown part '", part,
                "' (expected POINT:rank=R[:step=S])");
    }
    start = end + 1;
  }
  ACC_CHECK(c.point == "mid_write" || c.point == "before_rename" || c.point == "after_rename",
            "ACC_CKPT_CRASH='", *text,
            "': the point must be mid_write, before_rename or "
            "after_rename, got '",
            c.point, "'");
  return c;
}

void crash_point(const char* point, int rank, int64_t step) {
  static const std::optional<CrashSpec> spec = crash_spec();
  if (spec && spec->point == point && spec->rank == rank &&
      (spec->step < 0 || spec->step == step)) {
    logging::warn("ACC_CKPT_CRASH: killing rank {} at {} of step {}", rank, point, step);
    ::kill(::getpid(), SIGKILL);
  }
}

// The elements an entry holds as one range of its tensor's row-major flattening: all that format
// version 1 stores (a whole tensor, or a flat shard of one). A box that is not one range (a column
// block) needs the boxes of format version 2.
FlatRange range_of(const PlacementEntry& e) {
  const auto runs = e.global_runs();
  if (runs.empty()) return {0, 0};
  ACC_CHECK(runs.size() == 1, "checkpoint: '", e.name, "' holds box ", e.box.to_string(), " of ",
            to_string(e.global_shape), ", which is ", runs.size(),
            " ranges of the tensor; checkpoint format version 1 stores one range per rank");
  return runs.front().first;
}

bool saved_kind(TensorKind k) {
  return k == TensorKind::kParameter || k == TensorKind::kOptimizerState;
}

// Whether this rank writes the entry: saved kinds, replica 0's holder, something held.
bool written_here(const PlacementEntry& e) {
  return saved_kind(e.kind) && e.replica == 0 && range_of(e).length > 0;
}

const char* kind_name(TensorKind k) {
  return k == TensorKind::kParameter ? "parameter" : "optimizer_state";
}

// The contiguous bytes of a placement's local tensor.
Tensor contiguous_local(const PlacementEntry& e) {
  ACC_CHECK(e.local.numel() == range_of(e).length, "checkpoint: '", e.name, "' holds ",
            e.local.numel(), " elements for a range of ", range_of(e).length);
  ACC_CHECK_TYPE(e.local.dtype() == e.dtype, "checkpoint: '", e.name, "' is ", e.local.dtype(),
                 ", its placement says ", e.dtype);
  return e.local.contiguous();
}

// One rank's shard file: chunks appended, each compressed on its own; their descriptions as JSON
// for rank 0 (file index = the rank).
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
class ShardWriter {
 public:
  ShardWriter(std::string path, int rank, int64_t step, bool pipelined)
      : path_(std::move(path)), rank_(rank), step_(step) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ACC_CHECK_AS(IoError, fd_ >= 0, "checkpoint: cannot create '", path_, "' (",
                 std::strerror(errno), ")");
    ACC_CHECK_AS(IoError, cctx_ != nullptr, "checkpoint: zstd could not make a context");
    for (int i = 0; i < (pipelined ? 3 : 1); ++i) free_.push_back(std::make_unique<Block>());
    if (pipelined) io_ = std::thread([this] { file_thread(); });
  }
  ~ShardWriter() {
    stop();
    if (fd_ >= 0) ::close(fd_);
  }

  void add(const PlacementEntry& e, const SaveOptions& o) {
    const Tensor t = contiguous_local(e);
    const auto* src = static_cast<const char*>(t.raw_data());
    const int64_t elem = static_cast<int64_t>(element_size(e.dtype));
    const int64_t per_chunk = std::max<int64_t>(1, o.chunk_bytes / elem);
    Piece piece{e, chunks_.size(), 0};
    for (int64_t k = 0; k < range_of(e).length; k += per_chunk) {
      const int64_t n = std::min(per_chunk, range_of(e).length - k);
      const size_t raw = static_cast<size_t>(n * elem);
      std::unique_ptr<Block> b = take_free();
      b->data.resize(ZSTD_compressBound(raw));
      const size_t z = ZSTD_compressCCtx(cctx_.get(), b->data.data(), b->data.size(),
                                         src + k * elem, raw, o.zstd_level);
      ACC_CHECK_AS(IoError, !ZSTD_isError(z), "checkpoint: compressing '", e.name,
                   "' failed: ", ZSTD_getErrorName(z));
      b->size = z;
      chunks_.push_back({rank_, range_of(e).offset + k, n, pos_, static_cast<int64_t>(z), 0});
      b->xxh64 = &chunks_.back().xxh64;  // the file side checksums it (deque: a stable address)
      pos_ += static_cast<int64_t>(z);
      submit(std::move(b));
    }
    piece.end = chunks_.size();
    pieces_.push_back(std::move(piece));
  }

  // Every chunk written and the file on the disk; the chunks' descriptions.
  nlohmann::json close() {
    stop();
    ACC_CHECK_AS(IoError, io_error_.empty(), io_error_);
    ACC_CHECK_AS(IoError, ::fsync(fd_) == 0, "checkpoint: flushing '", path_, "' to disk failed (",
                 std::strerror(errno), ")");
    const int rc = ::close(fd_);
    fd_ = -1;
    ACC_CHECK_AS(IoError, rc == 0, "checkpoint: closing '", path_, "' failed (",
                 std::strerror(errno), ")");
    nlohmann::json out = nlohmann::json::array();
    for (const Piece& p : pieces_) {
      nlohmann::json chunks = nlohmann::json::array();
      for (size_t i = p.begin; i < p.end; ++i) {
        const ChunkInfo& c = chunks_[i];
        chunks.push_back({{"file", c.file},
                          {"offset", c.offset},
                          {"length", c.length},
                          {"byte_offset", c.byte_offset},
                          {"byte_length", c.byte_length},
                          {"xxh64", c.xxh64}});
      }
      const PlacementEntry& e = p.entry;
      out.push_back({{"name", e.name},
                     {"kind", kind_name(e.kind)},
                     {"param", e.param},
                     {"field", e.field},
                     {"shape", e.global_shape},
                     {"dtype", dtype_name(e.dtype)},
                     {"chunks", std::move(chunks)}});
    }
    return out;
  }

 private:
  static constexpr int64_t kWritebackLagBytes = int64_t{256} << 20;
  struct Block {
    std::vector<char> data;
    size_t size = 0;
    uint64_t* xxh64 = nullptr;  // where its checksum goes
  };
  struct Piece {
    PlacementEntry entry;
    size_t begin, end;  // its chunks in chunks_
  };

  std::unique_ptr<Block> take_free() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty() || !io_error_.empty(); });
    ACC_CHECK_AS(IoError, io_error_.empty(), io_error_);
    std::unique_ptr<Block> b = std::move(free_.back());
    free_.pop_back();
    return b;
  }

  void submit(std::unique_ptr<Block> b) {
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

  void file_thread() {
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

  void stop() {
    if (!io_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    io_.join();
  }

  // Appends the block, starts its write-back and waits for what lies more than the lag behind
  // (advisory: a file system without sync_file_range leaves it all to the closing fsync).
  void write_block(const Block& b) {
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
    crash_point("mid_write", rank_, step_);
  }

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

// Rank 0: the ranks' pieces into one Metadata, every tensor's chunks sorted and checked to tile it.
Metadata assemble(const std::vector<nlohmann::json>& per_rank, int64_t step, const Header& h,
                  int world) {
  Metadata m;
  m.step = step;
  m.world = world;
  m.model_trace_hash = h.model_trace_hash;
  m.strategy = h.strategy;
  m.extra = h.extra;
  for (int r = 0; r < world; ++r) m.files.push_back(shard_file_name(r));
  std::map<std::string, TensorInfo> by_name;
  for (const nlohmann::json& pieces : per_rank) {
    for (const nlohmann::json& p : pieces) {
      TensorInfo& t = by_name[p.at("name").get<std::string>()];
      if (t.name.empty()) {
        t.name = p.at("name");
        t.kind = p.at("kind");
        t.param = p.at("param");
        t.field = p.at("field");
        t.shape = p.at("shape").get<Shape>();
        t.dtype = parse_dtype(p.at("dtype"));
      }
      ACC_CHECK(t.shape == p.at("shape").get<Shape>() && dtype_name(t.dtype) == p.at("dtype"),
                "checkpoint: ranks disagree on the shape or dtype of '", t.name, "'");
      for (const nlohmann::json& c : p.at("chunks")) {
        t.chunks.push_back({c.at("file"), c.at("offset"), c.at("length"), c.at("byte_offset"),
                            c.at("byte_length"), c.at("xxh64")});
      }
    }
  }
  for (auto& [name, t] : by_name) {
    std::sort(t.chunks.begin(), t.chunks.end(),
              [](const ChunkInfo& a, const ChunkInfo& b) { return a.offset < b.offset; });
    int64_t covered = 0;
    for (const ChunkInfo& c : t.chunks) {
      ACC_CHECK(c.offset == covered, "checkpoint: '", name, "' elements [", covered, ", ", c.offset,
                ") are ", c.offset > covered ? "held by no rank" : "held twice",
                " (the placement table does not cover it once)");
      covered = c.offset + c.length;
    }
    ACC_CHECK(covered == t.numel(), "checkpoint: '", name, "' is covered to element ", covered,
              " of ", t.numel());
    m.tensors.push_back(std::move(t));
  }
  return m;
}

// The step is committed (its directory renamed into place and the root flushed) but `latest` could
// not be moved: a save that failed, but not one whose step is lost, and the message says so.
class LatestNotMoved : public IoError {
 public:
  LatestNotMoved(const std::string& root, const std::string& dir, int64_t step,
                 const std::string& why)
      : IoError(message(root, dir, step, why)) {}

 private:
  static std::string message(const std::string& root, const std::string& dir, int64_t step,
                             const std::string& why) {
    const fs::path latest = fs::path(root) / "latest";
    std::string names = "nothing";
    if (std::ifstream in(latest); in) {
      std::string line;
      if (std::getline(in, line) && !line.empty()) names = "'" + line + "'";
    }
    const std::vector<std::string> steps = committed_steps(root);
    const std::string readers =
        !steps.empty() && steps.back() == dir
            ? "readers find step " + std::to_string(step) +
                  " all the same, as the newest committed step (they go by the step directories)"
            : "readers take the newest committed step, '" +
                  (steps.empty() ? std::string("?") : steps.back()) + "'";
    return detail::str_cat("checkpoint: step ", step, " is committed ('", dir,
                           "'), but the latest pointer was not moved (", why, "): '",
                           latest.string(), "' still names ", names, "; ", readers);
  }
};

// Rank 0's commit of a complete temporary directory (see the header).
std::string commit(const std::string& root, const std::string& tmp, const Metadata& m,
                   const SaveOptions& o) {
  write_text_file_atomically((fs::path(tmp) / "metadata.json").string(), m.to_json().dump(1),
                             "checkpoint metadata");
  const fs::path final_dir = fs::path(root) / step_dir_name(m.step);
  std::error_code ec;
  fs::path replaced;
  if (fs::exists(final_dir)) {  // the same step saved again (a resumed run): the new one wins
    replaced =
        fs::path(root) / (".replaced-" + step_dir_name(m.step) + "-" + std::to_string(::getpid()));
    fs::rename(final_dir, replaced, ec);
    ACC_CHECK_AS(IoError, !ec, "checkpoint: cannot move the earlier '", final_dir.string(),
                 "' aside: ", ec.message());
  }
  crash_point("before_rename", 0, m.step);
  fs::rename(tmp, final_dir, ec);
  ACC_CHECK_AS(IoError, !ec, "checkpoint: cannot rename '", tmp, "' to '", final_dir.string(),
               "': ", ec.message());
  fsync_path(root, "checkpoint directory");
  // Committed from here: readers take the newest step directory, whatever `latest` says.
  crash_point("after_rename", 0, m.step);
  try {
    write_text_file_atomically((fs::path(root) / "latest").string(), step_dir_name(m.step) + "\n",
                               "checkpoint latest pointer");
  } catch (const IoError& e) {
    throw LatestNotMoved(root, final_dir.string(), m.step, e.what());
  }
  if (!replaced.empty()) fs::remove_all(replaced, ec);
  if (o.keep_last > 0) {
    std::vector<std::string> steps = committed_steps(root);
    const std::string keep = final_dir.string();
    for (size_t i = 0; i + static_cast<size_t>(o.keep_last) < steps.size(); ++i) {
      if (steps[i] == keep) continue;
      fs::remove_all(steps[i], ec);
      if (ec)
        logging::warn("checkpoint: could not remove old step '{}': {}", steps[i], ec.message());
    }
  }
  return final_dir.string();
}

// A save in three parts: prepare (collective: the temporary directory), write (this rank's shard,
// nothing collective: it may run on a background thread), finish (collective: agree, commit).
struct PendingSave {
  std::optional<RootLock> lock;  // rank 0's, for this save, when the process did not hold it
  std::string root, tmp;
  int64_t step = 0;
  Header header;
  SaveOptions options;
  std::string pieces, error;            // the write's outcome
  std::string committed, commit_error;  // rank 0's commit's
};

void check_options(int64_t step, const SaveOptions& o) {
  ACC_CHECK(step >= 0 && step <= kMaxStep, "checkpoint: step must be in [0, ", kMaxStep,
            "] (the step-N names readers find), got ", step);
  ACC_CHECK(o.chunk_bytes >= 1 && o.chunk_bytes <= kMaxChunkBytes,
            "checkpoint: chunk_bytes must be in [1, ", kMaxChunkBytes, "], got ", o.chunk_bytes);
  ACC_CHECK(o.keep_last >= 0, "checkpoint: keep_last must be >= 0, got ", o.keep_last);
  ACC_CHECK(
      o.zstd_level != 0 && o.zstd_level >= ZSTD_minCLevel() && o.zstd_level <= ZSTD_maxCLevel(),
      "checkpoint: zstd_level must be in [", ZSTD_minCLevel(), ", ", ZSTD_maxCLevel(),
      "] and not 0, got ", o.zstd_level);
}

// Rank 0 takes the root's lock (unless this process holds it), makes the temporary directory
// (removing those of saves that died) and names it.
void prepare(PendingSave& p, dist::ProcessGroup& group) {
  check_options(p.step, p.options);
  std::string error;
  if (group.rank() == 0) {
    try {
      std::error_code ec;
      fs::create_directories(p.root, ec);
      ACC_CHECK_AS(IoError, !ec, "checkpoint: cannot create '", p.root, "': ", ec.message());
      p.lock = lock_for_write(p.root);
      // Every earlier writer of the root is gone now (the lock is this process's, and the kernel
      // drops a dead holder's), so what they left is nobody's save in progress.
      for (const auto& d : fs::directory_iterator(p.root)) {
        const std::string n = d.path().filename().string();
        if (n.rfind(".tmp-step-", 0) == 0 || n.rfind(".replaced-step-", 0) == 0) {
          fs::remove_all(d.path(), ec);
        }
      }
      static std::atomic<int> saves{0};
      p.tmp = (fs::path(p.root) / (".tmp-" + step_dir_name(p.step) + "-" +
                                   std::to_string(::getpid()) + "-" + std::to_string(saves++)))
                  .string();
      fs::create_directory(p.tmp, ec);
      ACC_CHECK_AS(IoError, !ec, "checkpoint: cannot create '", p.tmp, "': ", ec.message());
    } catch (const Error& e) {
      error = e.what();
    }
  }
  error = dist::broadcast_text(group, error, 0);
  ACC_CHECK_AS(IoError, error.empty(), error);
  p.tmp = dist::broadcast_text(group, p.tmp, 0);
}

// This rank's shard (an empty file when it holds nothing of replica 0). Never throws: the outcome
// is in p.pieces or p.error, for finish_save() to share.
void write_shard(PendingSave& p, const dist::PlacementTable& table, int rank, bool pipelined) {
  NoGradGuard no_grad;  // grad mode is per thread: contiguous() must not record anything
  try {
    ShardWriter w((fs::path(p.tmp) / shard_file_name(rank)).string(), rank, p.step, pipelined);
    for (const PlacementEntry& e : table) {
      if (!written_here(e)) continue;
      ACC_CHECK(e.local.defined(), "checkpoint: '", e.name, "' has no local tensor to save");
      w.add(e, p.options);
    }
    p.pieces = w.close().dump();
  } catch (const std::exception& e) {
    p.error = e.what();
  }
}

// Everyone learns whether anyone failed, with the messages of those that did: throws acc::IoError
// on every rank when any did (rank 0 removes the temporary directory). Returns the ranks' pieces on
// rank 0, for commit_here().
std::vector<nlohmann::json> agree(PendingSave& p, dist::ProcessGroup& group) {
  const int rank = group.rank();
  Tensor failed = from_vector(std::vector<int64_t>{p.error.empty() ? 0 : 1}, {1});
  group.allreduce(failed, dist::ReduceOp::kSum)->wait();
  // Each rank's pieces, or its error after a '!'.
  std::vector<std::string> texts =
      dist::allgather_text(group, p.error.empty() ? p.pieces : "!" + p.error);
  std::vector<nlohmann::json> per_rank;
  for (std::string& t : texts) {
    if (!t.empty() && t[0] == '!') {
      t.erase(0, 1);
    } else {
      if (rank == 0) per_rank.push_back(nlohmann::json::parse(t));
      t.clear();
    }
  }
  if (failed.to_vector<int64_t>()[0] > 0) {
    std::error_code ec;
    if (rank == 0) fs::remove_all(p.tmp, ec);
    ACC_THROW(IoError, "checkpoint: saving step ", p.step, " to '", p.root, "' failed, nothing ",
              "committed: ", dist::rank_messages(texts));
  }
  return per_rank;
}

// Rank 0's commit of the agreed save (nothing collective: it may run on a background thread). Never
// throws: the outcome is in p.committed or p.commit_error, for share_commit().
void commit_here(PendingSave& p, const std::vector<nlohmann::json>& per_rank, int world) {
  try {
    p.committed = commit(p.root, p.tmp, assemble(per_rank, p.step, p.header, world), p.options);
  } catch (const LatestNotMoved& e) {
    p.commit_error = e.what();  // committed: nothing to remove
  } catch (const std::exception& e) {
    p.commit_error =
        detail::str_cat("checkpoint: committing step ", p.step, " failed on rank 0: ", e.what());
    std::error_code ec;
    fs::remove_all(p.tmp, ec);
  }
}

// Every rank learns rank 0's outcome: the committed directory, or acc::IoError.
std::string share_commit(const PendingSave& p, dist::ProcessGroup& group) {
  const std::string error = dist::broadcast_text(group, p.commit_error, 0);
  ACC_CHECK_AS(IoError, error.empty(), error);
  return dist::broadcast_text(group, p.committed, 0);
}

std::string finish_save(PendingSave& p, dist::ProcessGroup& group) {
  const std::vector<nlohmann::json> per_rank = agree(p, group);
  if (group.rank() == 0) commit_here(p, per_rank, group.size());
  return share_commit(p, group);
}

// The header of a Trainer's checkpoint: the step counts of every rank's optimizer (a rank may hold
// no piece of some parameter), the model's hash and the strategy. Collective.
Header trainer_header(strategies::Trainer& trainer, const std::string& model_trace_hash,
                      nlohmann::json extra) {
  ACC_CHECK(trainer.context() != nullptr, "checkpoint: the trainer has no process group");
  dist::ProcessGroup& group = *trainer.context()->world();
  nlohmann::json mine = nlohmann::json::object();
  const optim::Optimizer& opt = trainer.optimizer();
  for (const std::string& name : opt.param_names()) mine[name] = opt.param_step(name);
  nlohmann::json steps = nlohmann::json::object();
  for (const std::string& text : dist::allgather_text(group, mine.dump())) {
    const nlohmann::json theirs = nlohmann::json::parse(text);  // items() must not outlive it
    for (const auto& [name, s] : theirs.items()) {
      steps[name] = std::max<int64_t>(steps.value(name, int64_t{0}), s.get<int64_t>());
    }
  }
  if (extra.is_null()) extra = nlohmann::json::object();
  ACC_CHECK(extra.is_object(), "checkpoint: extra must be a JSON object, got ", extra.dump());
  extra["optimizer_steps"] = steps;
  Header h;
  h.model_trace_hash = model_trace_hash;
  h.strategy = strategies::to_json(trainer.strategy());
  h.extra = std::move(extra);
  return h;
}

}  // namespace

std::string save(const std::string& root, int64_t step, const dist::PlacementTable& table,
                 const Header& header, dist::ProcessGroup& group, const SaveOptions& o) {
  progress::phase(progress::Phase::kSave);
  PendingSave p;
  p.root = root;
  p.step = step;
  p.header = header;
  p.options = o;
  prepare(p, group);
  write_shard(p, table, group.rank(), /*pipelined=*/true);
  return finish_save(p, group);
}

Metadata read_metadata(const std::string& step_dir) {
  const StepFile file = StepFile::open(step_dir, "metadata.json");
  ACC_CHECK_AS(IoError, file.size() <= kMaxMetadataBytes, "checkpoint: '", file.path(),
               "': ", file.size(), " bytes is over the limit of ", kMaxMetadataBytes,
               " bytes for a metadata.json");
  Metadata m = parse_metadata(file.read_all(), file.path());
  // Readers order steps by their directories' names: a name that disagrees with the metadata
  // would be found as another step than it is. (A copy under another name is the user's own.)
  std::string name = fs::path(step_dir).filename().string();
  if (name.empty()) name = fs::path(step_dir).parent_path().filename().string();  // "step-2/"
  const std::optional<int64_t> named = step_of_dir_name(name);
  ACC_CHECK(!named || *named == m.step, "checkpoint '", step_dir, "' is named ", name,
            " but its metadata says step ", m.step, ": it would be taken for another step");
  return m;
}

namespace {

// The placement entries load() fills and, for each, the checkpoint's tensor; checked to fit.
std::vector<std::pair<const PlacementEntry*, const TensorInfo*>> loaded_entries(
    const std::string& step_dir, const Metadata& meta, const dist::PlacementTable& table) {
  std::vector<std::pair<const PlacementEntry*, const TensorInfo*>> out;
  for (const PlacementEntry& e : table) {
    if (!saved_kind(e.kind) || range_of(e).length == 0) continue;
    const TensorInfo* t = meta.find(e.name);
    ACC_CHECK(t != nullptr, "checkpoint '", step_dir, "' has no tensor '", e.name,
              "' (another model or optimizer?)");
    ACC_CHECK_SHAPE(t->shape == e.global_shape, "checkpoint '", step_dir, "': '", e.name,
                    "' has shape ", to_string(t->shape), ", this model's is ",
                    to_string(e.global_shape));
    ACC_CHECK_TYPE(t->dtype == e.dtype, "checkpoint '", step_dir, "': '", e.name, "' is ", t->dtype,
                   ", this run's is ", e.dtype);
    ACC_CHECK(e.local.defined() && e.local.numel() == range_of(e).length && e.local.is_contiguous(),
              "checkpoint: '", e.name, "' has no contiguous local tensor of ", range_of(e).length,
              " elements to load into");
    out.emplace_back(&e, t);
  }
  return out;
}

bool overlaps(const PlacementEntry& e, const ChunkInfo& c) {
  return std::max(range_of(e).offset, c.offset) <
         std::min(range_of(e).offset + range_of(e).length, c.offset + c.length);
}

// Reads items 0..n-1 in order on its own thread, a few ahead of the consumer: get(i) waits for
// item i (rethrowing the read's error as acc::IoError), done(i) gives its buffer back. The
// destructor stops the thread, also when the consumer threw.
class ChunkReader {
 public:
  using ReadFn = std::function<void(size_t, std::vector<char>&)>;
  ChunkReader(size_t n, ReadFn read) : n_(n), read_(std::move(read)), slots_(kSlots) {
    thread_ = std::thread([this] { run(); });
  }
  ~ChunkReader() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  const std::vector<char>& get(size_t i) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return read_count_ > i || !error_.empty(); });
    ACC_CHECK_AS(IoError, read_count_ > i, error_);
    return slots_[i % kSlots];
  }
  void done(size_t i) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_count_ = i + 1;
    }
    cv_.notify_all();
  }

 private:
  static constexpr size_t kSlots = 4;
  void run() {
    for (size_t i = 0; i < n_; ++i) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || i < done_count_ + kSlots; });
        if (stop_) return;
      }
      std::string error;
      try {
        read_(i, slots_[i % kSlots]);  // the slot is the reader's until read_count_ passes i
      } catch (const std::exception& e) {
        error = e.what();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (error.empty()) {
          read_count_ = i + 1;
        } else {
          error_ = error;
        }
      }
      cv_.notify_all();
      if (!error.empty()) return;
    }
  }

  const size_t n_;
  ReadFn read_;
  std::vector<std::vector<char>> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t read_count_ = 0, done_count_ = 0;
  bool stop_ = false;
  std::string error_;
  std::thread thread_;
};

}  // namespace

void load(const std::string& step_dir, const Metadata& meta, const dist::PlacementTable& table) {
  progress::phase(progress::Phase::kLoad,
                  [&] { return "checkpoint step " + std::to_string(meta.step); });
  const auto entries = loaded_entries(step_dir, meta, table);
  // The chunks this rank reads, in order, and their files, opened (a missing one named).
  struct Read {
    const PlacementEntry* entry;
    const ChunkInfo* chunk;
  };
  std::vector<Read> reads;
  std::map<int, StepFile> files;
  for (const auto& [e, t] : entries) {
    for (const ChunkInfo& c : t->chunks) {
      if (!overlaps(*e, c)) continue;
      reads.push_back({e, &c});
      if (files.count(c.file) == 0) {
        files.emplace(c.file, StepFile::open(step_dir, meta.files.at(static_cast<size_t>(c.file))));
      }
    }
  }
  // A second thread reads the chunks ahead (a few buffers) while this one checksums and
  // decompresses them: in one thread the disk waited for those (0.7-0.8 of its cold-read rate).
  // (posix_fadvise WILLNEED ahead of the reads made loads 30% slower on this VM's disk.)
  ChunkReader reader(reads.size(), [&](size_t i, std::vector<char>& into) {
    const ChunkInfo& c = *reads[i].chunk;
    const StepFile& f = files.at(c.file);
    const std::string& where = meta.files.at(static_cast<size_t>(c.file));
    ACC_CHECK_AS(IoError, c.byte_offset + c.byte_length <= f.size(), "checkpoint '", step_dir,
                 "': shard '", where, "' is truncated: '", reads[i].entry->name, "' chunk at byte ",
                 c.byte_offset, " needs ", c.byte_length, " bytes, the file has ", f.size());
    into.resize(static_cast<size_t>(c.byte_length));
    f.read_at(c.byte_offset, into.data(), c.byte_length);
  });
  NoGradGuard no_grad;
  std::vector<char> raw;
  for (size_t i = 0; i < reads.size(); ++i) {
    const PlacementEntry& e = *reads[i].entry;
    const ChunkInfo& c = *reads[i].chunk;
    const std::vector<char>& stored = reader.get(i);
    char* dst = static_cast<char*>(e.local.raw_data());
    const int64_t elem = static_cast<int64_t>(element_size(e.dtype));
    const int64_t lo = range_of(e).offset, hi = range_of(e).offset + range_of(e).length;
    const int64_t a = std::max(lo, c.offset), b = std::min(hi, c.offset + c.length);
    const std::string what = "checkpoint '" + step_dir + "': '" + e.name + "' chunk in '" +
                             meta.files.at(static_cast<size_t>(c.file)) + "'";
    if (a == c.offset && b == c.offset + c.length) {  // the whole chunk: straight into place
      decode_chunk_into(stored.data(), stored.size(), c, e.dtype, what, dst + (a - lo) * elem);
    } else {
      decode_chunk(stored.data(), stored.size(), c, e.dtype, what, raw);
      std::memcpy(dst + (a - lo) * elem, raw.data() + (a - c.offset) * elem,
                  static_cast<size_t>((b - a) * elem));
    }
    reader.done(i);
  }
}

std::string save_trainer(const std::string& root, int64_t step, strategies::Trainer& trainer,
                         const std::string& model_trace_hash, nlohmann::json extra,
                         const SaveOptions& options) {
  const Header h = trainer_header(trainer, model_trace_hash, std::move(extra));
  return save(root, step, trainer.placements(), h, *trainer.context()->world(), options);
}

// ---- AsyncSaver ----

namespace {

// Set once by one thread, waited for by another.
class Latch {
 public:
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      set_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

}  // namespace

struct AsyncSaver::State {
  std::string root;
  SaveOptions options;
  dist::ProcessGroupPtr group;
  std::unique_ptr<PendingSave> pending;
  bool committing = false;  // the pending save's shards are agreed; rank 0 commits
  // Host copies of what this rank saves, kept for the next save (same names and sizes: the same
  // buffers, without a page fault each time).
  dist::PlacementTable snapshot;
  std::thread worker;            // the copy and the shard's write; then, on rank 0, the commit
  std::atomic<bool> done{true};  // this rank's part of the current phase
};

AsyncSaver::AsyncSaver(std::string root, SaveOptions options) : s_(std::make_unique<State>()) {
  s_->root = std::move(root);
  s_->options = options;
  check_options(0, options);
}

AsyncSaver::~AsyncSaver() {
  if (s_->worker.joinable()) s_->worker.join();
  if (s_->pending && !s_->committing) {
    // Committing takes every rank (collectives), which a destructor cannot promise: the written
    // shards stay in their temporary directory, which the next save removes.
    logging::warn(
        "checkpoint: the save of step {} was never finished (AsyncSaver::finish); "
        "it is not committed",
        s_->pending->step);
  }
}

bool AsyncSaver::pending() const {
  return s_->pending != nullptr;
}

void AsyncSaver::save(int64_t step, strategies::Trainer& trainer,
                      const std::string& model_trace_hash, nlohmann::json extra) {
  progress::phase(progress::Phase::kSave);
  if (s_->pending) finish();  // the next save waits for the previous
  ACC_CHECK(trainer.context() != nullptr, "checkpoint: the trainer has no process group");
  s_->group = trainer.context()->world();
  auto p = std::make_unique<PendingSave>();
  p->root = s_->root;
  p->step = step;
  p->options = s_->options;
  p->header = trainer_header(trainer, model_trace_hash, std::move(extra));
  prepare(*p, *s_->group);
  // The snapshot's buffers (the last save's where they fit) and the live tensors to copy into
  // them. The copy runs on the worker while the next step's forward and backward run; the step's
  // update waits for it (Trainer::before_next_update), since it changes what is copied.
  std::map<std::string, Tensor> old;
  for (PlacementEntry& e : s_->snapshot) old[e.name] = std::move(e.local);
  s_->snapshot.clear();
  std::vector<Tensor> sources;
  {
    NoGradGuard no_grad;  // contiguous() of a non-contiguous tensor must record nothing
    for (const PlacementEntry& e : trainer.placements()) {
      if (!written_here(e)) continue;
      PlacementEntry copy = e;
      auto it = old.find(e.name);
      copy.local = it != old.end() && it->second.numel() == e.local.numel() &&
                           it->second.dtype() == e.local.dtype()
                       ? it->second
                       : empty({e.local.numel()}, {e.local.dtype()});
      sources.push_back(contiguous_local(e));
      s_->snapshot.push_back(std::move(copy));
    }
  }
  old.clear();
  auto copied = std::make_shared<Latch>();
  trainer.before_next_update([copied] { copied->wait(); });
  s_->pending = std::move(p);
  s_->committing = false;
  s_->done = false;
  const int rank = s_->group->rank();
  s_->worker = std::thread([s = s_.get(), rank, sources = std::move(sources), copied]() mutable {
    for (size_t i = 0; i < sources.size(); ++i) {
      std::memcpy(s->snapshot[i].local.raw_data(), sources[i].raw_data(),
                  static_cast<size_t>(sources[i].numel()) * element_size(sources[i].dtype()));
    }
    sources.clear();
    copied->set();
    // Below the training threads from here: where the writer and training share a core, training
    // goes first and the write takes the idle time (a failure to lower it is harmless).
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
    write_shard(*s->pending, s->snapshot, rank, /*pipelined=*/false);
    s->done = true;
  });
}

std::optional<std::string> AsyncSaver::poll() {
  if (!s_->pending) return std::nullopt;
  Tensor busy = from_vector(std::vector<int64_t>{s_->done ? 0 : 1}, {1});
  s_->group->allreduce(busy, dist::ReduceOp::kSum)->wait();
  if (busy.to_vector<int64_t>()[0] > 0) return std::nullopt;
  return advance();
}

std::optional<std::string> AsyncSaver::finish() {
  if (!s_->pending) return std::nullopt;
  if (!s_->committing) advance();
  return advance();
}

std::optional<std::string> AsyncSaver::advance() {
  if (s_->worker.joinable()) s_->worker.join();
  dist::ProcessGroup& group = *s_->group;
  // Taken out while the collectives run: a failed save leaves nothing pending.
  std::unique_ptr<PendingSave> p = std::move(s_->pending);
  if (s_->committing) return share_commit(*p, group);
  std::vector<nlohmann::json> per_rank = agree(*p, group);
  s_->pending = std::move(p);
  s_->committing = true;
  s_->done = group.rank() != 0;
  if (group.rank() == 0) {  // the metadata, renames, fsyncs and old steps' removal: off training
    s_->worker = std::thread([s = s_.get(), per_rank = std::move(per_rank), world = group.size()] {
      commit_here(*s->pending, per_rank, world);
      s->done = true;
    });
  }
  return std::nullopt;
}

namespace {

// Throws acc::ValueError naming both hashes when `meta` is of another model.
void check_model(const Metadata& meta, const std::string& step_dir,
                 const std::string& model_trace_hash) {
  ACC_CHECK(meta.model_trace_hash == model_trace_hash, "checkpoint '", step_dir,
            "' is of another model: its trace hash is ", meta.model_trace_hash, ", this model's ",
            model_trace_hash);
}

// load_trainer once the metadata is read and its model checked.
void load_into(const std::string& step_dir, const Metadata& meta, strategies::Trainer& trainer) {
  const nlohmann::json* steps =
      meta.extra.contains("optimizer_steps") ? &meta.extra.at("optimizer_steps") : nullptr;
  ACC_CHECK(steps != nullptr && steps->is_object(), "checkpoint '", step_dir,
            "': extra.optimizer_steps is missing (not written by save_trainer)");
  // Step counts first into a copy of the state, checked, so a failure changes nothing of them.
  optim::Optimizer& opt = trainer.optimizer();
  optim::StateDict sd = opt.state_dict();
  const std::string suffix = ".step";
  for (auto& [key, t] : sd) {
    if (key.size() <= suffix.size() + 6 ||
        key.compare(key.size() - suffix.size(), suffix.size(), suffix)) {
      continue;
    }
    const std::string name = key.substr(6, key.size() - 6 - suffix.size());  // "state.<name>.step"
    ACC_CHECK(steps->contains(name) && steps->at(name).is_number_integer() &&
                  steps->at(name).get<int64_t>() >= 0,
              "checkpoint '", step_dir, "': extra.optimizer_steps has no step count >= 0 for '",
              name, "'");
    t = from_vector(std::vector<int64_t>{steps->at(name).get<int64_t>()}, {});
  }
  load(step_dir, meta, trainer.placements());
  opt.load_state_dict(sd);
}

}  // namespace

Metadata load_trainer(const std::string& step_dir, strategies::Trainer& trainer,
                      const std::string& model_trace_hash) {
  Metadata meta = read_metadata(step_dir);
  check_model(meta, step_dir, model_trace_hash);
  load_into(step_dir, meta, trainer);
  return meta;
}

std::optional<Resumed> resume(const std::string& root, strategies::Trainer& trainer,
                              const std::string& model_trace_hash, bool fall_back) {
  ACC_CHECK(trainer.context() != nullptr, "checkpoint: the trainer has no process group");
  dist::ProcessGroup& group = *trainer.context()->world();
  // Rank 0's list of committed steps, newest first, for every rank.
  nlohmann::json list = nlohmann::json::array();
  if (group.rank() == 0) {
    std::error_code ec;
    if (fs::is_regular_file(fs::path(root) / "metadata.json", ec)) {
      list.push_back(root);  // a step directory itself
    } else {
      const std::vector<std::string> steps = committed_steps(root);
      for (auto it = steps.rbegin(); it != steps.rend(); ++it) list.push_back(*it);
    }
  }
  list = nlohmann::json::parse(dist::broadcast_text(group, list.dump(), 0));
  if (list.empty()) return std::nullopt;
  Resumed out;
  for (const auto& entry : list) {
    const std::string dir = entry.get<std::string>();
    std::string error;
    bool other_model = false;
    try {
      out.metadata = read_metadata(dir);
      other_model = out.metadata.model_trace_hash != model_trace_hash;
      check_model(out.metadata, dir, model_trace_hash);
      load_into(dir, out.metadata, trainer);
    } catch (const Error& e) {
      error = e.what();
    }
    Tensor flags =
        from_vector(std::vector<int64_t>{error.empty() ? 0 : 1, other_model ? 1 : 0}, {2});
    group.allreduce(flags, dist::ReduceOp::kSum)->wait();
    const auto f = flags.to_vector<int64_t>();
    if (f[0] == 0) {
      out.dir = dir;
      if (!out.skipped.empty() && group.rank() == 0) {
        logging::warn("checkpoint: resumed from '{}' (skipped {} newer: {})", dir,
                      out.skipped.size(), out.skipped.front());
      }
      return out;
    }
    const std::string messages = dist::rank_messages(dist::allgather_text(group, error));
    ACC_CHECK(f[1] == 0, messages);  // another model: no older step of this root would do
    out.skipped.push_back(dir + " (" + messages + ")");
    if (group.rank() == 0) {
      logging::warn("checkpoint: '{}' does not load ({}){}", dir, messages,
                    fall_back ? "; trying the previous committed step" : "");
    }
    if (!fall_back) break;
  }
  std::string tried;
  for (const auto& s : out.skipped) tried += (tried.empty() ? "" : "; ") + s;
  ACC_THROW(IoError, "checkpoint: nothing under '", root, "' loads: ", tried);
}

size_t export_safetensors(const std::string& step_dir, const std::string& out) {
  check_outside_checkpoints(out, "export-safetensors: the output");
  const Metadata m = read_metadata(step_dir);
  dist::PlacementTable table;
  io::NamedTensors params;
  for (const TensorInfo& t : m.tensors) {
    if (t.kind != "parameter") continue;
    PlacementEntry e;
    e.name = t.name;
    e.param = t.param;
    e.kind = TensorKind::kParameter;
    e.global_shape = t.shape;
    e.dtype = t.dtype;
    e.box = dist::Box::whole(t.shape);
    e.local = empty({t.numel()}, {t.dtype});
    table.push_back(e);
    params.emplace_back(t.name, e.local.view(t.shape));
  }
  load(step_dir, m, table);
  io::Metadata meta = {{"step", std::to_string(m.step)}};
  if (m.extra.contains("model_type") && m.extra.at("model_type").is_string()) {
    meta["model_type"] = m.extra.at("model_type").get<std::string>();
  }
  if (m.extra.contains("config")) meta["config"] = m.extra.at("config").dump();
  io::save_safetensors(out, params, meta);
  return params.size();
}

}  // namespace acc::ckpt
