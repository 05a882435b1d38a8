#include "acc/checkpoint/save.hpp"

#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

#include "acc/checkpoint/format.hpp"
#include "acc/checkpoint/layout.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/tensor/node.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/progress.hpp"
#include "entries.hpp"
#include "save_protocol.hpp"
#include "shard_writer.hpp"

namespace acc::ckpt {
namespace fs = std::filesystem;
namespace detail {
namespace {

using dist::PlacementEntry;

// Rank 0: the ranks' pieces into one Metadata, every tensor's chunks sorted (by box, then flat
// range: the same order whatever the ranks) and checked to tile it.
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
        t.kind = dist::parse_tensor_kind(p.at("kind"), "checkpoint: '" + t.name + "'");
        t.param = p.at("param");
        t.field = p.at("field");
        t.shape = p.at("shape").get<Shape>();
        t.dtype = parse_dtype(p.at("dtype"));
      }
      ACC_CHECK(t.shape == p.at("shape").get<Shape>() && dtype_name(t.dtype) == p.at("dtype"),
                "checkpoint: ranks disagree on the shape or dtype of '", t.name, "'");
      for (const nlohmann::json& c : p.at("chunks")) {
        ChunkInfo ci;
        ci.file = c.at("file");
        ci.box.offsets = c.at("offsets").get<std::vector<int64_t>>();
        ci.box.sizes = c.at("sizes").get<std::vector<int64_t>>();
        if (c.contains("flat")) {
          ci.flat = dist::FlatRange{c.at("flat").at("offset"), c.at("flat").at("length")};
        }
        ci.byte_offset = c.at("byte_offset");
        ci.byte_length = c.at("byte_length");
        ci.xxh64 = c.at("xxh64");
        t.chunks.push_back(std::move(ci));
      }
    }
  }
  for (auto& [name, t] : by_name) {
    std::sort(t.chunks.begin(), t.chunks.end(), [](const ChunkInfo& a, const ChunkInfo& b) {
      const int64_t fa = a.flat ? a.flat->offset : 0, fb = b.flat ? b.flat->offset : 0;
      return std::tie(a.box.offsets, a.box.sizes, fa) < std::tie(b.box.offsets, b.box.sizes, fb);
    });
    if (const std::optional<TilingError> e = tiling_error(t)) {
      const std::string chunk = e->chunk
                                    ? "the chunk of " + t.chunks[*e->chunk].region() + " (rank " +
                                          std::to_string(t.chunks[*e->chunk].file) + "'s) "
                                    : "its chunks ";
      ACC_THROW(ValueError, "checkpoint: '", name, "': ", chunk, e->message,
                " (the placement tables of the ranks do not cover it exactly once)");
    }
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
    return acc::detail::str_cat("checkpoint: step ", step, " is committed ('", dir,
                                "'), but the latest pointer was not moved (", why, "): '",
                                latest.string(), "' still names ", names, "; ", readers);
  }
};

// Rank 0's commit of a complete temporary directory (checkpoint.hpp's commit protocol).
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
  progress::point(progress::Point::kBeforeRename, m.step);
  fs::rename(tmp, final_dir, ec);
  ACC_CHECK_AS(IoError, !ec, "checkpoint: cannot rename '", tmp, "' to '", final_dir.string(),
               "': ", ec.message());
  fsync_path(root, "checkpoint directory");
  // Committed from here: readers take the newest step directory, whatever `latest` says.
  progress::point(progress::Point::kAfterRename, m.step);
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

}  // namespace

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

void commit_here(PendingSave& p, const std::vector<nlohmann::json>& per_rank, int world) {
  try {
    p.committed = commit(p.root, p.tmp, assemble(per_rank, p.step, p.header, world), p.options);
  } catch (const LatestNotMoved& e) {
    p.commit_error = e.what();  // committed: nothing to remove
  } catch (const std::exception& e) {
    p.commit_error = acc::detail::str_cat("checkpoint: committing step ", p.step,
                                          " failed on rank 0: ", e.what());
    std::error_code ec;
    fs::remove_all(p.tmp, ec);
  }
}

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

}  // namespace detail

std::string save(const std::string& root, int64_t step, const dist::PlacementTable& table,
                 const Header& header, dist::ProcessGroup& group, const SaveOptions& o) {
  progress::phase(progress::Phase::kSave);
  detail::PendingSave p;
  p.root = root;
  p.step = step;
  p.header = header;
  p.options = o;
  detail::prepare(p, group);
  detail::write_shard(p, table, group.rank(), /*pipelined=*/true);
  return detail::finish_save(p, group);
}

}  // namespace acc::ckpt
