#include "acc/checkpoint/load.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "acc/checkpoint/layout.hpp"
#include "acc/tensor/node.hpp"
#include "acc/util/error.hpp"
#include "acc/util/progress.hpp"
#include "load_plan.hpp"

namespace acc::ckpt {
namespace fs = std::filesystem;

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
  const std::vector<detail::ChunkRead> reads = detail::plan_load(step_dir, meta, table);
  // The files of the chunks to read, opened (a missing one named).
  std::map<int, StepFile> files;
  for (const detail::ChunkRead& r : reads) {
    const int f = r.chunk->file;
    if (files.count(f) == 0) {
      files.emplace(f, StepFile::open(step_dir, meta.files.at(static_cast<size_t>(f))));
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
                 "': shard '", where, "' is truncated: '", reads[i].tensor->name,
                 "' chunk at byte ", c.byte_offset, " needs ", c.byte_length,
                 " bytes, the file has ", f.size());
    into.resize(static_cast<size_t>(c.byte_length));
    f.read_at(c.byte_offset, into.data(), c.byte_length);
  });
  NoGradGuard no_grad;
  std::vector<char> raw;
  for (size_t i = 0; i < reads.size(); ++i) {
    const detail::ChunkRead& r = reads[i];
    const ChunkInfo& c = *r.chunk;
    const std::vector<char>& stored = reader.get(i);
    const int64_t elem = static_cast<int64_t>(element_size(r.tensor->dtype));
    const std::string what = "checkpoint '" + step_dir + "': '" + r.tensor->name + "' chunk in '" +
                             meta.files.at(static_cast<size_t>(c.file)) + "'";
    if (r.targets.size() == 1 && r.targets[0].whole(c)) {  // straight into place
      char* dst = static_cast<char*>(r.targets[0].entry->local.raw_data());
      decode_chunk_into(stored.data(), stored.size(), c, r.tensor->dtype, what,
                        dst + r.targets[0].copies[0].dst * elem);
    } else {
      decode_chunk(stored.data(), stored.size(), c, r.tensor->dtype, what, raw);
      for (const detail::Target& t : r.targets) {
        char* dst = static_cast<char*>(t.entry->local.raw_data());
        for (const detail::Copy& copy : t.copies) {
          std::memcpy(dst + copy.dst * elem, raw.data() + copy.src * elem,
                      static_cast<size_t>(copy.length * elem));
        }
      }
    }
    reader.done(i);
  }
}

}  // namespace acc::ckpt
